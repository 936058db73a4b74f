"""trainer/model.py: shapes, causality, meta construction, deterministic per-unit init, counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.config import PRESETS, ConfigError, ModelConfig, model_config
from trainer.model import (
    RotaryEmbedding,
    Transformer,
    build_model,
    count_params,
    flops_per_token,
    init_parameters,
    loss_sum,
)


def tiny(**overrides) -> ModelConfig:
    return model_config("tiny", **overrides)


def small_gqa() -> ModelConfig:
    return tiny(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96)


def test_forward_gives_logits_of_shape_batch_time_vocab():
    model = build_model(tiny(n_layers=2), "cpu", seed=0)
    tokens = torch.randint(0, 256, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, 256)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("cfg", [tiny(n_layers=2), small_gqa()], ids=["mha", "gqa"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(cfg):
    model = build_model(cfg, "cpu", seed=1)
    tokens = torch.randint(0, 256, (2, 24))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-4


def test_block_is_callable_alone_and_matches_its_role_in_the_model():
    model = build_model(small_gqa(), "cpu", seed=2)
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        h = model.tok_embeddings(tokens)
        for layer in model.layers:
            h = layer(h)
        torch.testing.assert_close(model.output(model.norm(h)), model(tokens))


def test_attention_matches_a_naive_reference_with_complex_rotary():
    """SDPA + GQA repeat + interleaved rotary against Meta's complex-number formulation."""
    cfg = small_gqa()
    block = build_model(cfg, "cpu", seed=3).layers[0]
    att = block.attention
    x = torch.randn(2, 9, cfg.dim)
    b, t, hd = 2, 9, cfg.dim // cfg.n_heads
    q = att.wq(x).view(b, t, cfg.n_heads, hd)
    k = att.wk(x).view(b, t, cfg.n_kv_heads, hd).repeat_interleave(2, dim=2)
    v = att.wv(x).view(b, t, cfg.n_kv_heads, hd).repeat_interleave(2, dim=2)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    rot = torch.polar(torch.ones(t, hd // 2), torch.outer(torch.arange(t).float(), inv))

    def rope(z):
        zc = torch.view_as_complex(z.reshape(b, t, -1, hd // 2, 2))
        return torch.view_as_real(zc * rot[None, :, None, :]).flatten(-2)

    q, k = rope(q).transpose(1, 2), rope(k).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    out = (scores.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, -1)
    with torch.no_grad():
        torch.testing.assert_close(att(x), att.wo(out), rtol=1e-4, atol=1e-5)


def test_rotary_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(head_dim=16, theta=10000.0)
    q, k = torch.randn(16), torch.randn(16)
    seq = torch.zeros(1, 40, 1, 16)

    def score(m, n):
        qs, ks = seq.clone(), seq.clone()
        qs[0, m, 0], ks[0, n, 0] = q, k
        return (rope(qs)[0, m, 0] * rope(ks)[0, n, 0]).sum()

    torch.testing.assert_close(score(7, 3), score(30, 26), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(score(7, 3), score(7, 5))


def test_rotary_tables_made_under_inference_mode_still_train():
    model = build_model(tiny(n_layers=1), "cpu", seed=0)
    tokens = torch.randint(0, 256, (1, 12))
    with torch.inference_mode():
        model(tokens)
    loss, _ = loss_sum(model(tokens), tokens)
    loss.backward()
    assert model.layers[0].attention.wq.weight.grad is not None


def test_meta_construction_of_8b_allocates_nothing_and_counts_8_03e9():
    model = build_model(model_config("8b"))
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert list(model.buffers()) == []
    n = sum(p.numel() for p in params)
    assert n == count_params(model.cfg)
    assert abs(n - 8.03e9) / 8.03e9 < 1e-3


def test_module_names_are_stable_and_bias_free():
    names = {n for n, _ in build_model(small_gqa()).named_parameters()}
    block = {
        f"layers.0.{s}.weight"
        for s in (
            "attention_norm",
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "ffn_norm",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    }
    assert block <= names
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= names
    assert all(n.endswith(".weight") for n in names)
    assert len(names) == 3 + 2 * len(block)


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "hf"])
@pytest.mark.parametrize("tied", [False, True])
def test_count_params_matches_the_real_module(name, tied):
    cfg = model_config(name, tie_embeddings=tied)
    assert count_params(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_count_params_matches_a_materialised_tiny_model():
    model = build_model(tiny(), "cpu", seed=0)
    assert count_params(tiny()) == sum(p.numel() for p in model.parameters())
    assert 3.4e6 < count_params(tiny()) < 3.6e6


def test_flops_per_token_is_6n_without_input_embedding_plus_attention():
    cfg = model_config("8b")
    n = count_params(cfg) - cfg.vocab_size * cfg.dim
    assert flops_per_token(cfg, 2048) == 6 * n + 12 * 32 * 4096 * 2048
    assert flops_per_token(cfg, 4096) > flops_per_token(cfg, 2048)


def _whole(seed: int, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return build_model(cfg, "cpu", seed=seed).state_dict()


def test_per_unit_init_in_any_order_equals_whole_model_init():
    cfg = small_gqa()
    whole = _whole(5, cfg)
    model = build_model(cfg)  # meta
    for i in reversed(range(cfg.n_layers)):
        model.layers[i].to_empty(device="cpu")
        init_parameters(model.layers[i], 5, prefix=f"layers.{i}.")
    for name in ("output", "norm", "tok_embeddings"):
        getattr(model, name).to_empty(device="cpu")
    init_parameters(model, 5, exclude=list(model.layers))  # the root unit
    got = model.state_dict()
    assert got.keys() == whole.keys()
    for k in whole:
        torch.testing.assert_close(got[k], whole[k], rtol=0, atol=0, msg=k)


def test_init_does_not_depend_on_parameter_dtype_beyond_rounding():
    cfg = small_gqa()
    whole = _whole(5, cfg)
    model = build_model(cfg).to_empty(device="cpu").to(torch.bfloat16)
    init_parameters(model, 5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, whole[k].to(torch.bfloat16), rtol=0, atol=0, msg=k)


def test_init_values_follow_the_rules_and_differ_by_seed_and_name():
    cfg = tiny(n_layers=4)
    sd = _whole(0, cfg)
    assert torch.equal(sd["layers.2.ffn_norm.weight"], torch.ones(cfg.dim))
    assert torch.equal(sd["norm.weight"], torch.ones(cfg.dim))
    std = sd["layers.0.attention.wq.weight"].std().item()
    assert abs(std - 0.02) < 0.001
    for k in ("layers.0.attention.wo.weight", "layers.1.feed_forward.w2.weight"):
        assert abs(sd[k].std().item() - 0.02 / math.sqrt(8)) < 0.0005, k
    assert not torch.equal(sd["layers.0.attention.wq.weight"], sd["layers.1.attention.wq.weight"])
    other = _whole(1, cfg)
    assert not torch.equal(sd["output.weight"], other["output.weight"])


def test_init_of_a_meta_parameter_raises_naming_it():
    model = build_model(tiny(n_layers=1))
    with pytest.raises(RuntimeError, match=r"layers\.0\.attention_norm\.weight.*meta device"):
        init_parameters(model.layers[0], 0, prefix="layers.0.")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_init_on_cuda_equals_init_on_cpu():
    cfg = small_gqa()
    cuda = build_model(cfg, "cuda", seed=9).state_dict()
    for k, v in _whole(9, cfg).items():
        torch.testing.assert_close(cuda[k].cpu(), v, rtol=0, atol=0, msg=k)


def test_loss_sum_is_fp32_token_sum_and_weight_zero_keeps_the_graph():
    logits = torch.randn(2, 5, 256, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 256, (2, 5))
    total, count = loss_sum(logits, targets)
    assert total.dtype == torch.float32 and total.dim() == 0 and count == 10
    ref = F.cross_entropy(logits.float().view(-1, 256), targets.view(-1), reduction="sum")
    torch.testing.assert_close(total, ref)
    zero, zcount = loss_sum(logits, targets, 0.0)
    assert zero.item() == 0 and zcount == 0
    zero.backward()
    assert logits.grad is not None and logits.grad.abs().max() == 0
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 0, 0, 0, 1]])
    masked, mcount = loss_sum(logits, targets, mask)
    per = F.cross_entropy(logits.float().view(-1, 256), targets.view(-1), reduction="none")
    assert mcount == 4
    torch.testing.assert_close(masked, (per * mask.view(-1)).sum())


def test_model_config_rejects_unknown_names_and_keys():
    with pytest.raises(ConfigError, match=r"model\.name='13b'.*tiny, 125m, 1b, 8b"):
        model_config("13b")
    with pytest.raises(ConfigError, match=r"model\.width"):
        model_config("tiny", width=3)
    with pytest.raises(ConfigError, match=r"model\.n_heads"):
        model_config("tiny", n_heads=3)
    assert model_config("1b", n_layers=2).n_layers == 2
    assert isinstance(Transformer(tiny(n_layers=1)), torch.nn.Module)
