"""`python -m trainer.checkpoint inspect|verify|export`: exit codes through a real subprocess,
output checks in-process (main(argv), same code, no interpreter start-up), and the export
loading into the plain model with identical logits."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from datetime import datetime

import pytest
import torch

from trainer.checkpoint import CheckpointReader
from trainer.checkpoint.__main__ import _fmt_written, main
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


def test_a_missing_path_is_one_error_line_naming_it_and_what_is_valid_with_exit_2(tmp_path, capsys):
    missing = str(tmp_path / "runs" / "step_000000001")
    r = _cli("inspect", missing)  # the real command: scripts see its rc, users its stderr
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [
        f"error: {missing}: no such file or directory; valid: a checkpoint directory "
        "(step_NNNNNNNNN) or a folder holding them"
    ]
    for args in (("verify", missing), ("export", missing, str(tmp_path / "out"))):
        rc, out, err = _main(capsys, *args)
        assert rc == 2 and out == "" and len(err.splitlines()) == 1, (args, out, err)
        assert err.startswith(f"error: {missing}: no such file or directory; valid: ") and (
            "step_NNNNNNNNN" in err
        ), err
    assert not (tmp_path / "out").exists()


def test_verify_of_an_empty_step_directory_fails(tmp_path, capsys):
    (tmp_path / "step_000000001").mkdir()
    rc, out, _ = _main(capsys, "verify", str(tmp_path / "step_000000001"))
    assert rc == 1 and "no such checkpoint directory (or it is empty)" in out


def _state(step: int, **extra) -> dict:
    """A trainer-like state: tokens seen follow from step x global batch x data.seq_len."""
    model = {"name": "tiny", "dim": 64, "n_layers": 2}
    return dict(
        step=step,
        strategy="FULL_SHARD",
        global_batch_size=8,
        data={"seq_len": 16},
        model_config=model,
        **extra,
    )


def _written(path: str) -> str:
    """The manifest's created_unix as inspect shows it: local time to the minute."""
    with CheckpointReader(path) as r:
        return datetime.fromtimestamp(r.manifest["created_unix"]).isoformat(" ", "minutes")


AGE = r" \((just now|\d+ min ago)\)"


def test_inspect_of_a_root_shows_model_dtype_tokens_loss_and_when_written(
    tmp_path, tensors, ck, capsys
):
    # as the trainer stores them: every model/* tensor float32 (1,102 elements in the sample)
    f32 = {k: t.float() if t.is_floating_point() else t for k, t in tensors.items()}

    def save(step: int, world_size: int, state: dict) -> str:
        return ck.save_ranks(str(tmp_path), step, f32, world_size, state=state, keep=9)

    paths = {
        "10": save(10, 2, _state(10)),  # written before loss and tokens_seen were recorded
        "20": save(20, 3, _state(20, loss=2.345678, tokens_seen=999_999)),
        "30": save(30, 1, {"strategy": "NO_SHARD"}),  # no model_config, no data: no tokens
        "40": save(40, 1, _state(40, loss=None, param_dtype="bfloat16")),
    }
    rc, out, _ = _main(capsys, "inspect", str(tmp_path))
    lines = out.splitlines()
    header = "step world strategy model dtype tokens loss written valid"
    assert rc == 0 and lines[0].split() == header.split(), out
    assert all(len(line) <= 100 for line in lines), out
    rows = {line.split()[0]: line for line in lines[1:]}
    cells = {step: row.split()[1:7] for step, row in rows.items()}
    assert cells["20"] == ["3", "FULL_SHARD", "tiny", "1.1K", "float32", "1.0M"], out
    assert cells["10"] == ["2", "FULL_SHARD", "tiny", "1.1K", "float32", "1.3K"], out
    assert cells["30"] == ["1", "NO_SHARD", "1.1K", "float32", "-", "-"], out
    assert cells["40"][4] == "bfloat16", out  # the param dtype the state records wins
    assert rows["20"].split()[7] == "2.3457" and rows["10"].split()[7] == "-", out
    assert rows["40"].split()[7] == "-", out
    for step, path in paths.items():
        assert re.search(re.escape(_written(path)) + AGE + "  yes$", rows[step]), out
    at = lines[0].index("written")  # aligned
    assert all(rows[step].index(_written(path)) == at for step, path in paths.items()), out


def test_inspect_of_one_checkpoint_labels_model_dtype_tokens_loss_and_written(
    tmp_path, tensors, ck, capsys
):
    new = ck.save_ranks(str(tmp_path), 20, tensors, 2, state=_state(20, loss=2.5, tokens_seen=2560))
    old = ck.save_ranks(str(tmp_path), 10, tensors, 2, state=_state(10))
    bare = ck.save_ranks(str(tmp_path), 5, tensors, 1, state={"strategy": "NO_SHARD"})
    rc, out, _ = _main(capsys, "inspect", new)
    assert rc == 0
    for line in (
        "model:       tiny (dim 64 x 2 layers)",
        "parameters:  1,102 (model/* tensors; 5 tensors in all)",
        "dtype:       bfloat16+float32",
        "tokens seen: 2,560",
        "loss:        2.5000",
    ):
        assert line in out.splitlines(), out
    assert re.search("^written:     " + re.escape(_written(new)) + AGE + "$", out, re.M), out
    rc, out, _ = _main(capsys, "inspect", old)
    assert rc == 0 and "tokens seen: 1,280" in out and "loss:        -" in out, out
    rc, out, _ = _main(capsys, "inspect", bare)
    assert rc == 0 and "tokens seen: -" in out and "model:       - (no model_config" in out, out


def test_written_age_reads_in_minutes_hours_or_days():
    t = 1_700_000_000.0
    when = datetime.fromtimestamp(t).isoformat(" ", "minutes")
    assert _fmt_written(t, now=t + 30) == f"{when} (just now)"
    assert _fmt_written(t, now=t + 3 * 60 + 59) == f"{when} (3 min ago)"
    assert _fmt_written(t, now=t + 5 * 3600) == f"{when} (5 h ago)"
    assert _fmt_written(t, now=t + 3 * 86400) == f"{when} (3 days ago)"
    assert _fmt_written(t, now=t - 3600) == f"{when} (in the future: clocks differ)"


@pytest.mark.parametrize(
    "key, value, valid",
    [
        ("loss", float("nan"), "a finite number or null"),
        ("loss", float("inf"), "a finite number or null"),
        ("loss", "2.3", "a finite number or null"),
        ("tokens_seen", -1, "an integer in [0, "),
        ("tokens_seen", 1.5, "an integer in [0, "),
    ],
)
def test_a_state_with_a_bad_loss_or_tokens_seen_is_invalid_naming_the_field(
    tmp_path, tensors, ck, capsys, key, value, valid
):
    path = ck.save_ranks(str(tmp_path), 3, tensors, 1, state=_state(3, **{key: value}))
    rc, out, _ = _main(capsys, "inspect", path)
    assert rc == 1 and f"manifest state.{key}=" in out and f"; valid: {valid}" in out, out


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
