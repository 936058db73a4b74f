"""Every family we import against transformers itself: tiny random Llama (Llama 3 rope scaling,
a decoupled head_dim), Qwen2 (q/k/v biases, tied and untied), Qwen3 (q/k norms, head_dim 24)
and Mistral (plus Mistral-Nemo's decoupled head_dim) give transformers' fp32 logits through
`import-hf` and through `HFWeights` (model=hf), read only their byte ranges on 3 ranks, export
back bitwise, and anything the model cannot represent is refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.dist_utils import run_distributed
from tests.hf.tiny import (
    FAMILY,
    MODELS,
    TOKENS,
    assert_logits_equal,
    ours_from_hf,
    save,
    transformers_logits,
)
from trainer.checkpoint import CheckpointReader
from trainer.config import ConfigError, ModelConfig, ShardingConfig
from trainer.fsdp import NO_INIT, build_mesh, parallelize
from trainer.fsdp.state import full_parameters, load_params
from trainer.hf import (
    HFWeights,
    config_from_hf,
    config_to_hf,
    expected_tensors,
    export_hf,
    import_hf,
    is_rotary,
    read_hf_config,
)
from trainer.hf.__main__ import main as hf_main
from trainer.model import build_model

transformers = pytest.importorskip("transformers")
QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each model saved by transformers (qwen3 sharded into several files with an index)."""
    return {
        name: save(
            name, tmp_path_factory.mktemp(name), max_shard_size="40KB" if name == "qwen3" else "1GB"
        )
        for name in MODELS
    }


