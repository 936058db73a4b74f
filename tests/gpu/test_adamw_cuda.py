"""Our AdamW's CUDA branch (trainer/optim.py: the step count on the device, capturable, the
found_inf skip without a host sync) against torch's AdamW on the same GPU. Skipped without CUDA;
`make gpu-check` runs tests/gpu on a lent GPU.

- fp32 state, fp32 parameters: our update equals torch's (fused) to fp32 rounding over 20 steps.
- bf16 moments over an fp32 master: within the bf16 moments' resolution of torch's fp32 run
  (and far from a run whose update was lost: a zero-lr run misses by 100%).
- bf16 master with stochastic rounding: the weights' drift from torch's fp32 run stays within a
  few bf16 ulps of the weights, and it is unbiased (the mean error is a small fraction of the
  mean magnitude of the update).
- a step flagged bad (found_inf) changes nothing on the device: weights, moments, step count.
"""

from __future__ import annotations

import pytest
import torch

from trainer.fsdp.config import Rounding
from trainer.optim import AdamW

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
STEPS, N = 20, 1 << 16
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def gradients(step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(step)
    return torch.randn(N, device="cuda", generator=g)


def run(make_opt, dtype=torch.float32, steps=STEPS) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    g = torch.Generator(device="cuda").manual_seed(1234)
    p = torch.nn.Parameter(torch.randn(N, device="cuda", generator=g).to(dtype))
    opt = make_opt([p])
    for step in range(steps):
        p.grad = gradients(step).to(dtype)
        opt.step()
    torch.cuda.synchronize()
    return p.detach().float(), opt


def torch_adamw(params):
    return torch.optim.AdamW(params, fused=True, **HYPER)


def ours(state_dtype=torch.float32, rounding=Rounding.stochastic):
    return lambda params: AdamW(params, state_dtype=state_dtype, rounding=rounding, seed=3, **HYPER)


def test_our_fp32_step_on_cuda_equals_torchs_fused_adamw():
    want, _ = run(torch_adamw)
    got, opt = run(ours())
    assert next(iter(opt.state.values()))["step"].device.type == "cuda"  # never left the GPU
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_moments_stay_within_their_resolution_of_torchs_fp32_update():
    start, _ = run(torch_adamw, steps=0)
    want, _ = run(torch_adamw)
    got, _ = run(ours(torch.bfloat16))
    update = (want - start).norm()
    err = float((got - want).norm() / update)
    assert err < 0.05, err  # bf16 moments: ~2^-8 relative, compounded over 20 steps
    lost, _ = run(lambda params: AdamW(params, **{**HYPER, "lr": 0.0}))
    assert float((lost - want).norm() / update) > 0.9  # the control a lost update would give


def test_a_bf16_master_tracks_torchs_fp32_run_unbiased():
    start, _ = run(torch_adamw, steps=0)
    want, _ = run(torch_adamw)
    got, _ = run(ours(torch.bfloat16), dtype=torch.bfloat16)
    ulp = want.abs() * 2.0**-8  # one bf16 ulp of each weight, roughly
    assert float(((got - want).abs() / ulp).median()) < 4.0
    bias = float((got - want).mean())
    assert abs(bias) < 0.05 * float((want - start).abs().mean()), bias


def test_a_step_flagged_bad_on_the_device_changes_nothing():
    p = torch.nn.Parameter(torch.randn(N, device="cuda", dtype=torch.bfloat16))
    opt = ours(torch.bfloat16)([p])
    p.grad = gradients(0).to(torch.bfloat16)
    opt.step()
    before = p.detach().clone()
    st = next(iter(opt.state.values()))
    moments = [st["exp_avg"].clone(), st["exp_avg_sq"].clone(), st["step"].clone()]
    p.grad = gradients(1).to(torch.bfloat16)
    opt.found_inf = torch.ones((), device="cuda")
    opt.step()
    torch.cuda.synchronize()
    assert torch.equal(p.detach(), before)
    for saved, now in zip(moments, [st["exp_avg"], st["exp_avg_sq"], st["step"]]):
        assert torch.equal(saved, now)
