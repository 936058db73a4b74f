"""trainer/hf/ against transformers itself: tiny random Llama models built here (nothing is
downloaded) in four shapes - plain, grouped-query attention, tied embeddings, Llama 3 rope
scaling - import with the same logits, train the same at world sizes 1, 2 and 3 (each rank
reading only its byte ranges), and export back into what AutoModelForCausalLM loads, bitwise
for a round trip."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.dist_utils import run_distributed
from tests.hf.tiny import ours_from_hf, transformers_first_loss
from trainer.checkpoint import CheckpointReader, list_checkpoints
from trainer.config import ConfigError, DataConfig, ModelConfig, ShardingConfig, TrainerConfig
from trainer.data import prepare
from trainer.fsdp import NO_INIT, build_mesh, parallelize
from trainer.fsdp.state import full_parameters, load_params
from trainer.hf import (
    HFWeights,
    config_from_hf,
    export_hf,
    import_hf,
    read_hf_config,
    resolve_model,
)
from trainer.hf.__main__ import main as hf_main
from trainer.model import build_model

transformers = pytest.importorskip("transformers")

SHAPES = {
    "plain": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "llama3_rope": dict(
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}


def hf_model(shape: str, seed: int = 0):
    kw = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    kw.update(SHAPES[shape])
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Each shape saved by transformers: 'gqa' sharded into several files with an index."""
    out = {}
    for shape in SHAPES:
        path = tmp_path_factory.mktemp(shape)
        hf_model(shape).save_pretrained(path, max_shard_size="40KB" if shape == "gqa" else "1GB")
        out[shape] = path
    return out


TOKENS = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_an_imported_model_gives_transformers_logits(saved, shape):
    cfg, ours = ours_from_hf(saved[shape])
    assert (cfg.kv_heads, cfg.tie_embeddings, cfg.rope_scaling) == (
        SHAPES[shape]["num_key_value_heads"],
        shape == "tied",
        "llama3" if shape == "llama3_rope" else None,
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved[shape], dtype=torch.float32)
    with torch.no_grad():
        assert rel(ours(TOKENS), reference(TOKENS).logits) < 1e-5


def test_the_rotary_permutation_matters(saved):
    """Loading q/k without the row permutation changes the logits: the test above can fail."""
    cfg, ours = ours_from_hf(saved["plain"])
    st = HFWeights(str(saved["plain"]), cfg).st
    with torch.no_grad():
        q = ours.layers[0].attention.wq.weight
        q.copy_(st.read("model.layers.0.self_attn.q_proj.weight", 0, q.numel()).view(q.shape))
        reference = transformers.AutoModelForCausalLM.from_pretrained(saved["plain"])
        assert rel(ours(TOKENS), reference(TOKENS).logits) > 1e-3


@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(hidden_act="gelu"), r"hidden_act='gelu'; valid: silu"),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
            r"rope_type='yarn'; valid: default",
        ),
        (dict(attention_bias=True), r"attention_bias=True; valid: false"),
        (
            dict(model_type="gemma"),
            r"model_type='gemma'; valid: llama \(LlamaForCausalLM\), qwen2 \(Qwen2ForCausalLM\), "
            r"qwen3 \(Qwen3ForCausalLM\), mistral \(MistralForCausalLM\)",
        ),
    ],
)
def test_a_config_the_model_cannot_represent_is_refused_by_name(saved, edit, match):
    hf = {**read_hf_config(str(saved["plain"])), **edit}
    hf.pop("rope_parameters", None) if "rope_scaling" in edit else None
    with pytest.raises(ConfigError, match=match):
        config_from_hf(hf)