@pytest.fixture(scope="module")
def theirs(saved):
    """transformers' logits of each saved model, computed once."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = transformers_logits(saved[name])
        return cache[name]

    return get


@pytest.fixture(scope="module")
def imported(saved, tmp_path_factory):
    """Each saved model imported once with import_hf: name -> its step-0 checkpoint."""
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(f"ckpt_{name}")
            cache[name] = import_hf(str(saved[name]), str(root), **QUIET)
        return cache[name]

    return get


def from_checkpoint(path: str):
    reader = CheckpointReader(path)
    model = build_model(ModelConfig(**reader.state["model_config"]), "cpu")
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            p.copy_(reader.read_full(f"model/{fqn}").view(p.shape))
    return model.eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_each_family_imported_gives_transformers_logits(saved, theirs, imported, name):
    cfg, ours = ours_from_hf(saved[name])
    assert cfg.family == FAMILY[MODELS[name][0]]
    extra = MODELS[name][1]
    assert cfg.head_dim == extra.get("head_dim") and cfg.head_size == extra.get("head_dim", 16)
    assert cfg.qkv_bias == (cfg.family == "qwen2") and cfg.qk_norm == (cfg.family == "qwen3")
    assert cfg.tie_embeddings == extra.get("tie_word_embeddings", False)
    with torch.no_grad():
        assert_logits_equal(ours(TOKENS), theirs(name))  # model=hf: through HFWeights
        assert_logits_equal(from_checkpoint(imported(name))(TOKENS), theirs(name))  # import-hf


@pytest.mark.parametrize(
    "name,fqn",
    [
        ("qwen2_untied", "layers.1.attention.wq.bias"),
        ("qwen2_untied", "layers.0.attention.wk.bias"),
        ("qwen3", "layers.1.attention.q_norm.weight"),
        ("qwen3", "layers.0.attention.k_norm.weight"),
    ],
)
def test_biases_and_qk_norms_need_the_rotary_permutation(saved, theirs, name, fqn):
    """Loading one of them in transformers' order instead changes the logits: the logits test
    above fails on a wrong permutation."""
    cfg, ours = ours_from_hf(saved[name])
    weights = HFWeights(str(saved[name]), cfg)
    p = dict(ours.named_parameters())[fqn]
    raw = weights.st.read(weights.family.names.hf(fqn), 0, p.numel()).view(p.shape)
    assert not torch.equal(raw, p.detach())
    with torch.no_grad():
        p.copy_(raw)
        ours_logits, reference = ours(TOKENS), theirs(name)
    err = float((ours_logits - reference).abs().max() / reference.abs().max())
    assert err > 1e-3, err


@pytest.mark.parametrize("name", ["qwen2_untied", "qwen3"])
def test_ranged_reads_of_biases_and_norms_read_only_their_bytes(saved, name):
    """A slice of a 1-D tensor reads its own bytes; of a permuted one (q/k biases, q/k norms),
    the whole heads it touches and no more."""
    cfg = config_from_hf(read_hf_config(str(saved[name])))
    weights = HFWeights(str(saved[name]), cfg)
    hd = cfg.head_size
    ones = [f for f in weights.expected if f.endswith(("bias", "q_norm.weight", "k_norm.weight"))]
    assert ones
    for fqn in ones:
        n = math.prod(weights.expected[fqn])
        full = weights.read(fqn, 0, n)
        for start, count in [(0, 1), (hd - 1, 2), (n - 3, 3), (hd + 1, hd - 2)]:
            if start + count > n:
                continue
            before = weights.bytes_read
            assert torch.equal(weights.read(fqn, start, count), full[start : start + count])
            heads = (start + count - 1) // hd - start // hd + 1
            want = heads * hd if is_rotary(fqn) else count
            assert weights.bytes_read - before == want * 4, (fqn, start, count)


def _load_on_ranks(rank, world, path):
    cfg = config_from_hf(read_hf_config(path), hf_path=path)
    sharding = ShardingConfig()
    fsdp = parallelize(
        build_model(cfg), sharding, build_mesh(sharding, rank, world, world), "cpu", init_fn=NO_INIT
    )
    weights = HFWeights(path, cfg)
    load_params(fsdp, weights.read)
    params = full_parameters(fsdp)
    total = sum(math.prod(s) for s in weights.expected.values()) * 4
    return dict(read=weights.bytes_read, total=total, params=params if rank == 0 else None)


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3"])
def test_model_hf_on_3_ranks_reads_each_ranks_byte_ranges_into_the_same_parameters(saved, name):
    ranks = run_distributed(_load_on_ranks, 3, str(saved[name]))
    _, reference = ours_from_hf(saved[name])
    for fqn, p in reference.named_parameters():
        assert torch.equal(ranks[0]["params"][fqn], p.detach()), fqn
    total = ranks[0]["total"]
    # Each rank reads about a third; q/k rows (and their biases) round out to whole heads.
    head_slack = 2 * 2 * 4 * 24 * (64 + 1) * 4
    assert sum(r["read"] for r in ranks) <= total + 3 * head_slack
    assert max(r["read"] for r in ranks) <= total / 3 + head_slack + 128 * 64 * 4


@pytest.mark.parametrize("name", list(MODELS))
def test_import_then_export_gives_the_original_tensors_bitwise_and_transformers_loads_it(
    saved, theirs, imported, name, tmp_path
):
    out = tmp_path / "out"
    export_hf(imported(name), str(out), torch.float32, **QUIET)
    want = {}
    for f in saved[name].glob("*.safetensors"):
        want.update(load_file(f))
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(want)
    for t in want:
        assert torch.equal(got[t].view(torch.uint8), want[t].view(torch.uint8)), t
    config = json.loads((out / "config.json").read_text())
    source = json.loads((saved[name] / "config.json").read_text())
    assert config["model_type"] == source["model_type"]
    assert config["architectures"] == source["architectures"]
    if config["model_type"] == "mistral":
        assert config["sliding_window"] is None
    if config["model_type"] in ("qwen2", "qwen3"):
        assert config["use_sliding_window"] is False
    assert_logits_equal(transformers_logits(out), theirs(name))


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_a_bf16_qwen3_round_trips_bitwise(tmp_path, dtype):
    src = save("qwen3", tmp_path / "src", dtype)
    path = import_hf(str(src), str(tmp_path / "ckpt"), **QUIET)
    export_hf(path, str(tmp_path / "out"), dtype, **QUIET)
    want, got = load_file(src / "model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert sorted(got) == sorted(want)
    for t in want:
        assert got[t].dtype == dtype and torch.equal(
            got[t].view(torch.uint8), want[t].view(torch.uint8)
        )


# ----------------------------------------------------------------------------- refusals

SUPPORTED = (
    r"valid: llama \(LlamaForCausalLM\), qwen2 \(Qwen2ForCausalLM\), "
    r"qwen3 \(Qwen3ForCausalLM\), mistral \(MistralForCausalLM\)"
)


@pytest.mark.parametrize(
    "name,edit,match",
    [
        (
            "mistral",
            dict(sliding_window=4096),
            r"sliding_window=4096; valid: null \(attention over the whole context is what is "
            r"implemented\)",
        ),
        (
            "qwen2_tied",
            dict(use_sliding_window=True, sliding_window=4096),
            r"use_sliding_window=True; valid: false \(attention over the whole context is what "
            r"is implemented, not a window of sliding_window=4096\)",
        ),
        ("qwen3", dict(use_sliding_window=True), r"use_sliding_window=True; valid: false"),
        (
            "qwen2_untied",
            dict(layer_types=["full_attention", "sliding_attention"]),
            r"layer_types\[1\]='sliding_attention'; valid: full_attention",
        ),
        ("qwen3", dict(attention_bias=True), r"attention_bias=True; valid: false"),
        ("mistral", dict(attention_bias=True), r"attention_bias=True; valid: false"),
        (
            "qwen2_untied",
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
            r"rope_type='yarn'; valid: default \(none\) or llama3",
        ),
        ("qwen3", dict(model_type="gemma3"), rf"model_type='gemma3'; {SUPPORTED}"),
        ("qwen3", dict(architectures=["Qwen2ForCausalLM"]), r"architectures=\['Qwen2For"),
    ],
)
def test_a_config_the_model_cannot_represent_is_refused_naming_field_and_value(
    saved, name, edit, match
):
    hf = {**read_hf_config(str(saved[name])), **edit}
    with pytest.raises(ConfigError, match=match):
        config_from_hf(hf)


def test_import_hf_cli_refuses_a_sliding_window_by_name(saved, tmp_path, capsys):
    bad = tmp_path / "window"
    bad.mkdir()
    for f in saved["mistral"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "sliding_window": 4096}))
    assert hf_main(["import", str(bad), str(tmp_path / "ckpt")]) != 0
    assert "sliding_window=4096" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------- published configs

QWEN25_05B = {  # Qwen2.5-0.5B-Instruct's config.json (transformers 4's spelling)
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_06B = {  # Qwen3-0.6B's
    **{k: v for k, v in QWEN25_05B.items() if k not in ("sliding_window", "max_window_layers")},
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rope_scaling": None,
    "sliding_window": None,
}
MISTRAL_NEMO = {  # Mistral-Nemo-Instruct-2407's
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 14336,
    "max_position_embeddings": 1024000,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 131072,
}


@pytest.mark.parametrize(
    "hf,family,head_dim,wq",
    [
        (QWEN25_05B, "qwen2", None, (896, 896)),
        (QWEN3_06B, "qwen3", 128, (2048, 1024)),
        (MISTRAL_NEMO, "mistral", 128, (4096, 5120)),
    ],
)
def test_published_qwen_and_mistral_configs_map_to_our_model(hf, family, head_dim, wq):
    cfg = config_from_hf(hf)
    assert (cfg.family, cfg.head_dim, cfg.rope_theta) == (family, head_dim, 1e6)
    assert (cfg.qkv_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    shapes = expected_tensors(cfg)
    assert shapes["layers.0.attention.wq.weight"] == wq
    assert shapes["layers.0.attention.wo.weight"] == wq[::-1]
    assert ("layers.0.attention.wq.bias" in shapes) == cfg.qkv_bias
    assert ("layers.0.attention.q_norm.weight" in shapes) == cfg.qk_norm
    back = config_to_hf(cfg, torch.bfloat16, 7, 1)
    assert config_from_hf(back) == cfg and back["head_dim"] == cfg.head_size
