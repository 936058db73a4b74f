"""`python -m trainer.checkpoint inspect|verify|export`: exit codes through a real subprocess,
output checks in-process (main(argv), same code, no interpreter start-up), and the export
loading into the plain model with identical logits."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from trainer.checkpoint.__main__ import main
from trainer.checkpoint.export import export, load_exported
from trainer.checkpoint.keys import optim_key, param_key
from trainer.config import model_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.checkpoint", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _main(capsys, *args) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_inspect_and_verify_report_a_sound_then_a_corrupt_checkpoint(tmp_path, tensors, ck, capsys):
    root = str(tmp_path)
    ck.save_ranks(root, 10, tensors, world_size=2, state={"strategy": "HYBRID_SHARD"})
    p20 = ck.save_ranks(root, 20, tensors, world_size=3, state={"strategy": "FULL_SHARD"})

    rc, out, _ = _main(capsys, "inspect", p20)
    assert rc == 0
    n_params = sum(t.numel() for k, t in tensors.items() if k.startswith("model/"))
    for line in (
        "step:        20",
        "world size:  3",
        "strategy:    FULL_SHARD",
        f"parameters:  {n_params:,}",
        "valid:       yes",
    ):
        assert line in out, out
    rc, out, _ = _main(capsys, "verify", p20)  # the sample's deliberate NaN, Inf and -Inf
    assert rc == 1 and "'model/layers.0.attention.wq.weight' (float32): 3 non-finite" in out
    rc, out, _ = _main(capsys, "verify", "--allow-nonfinite", p20)
    assert rc == 0 and "OK" in out

    shard = f"{p20}/rank-00002-of-00003.bin"
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    bad = _cli("verify", "--allow-nonfinite", p20)  # the real command: scripts see its rc
    assert bad.returncode == 1
    assert (
        "1 problem(s)" in bad.stdout and "rank-00002-of-00003.bin: checksum mismatch" in bad.stdout
    )

    os.remove(f"{p20}/manifest.json")
    rc, out, _ = _main(capsys, "inspect", root)
    assert rc == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "NO: " in rows["20"] and "not committed" in rows["20"]
    assert rows["10"].split()[1:3] == ["2", "HYBRID_SHARD"] and rows["10"].endswith("yes")
    rc, out, _ = _main(capsys, "inspect", p20)
    assert rc == 1 and "not committed" in out


def test_verify_of_a_missing_path_fails(tmp_path, capsys):
    rc, out, _ = _main(capsys, "verify", str(tmp_path / "step_000000001"))
    assert rc == 1 and "no such checkpoint directory" in out


def _tiny_model_checkpoint(tmp_path, ck, world_size: int):
    model_mod = pytest.importorskip("trainer.model")
    cfg = model_config("tiny", dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=64)
    model = model_mod.build_model(cfg, "cpu", seed=3)
    tensors = {param_key(k): v.detach() for k, v in model.state_dict().items()}
    tensors[optim_key("output.weight", "exp_avg")] = torch.randn(cfg.vocab_size, cfg.dim)
    state = {"strategy": "FULL_SHARD", "model_config": dataclasses.asdict(cfg)}
    path = ck.save_ranks(str(tmp_path / "ckpt"), 5, tensors, world_size=world_size, state=state)
    return model_mod, model, path


def test_export_loads_into_the_plain_model_with_identical_logits(tmp_path, ck):
    model_mod, model, path = _tiny_model_checkpoint(tmp_path, ck, world_size=3)
    summary = export(path, str(tmp_path / "out"))
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    cfg, weights = load_exported(str(tmp_path / "out"))
    assert "optim/output.weight/exp_avg" not in weights and "output.weight" in weights
    fresh = model_mod.build_model(cfg, "cpu", seed=99)  # different init, then overwritten
    fresh.load_state_dict(weights, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))


def test_export_cli_writes_safetensors_and_config(tmp_path, ck):
    _, model, path = _tiny_model_checkpoint(tmp_path, ck, world_size=2)
    r = _cli("export", path, str(tmp_path / "out"), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    cfg, weights = load_exported(str(tmp_path / "out"))
    assert cfg.dim == 64 and all(w.dtype == torch.bfloat16 for w in weights.values())
    assert torch.equal(weights["norm.weight"], model.norm.weight.detach().bfloat16())


def test_export_without_model_config_says_what_is_missing(tmp_path, tensors, ck, capsys):
    path = ck.save_ranks(str(tmp_path), 1, tensors, world_size=1, state={"strategy": "NO_SHARD"})
    rc, _, err = _main(capsys, "export", path, str(tmp_path / "out"))
    assert rc == 1 and "no 'model_config'" in err
