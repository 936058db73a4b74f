"""Document attention, positions, the KV cache and the Qwen-style options of trainer/model.py."""

import pytest
import torch

from trainer.config import ModelConfig
from trainer.model import KVCache, attend, build_model, count_params, document_mask

CFG = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _model(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    return build_model(cfg, "cpu", seed=seed).eval()


def _packed(lengths, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return tokens, positions


@pytest.mark.parametrize(
    "cfg",
    [
        CFG,
        ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, ffn_dim=64, qkv_bias=True),
        ModelConfig(
            vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
            head_dim=12, qk_norm=True,
        ),
    ],
    ids=["llama", "qkv_bias", "qk_norm_head_dim"],
)  # fmt: skip
def test_each_packed_document_computes_as_if_alone(cfg):
    model = _model(cfg)
    with torch.no_grad():
        for p in model.parameters():  # biases and norms away from their init, so they count
            p.add_(0.05 * torch.randn_like(p))
    lengths = [5, 11, 1, 7]
    tokens, positions = _packed(lengths)
    with torch.no_grad():
        packed = model(tokens, positions)
        start = 0
        for n in lengths:
            alone = model(tokens[:, start : start + n])
            torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-6)
            start += n
        # Without the positions the same window is one causal sequence: the later documents
        # see the earlier ones, so their logits differ.
        plain = model(tokens)
    assert not torch.allclose(plain[:, 5:16], packed[:, 5:16], atol=1e-4)


def test_changing_one_document_leaves_the_others_bitwise_unchanged():
    model = _model()
    tokens, positions = _packed([6, 9, 4])
    other = tokens.clone()
    other[:, 6:15] = (other[:, 6:15] + 1) % 97
    with torch.no_grad():
        a, b = model(tokens, positions), model(other, positions)
    assert torch.equal(a[:, :6], b[:, :6]) and torch.equal(a[:, 15:], b[:, 15:])
    assert not torch.equal(a[:, 6:15], b[:, 6:15])


def test_gradients_stay_inside_their_document():
    model = _model()
    tokens, positions = _packed([6, 9])
    emb = model.tok_embeddings
    h = emb(tokens).detach().requires_grad_(True)
    ctx = model.context(tokens, positions, None, h.dtype)
    out = h
    for layer in model.layers:
        out = layer(out, ctx)
    out[:, 6:].sum().backward()
    assert torch.count_nonzero(h.grad[:, :6]) == 0
    assert torch.count_nonzero(h.grad[:, 6:]) > 0


def test_flex_block_mask_equals_the_dense_mask():
    """The CUDA path's block mask, run through eager FlexAttention on the CPU (forward only: it
    has no CPU backward), attends exactly as the dense mask does."""
    from torch.nn.attention.flex_attention import flex_attention

    _, positions = _packed([3, 20, 9, 8])
    positions = positions.expand(2, -1)
    q, k, v = (torch.randn(2, 4, positions.shape[1], 8) for _ in range(3))
    dense = attend(q, k, v, document_mask(positions, block=False))
    with pytest.warns(UserWarning):  # "flex_attention called without torch.compile()"
        flex = flex_attention(q, k, v, block_mask=document_mask(positions, block=True))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)


def test_kv_cache_prefill_and_decode_equal_the_full_forward():
    model = _model()
    tokens = torch.randint(0, 97, (2, 12))
    cache = KVCache(CFG, batch=2, max_len=16, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :7], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(7, 10)]
        steps.append(model(tokens[:, 10:], cache=cache))  # two at once after the prefill
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="max_len=16"):
        model(tokens[:, :5], cache=cache)


def test_count_params_counts_biases_norms_and_a_decoupled_head_dim():
    for cfg in [
        ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, ffn_dim=64, qkv_bias=True),
        ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, ffn_dim=64, head_dim=6,
                    qk_norm=True, tie_embeddings=True),
    ]:  # fmt: skip
        model = build_model(cfg)
        assert count_params(cfg) == sum(p.numel() for p in model.parameters())


def test_biases_start_at_zero_and_norms_at_one():
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, ffn_dim=64, qkv_bias=True,
                      qk_norm=True)  # fmt: skip
    model = build_model(cfg, "cpu", seed=3)
    att = model.layers[0].attention
    assert torch.count_nonzero(att.wq.bias) == 0 and torch.count_nonzero(att.wv.bias) == 0
    assert torch.equal(att.q_norm.weight, torch.ones(8))
    assert att.wq.weight.std() > 0.01
