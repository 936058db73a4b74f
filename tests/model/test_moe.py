"""The mixture-of-experts layer (trainer/model/moe.py) against transformers' own sparse blocks, and
its grouped matmul against the loop it replaces.

- Qwen3-MoE (norm_topk_prob on and off: weights cast to the compute dtype) and Mixtral (always
  renormalised, combined in fp32): outputs to fp32 1e-6 and gradients (input, router, experts)
  to 1e-5 of their size, weights copied from transformers' fused gate_up / down tensors.
- torch._grouped_mm (where the start-up probe says it runs) equals the loop over the experts'
  slices, forward and backward, empty groups included; an expert that gets no token has a zero
  gradient (it stays in the graph).
- init: a model cut to experts [2, 4) holds exactly rows 2..3 of the whole model's experts (each
  expert drawn from its global index), so every expert-parallel degree starts alike.
- the load-balancing statistics: transformers' load_balancing_loss_func equals ours from the
  counts and probability sums the layers record, with padding left out.
"""

from __future__ import annotations

import pytest
import torch

from trainer.model import build_model
from trainer.model.config import ModelConfig
from trainer.model.moe import MoE, grouped_mm_loop, grouped_mm_ok

transformers = pytest.importorskip("transformers")
E, K, D, F = 8, 2, 32, 48


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def pair(family: str, norm_topk: bool = True):
    """(transformers' sparse block, ours with its weights), fp32, random weights of std 0.3."""
    torch.manual_seed(0)
    shape = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    if family == "qwen3_moe":
        hc = transformers.Qwen3MoeConfig(
            hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
            norm_topk_prob=norm_topk, **shape,
        )  # fmt: skip
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hc)
    else:
        hc = transformers.MixtralConfig(
            hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, **shape
        )
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(hc)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    cfg = ModelConfig(
        dim=D, n_heads=4, moe_experts=E, moe_top_k=K, moe_ffn_dim=F, moe_norm_topk=norm_topk,
        moe_weights_fp32=family == "mixtral",
    )  # fmt: skip
    ours = MoE(cfg)
    theirs = dict(block.named_parameters())
    with torch.no_grad():
        ours.router.weight.copy_(theirs["gate.weight"])
        gate_up = theirs["experts.gate_up_proj"]
        ours.experts.w1.copy_(gate_up[:, :F])
        ours.experts.w3.copy_(gate_up[:, F:])
        ours.experts.w2.copy_(theirs["experts.down_proj"])
    return block, ours


@pytest.mark.parametrize(
    "family,norm_topk", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)]
)
def test_the_layer_equals_transformers_sparse_block_forward_and_backward(family, norm_topk):
    block, ours = pair(family, norm_topk)
    x = torch.randn(3, 7, D, requires_grad=True)
    out = block(x)
    want = out[0] if isinstance(out, tuple) else out
    got = ours(x)
    assert relative(got, want) < 1e-6
    g_want = torch.autograd.grad(want.square().sum(), [x, *block.parameters()])
    g_got = torch.autograd.grad(
        got.square().sum(),
        [x, ours.router.weight, ours.experts.w1, ours.experts.w3, ours.experts.w2],
    )
    named = dict(zip(["x", *(n for n, _ in block.named_parameters())], g_want))
    w1, w3 = named["experts.gate_up_proj"][:, :F], named["experts.gate_up_proj"][:, F:]
    for a, b in zip(g_got, [named["x"], named["gate.weight"], w1, w3, named["experts.down_proj"]]):
        assert relative(a, b) < 1e-5


def test_grouped_matmul_equals_the_loop_with_empty_groups_and_zero_gradients():
    if not grouped_mm_ok("cpu", torch.float32, 32, 48):
        pytest.skip("torch._grouped_mm does not run here: the layer uses the loop")
    g = torch.Generator().manual_seed(1)
    a = torch.randn(20, 32, generator=g, requires_grad=True)
    w = torch.randn(4, 48, 32, generator=g, requires_grad=True)
    ends = torch.tensor([6, 6, 20, 20])  # experts 1 and 3 get no row
    fast = torch._grouped_mm(a, w.transpose(-2, -1), offs=ends.to(torch.int32))
    slow = grouped_mm_loop(a, w, ends)
    assert relative(fast, slow) < 1e-6
    ga, gw = torch.autograd.grad(fast.square().sum(), (a, w))
    la, lw = torch.autograd.grad(slow.square().sum(), (a, w))
    assert relative(ga, la) < 1e-5 and relative(gw, lw) < 1e-5
    assert float(gw[1].abs().max()) == 0.0 and float(gw[3].abs().max()) == 0.0


def test_a_cut_of_the_experts_starts_from_the_same_rows_as_the_whole():
    cfg = ModelConfig(dim=D, n_heads=4, n_layers=2, moe_experts=E, moe_top_k=K, moe_ffn_dim=F)
    whole = build_model(cfg, "cpu", seed=5)
    part = build_model(cfg, "meta")
    for layer in part.layers:
        layer.moe.experts.localize(2, 2)
    part.to_empty(device="cpu")
    from trainer.model import init_parameters

    init_parameters(part, 5)
    for i in range(2):
        for name in ("w1", "w3", "w2"):
            a = getattr(part.layers[i].moe.experts, name)
            b = getattr(whole.layers[i].moe.experts, name)[2:4]
            assert torch.equal(a, b), (i, name)


def test_the_recorded_statistics_give_transformers_aux_loss_without_the_padding():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    cfg = ModelConfig(
        dim=D, n_heads=4, n_layers=3, vocab_size=64, moe_experts=E, moe_top_k=K, moe_ffn_dim=F,
        moe_layers=[0, 2],
    )  # fmt: skip
    model = build_model(cfg, "cpu", seed=3)
    tokens = torch.randint(0, 64, (2, 9))
    real = torch.ones(2, 9, dtype=torch.bool)
    real[1, 6:] = False  # padding at the end of the second row
    logits = []
    hooks = [
        layer.moe.router.register_forward_hook(lambda m, a, out: logits.append(out))
        for layer in model.layers
        if hasattr(layer, "moe")
    ]
    model(tokens, real=real)
    for h in hooks:
        h.remove()
    want = load_balancing_loss_func(tuple(logits), E, K, attention_mask=real.long())
    balance = model.balance
    balance.begin()
    balance.collect()
    got = balance.aux(balance.counts, balance.sums, int(real.sum()))
    assert float(got.detach()) == pytest.approx(float(want), rel=1e-5)