def test_transformers_4_config_fields_are_read_too(saved):
    """Published Llama 3 checkpoints spell rope as rope_theta + rope_scaling (transformers 4)."""
    hf = read_hf_config(str(saved["llama3_rope"]))
    params = hf.pop("rope_parameters")
    hf["rope_theta"] = params.pop("rope_theta")
    hf["rope_scaling"] = params
    assert config_from_hf(hf) == config_from_hf(read_hf_config(str(saved["llama3_rope"])))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_weights_are_refused_naming_the_tensor_or_file(saved, tmp_path):
    cfg = config_from_hf(read_hf_config(str(saved["gqa"])))
    broken = _copy(saved["gqa"], tmp_path / "missing_file")
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (broken / gone).unlink()
    with pytest.raises(ConfigError, match=rf"{gone} is missing"):
        HFWeights(str(broken), cfg)

    shaped = _copy(saved["plain"], tmp_path / "shape")
    tensors = load_file(shaped / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, shaped / "model.safetensors")
    with pytest.raises(
        ConfigError, match=r"up_proj\.weight' has shape \[95, 64\]; the config says \[96, 64\]"
    ):
        HFWeights(str(shaped), config_from_hf(read_hf_config(str(shaped))))

    extra = _copy(saved["plain"], tmp_path / "extra")
    tensors = load_file(extra / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    save_file(tensors, extra / "model.safetensors")
    with pytest.raises(
        ConfigError, match=r"unknown tensor 'model\.layers\.0\.self_attn\.rotary_emb\.inv_freq'"
    ):
        HFWeights(str(extra), config_from_hf(read_hf_config(str(extra))))

    with pytest.raises(ConfigError, match=r"model\.hf_path=.*nowhere.*has no config\.json"):
        resolve_model(ModelConfig(name="hf", hf_path=str(tmp_path / "nowhere")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_import_then_export_returns_the_original_tensors_bitwise(saved, tmp_path, dtype):
    src = tmp_path / "src"
    hf_model("gqa").to(dtype).save_pretrained(src)
    path = import_hf(str(src), str(tmp_path / "ckpt"), log=lambda *_: None)
    assert (
        CheckpointReader(path).step == 0
        and list_checkpoints(str(tmp_path / "ckpt"))[0].problem is None
    )
    export_hf(path, str(tmp_path / "out"), dtype, log=lambda *_: None)
    want, got = (
        load_file(src / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == dtype, name
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


# ----------------------------------------------------------------------------- the engine


def _load_on_ranks(rank, world, path):
    cfg = config_from_hf(read_hf_config(path), hf_path=path)
    sharding = ShardingConfig()
    fsdp = parallelize(
        build_model(cfg), sharding, build_mesh(sharding, rank, world, world), "cpu", init_fn=NO_INIT
    )
    weights = HFWeights(path, cfg)
    total = sum(math.prod(s) for s in weights.expected.values()) * 4
    load_params(fsdp, weights.read)
    params = full_parameters(fsdp)
    return dict(bytes_read=weights.bytes_read, total=total, params=params if rank == 0 else None)


def test_import_at_world_sizes_2_and_3_reads_only_each_ranks_byte_ranges(saved):
    path = str(saved["gqa"])
    whole = run_distributed(_load_on_ranks, 1, path)[0]
    assert whole["bytes_read"] == whole["total"]
    _, reference = ours_from_hf(saved["gqa"])
    for world in (2, 3):
        ranks = run_distributed(_load_on_ranks, world, path)
        read = [r["bytes_read"] for r in ranks]
        # q/k ranges are rounded out to whole heads (their rows are permuted within a head):
        # at most one head of each of the 2 x 2 q/k projections extra per rank.
        head_slack = 4 * 16 * 64 * 4
        assert sum(read) <= whole["total"] + world * head_slack, read
        assert max(read) <= whole["total"] / world + head_slack + 64 * 300 * 4, read
        for name, p in reference.named_parameters():
            assert torch.equal(ranks[0]["params"][name], p.detach()), (world, name)


def _train_from_hf(rank, world, cfg, root):
    from trainer.loop import WorkerContext, run_training

    with contextlib.redirect_stdout(io.StringIO()) as out:
        r = run_training(cfg, WorkerContext(rank=rank, world_size=world, checkpoint_root=root))
    return dict(losses=r.losses, last=r.last_checkpoint, printed=out.getvalue())


@pytest.fixture(scope="module")
def hf_job(saved, tmp_path_factory):
    c = TrainerConfig(model=ModelConfig(name="hf", hf_path=str(saved["llama3_rope"])))
    d = tmp_path_factory.mktemp("data")
    c.data = DataConfig(max_bytes=200_000, prepared_dir=str(d / "prep"), seq_len=32)
    c.train.steps, c.train.global_batch_size, c.train.checkpoint_every = 4, 6, 0
    c.optim.warmup_steps = 1
    prepare(c.data)
    return c


def test_an_imported_model_trains_the_same_at_world_sizes_1_2_and_3(hf_job, tmp_path):
    runs = {
        w: run_distributed(_train_from_hf, w, hf_job, str(tmp_path / f"w{w}"))[0] for w in (1, 2, 3)
    }
    assert "initialised from" in runs[1]["printed"]
    ref = [loss for _, loss in runs[1]["losses"]]
    assert ref[-1] < ref[0]  # it trains
    for w in (2, 3):
        assert [loss for _, loss in runs[w]["losses"]] == pytest.approx(ref, rel=1e-5), w
    # and its first loss is transformers' on the same first batch: it really started from them
    assert runs[1]["losses"][0][1] == pytest.approx(transformers_first_loss(hf_job), rel=1e-4)


def test_a_trained_checkpoint_exported_as_hf_loads_in_transformers_with_our_logits(
    hf_job, tmp_path
):
    root = str(tmp_path / "ckpt")
    run = run_distributed(_train_from_hf, 2, hf_job, root)[0]
    out = tmp_path / "hf_out"
    assert hf_main(["export", run["last"], str(out), "--max-shard-gb", str(40 / 2**20)]) == 0
    assert (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    cfg = resolve_model(hf_job.model)
    ours = build_model(cfg, "cpu")
    reader = CheckpointReader(run["last"])
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(reader.read_full(f"model/{name}").view(p.shape))
        assert rel(ours(TOKENS[:, :32]), model(TOKENS[:, :32]).logits) < 1e-5
        assert rel(ours(TOKENS[:, :32]), hf_model("llama3_rope")(TOKENS[:, :32]).logits) > 1e-4


def test_export_hands_over_the_runs_tokenizer(saved, tmp_path):
    """A run on a trained tokenizer.json: the export carries it, and transformers loads it."""
    from trainer.data import train_tokenizer

    words = "alpha beta gamma delta epsilon the of and".split()
    docs = [" ".join(words[(i * 7 + k) % len(words)] for k in range(40)) for i in range(200)]
    tok = tmp_path / "tokenizer.json"
    tok.write_text(train_tokenizer(docs, 290).to_str())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs)
    )
    c = TrainerConfig(model=ModelConfig(name="hf", hf_path=str(saved["tied"])))
    c.data = DataConfig(
        source=str(tmp_path / "docs"),
        tokenizer=str(tok),
        prepared_dir=str(tmp_path / "prep"),
        seq_len=16,
    )
    c.train.steps, c.train.global_batch_size = 2, 4
    prepare(c.data)
    run = run_distributed(_train_from_hf, 1, c, str(tmp_path / "ckpt"))[0]
    out = tmp_path / "out"
    export_hf(run["last"], str(out), torch.bfloat16, log=lambda *_: None)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (
        hf_tok.eos_token == "<|endoftext|>"
        and hf_tok.decode(hf_tok("alpha beta")["input_ids"]) == "alpha beta"
    )
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == hf_tok.eos_token_id and config["tie_word_embeddings"] is True
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16


def test_import_hf_cli_makes_a_checkpoint_a_run_resumes_from(saved, hf_job, tmp_path, capsys):
    root = tmp_path / "runs" / "ft" / "checkpoints"
    assert hf_main(["import", str(saved["llama3_rope"]), str(root)]) == 0
    assert "step 0" in capsys.readouterr().out
    cfg = dataclasses.replace(hf_job, model=dataclasses.replace(hf_job.model))
    run = run_distributed(_train_from_hf, 2, cfg, str(root))[0]
    assert "resumed from" in run["printed"] and "initialised from" not in run["printed"]
    direct = run_distributed(_train_from_hf, 2, cfg, str(tmp_path / "direct"))[0]
    assert [x for _, x in run["losses"]] == pytest.approx(
        [x for _, x in direct["losses"]], rel=1e-6
    )
