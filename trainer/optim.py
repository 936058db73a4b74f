"""The optimizer and its schedule: AdamW over the engine's flat shards, warmup then cosine decay.

    optimizer = build_optimizer(fsdp, cfg.optim, seed=cfg.train.seed)
    for group in optimizer.param_groups: group["lr"] = lr_at(cfg.optim, cfg.train.steps, step)

The engine hands the optimizer at most two views per flat parameter (with and without weight
decay), so AdamW's state lives on exactly this rank's shard: 8 bytes per parameter over N ranks,
and the step is one fused kernel (CUDA and CPU; multi-tensor ones elsewhere) over a few large
tensors.

With optim.state_dtype=bfloat16 (moments in 4 bytes a parameter) or sharding.master_dtype=
bfloat16 (the shards in 2) the step is ours (`AdamW` below): torch's keeps its state in the
parameter's dtype and computes in it. Ours reads each stored tensor into fp32, computes
torch's AdamW update there and writes each back in its own dtype: the bf16 moments rounded
stochastically (a second moment with beta2 = 0.999 moves by 0.1% a step, under bf16's 0.4%
resolution: rounded to nearest it would never decay), the bf16 master as
sharding.master_rounding says (trainer/fsdp/rounding.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from trainer.config import OptimConfig
from trainer.fsdp import FSDPModel
from trainer.fsdp.config import Rounding
from trainer.fsdp.rounding import hash32, round_into, step_key

STATES = ("exp_avg", "exp_avg_sq")
CHUNK = 1 << 18
"""Elements updated per pass: the fp32 temporaries stay 1 MiB each, whatever the shard."""
STREAMS = {"param": 1, "exp_avg": 2, "exp_avg_sq": 3}
"""Each rounded tensor draws its own noise."""


def build_optimizer(model: FSDPModel, cfg: OptimConfig, seed: int = 0) -> torch.optim.Optimizer:
    """AdamW over the flat shards, weight decay on tensors of 2+ dimensions: the fused one on
    CUDA and the CPU (the host, with sharding.offload=optimizer: one kernel for every shard of a
    group), the multi-tensor (foreach) one elsewhere. With bf16 moments or a bf16 master, ours
    (`AdamW`); `seed` keys its stochastic rounding."""
    state_dtype = getattr(torch, cfg.state_dtype)
    if state_dtype != torch.float32 or model.master_dtype != torch.float32:
        return AdamW(
            model.param_groups(cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            state_dtype=state_dtype,
            rounding=model.master_rounding,
            seed=seed,
            index=model.element_index(),
        )
    return torch.optim.AdamW(
        model.param_groups(cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **implementation(model.optimizer_device),
    )


def implementation(device: torch.device) -> dict:
    """AdamW's keyword for the fastest implementation on `device` (the two are exclusive): the
    fused kernel where torch has one (CUDA; the CPU too: the host step of
    sharding.offload=optimizer at 23.5 GB/s of state against the multi-tensor one's 4.4 GB/s
    on this 2-core VM), the multi-tensor (foreach) one elsewhere. Both skip a bad step on the
    device (found_inf: guarded_step)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # noqa: PLC0415

    kind = torch.device(device).type
    return {"fused": True} if kind in _get_fused_kernels_supported_devices() else {"foreach": True}


def lr_at(cfg: OptimConfig, total_steps: int, step: int) -> float:
    """Linear warmup to cfg.lr, then cosine decay to lr * min_lr_ratio at total_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def guarded_step(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """AdamW's step unless `bad` (a device scalar: the loss or the norm is not finite). The fused
    AdamW (CUDA, CPU), and ours on CUDA, take the flag as found_inf and skip on the device, step
    count included, so the host never waits; otherwise the flag is read here (free on a CPU;
    with the optimizer offloaded the host steps anyway)."""
    if optimizer.defaults.get("fused") or getattr(optimizer, "skips_on_device", False):
        optimizer.found_inf = bad.to(torch.float32)
        optimizer.step()
    elif not bool(bad):
        optimizer.step()


class AdamW(torch.optim.Optimizer):
    """torch's AdamW update (decoupled decay, bias correction) computed in fp32 over tensors
    stored in lower precision: moments in `state_dtype`, parameters (the engine's master views)
    in their own dtype, each rounded back (see the module docstring).

    `index`: id(param) -> (key, first element's index), the engine's element_index(): the
    rounding noise of element i of a param at step s is a hash of (seed, s, what is rounded,
    key, index + i), the same at any world size. Work goes in chunks of CHUNK
    elements, so the fp32 temporaries stay a few MiB whatever the shard's size. On a CPU (or
    the host) the step count is a CPU scalar and the step runs as torch's single-tensor one
    (same formula, same order); on CUDA it stays on the device and `found_inf` (set by
    guarded_step) skips a bad step there, step count included, without the host waiting."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.float32,
        rounding: Rounding | str = Rounding.stochastic,
        seed: int = 0,
        index: Optional[dict[int, tuple[int, int]]] = None,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True)
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        self.rounding = Rounding.parse(rounding, "sharding.master_rounding")
        self.seed = seed
        self.index = index or {}
        self.found_inf: Optional[torch.Tensor] = None
        self.skips_on_device = any(
            p.device.type == "cuda" for g in self.param_groups for p in g["params"]
        )

    def state_like(self, p: torch.Tensor) -> torch.Tensor:
        """A zero moment for `p`, in the state dtype (load_optim in trainer/fsdp/state.py)."""
        return torch.zeros(p.shape, dtype=self.state_dtype, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "AdamW over the engine's shards takes no closure"
        bad, self.found_inf = self.found_inf, None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    for name in STATES:
                        st[name] = self.state_like(p)
                self._update(p, st, group, bad)

    def _update(self, p: torch.Tensor, st: dict, group: dict, bad: Optional[torch.Tensor]):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        step_t = st["step"]
        if bad is None:
            step_t += 1
        else:
            step_t += 1 - bad.to(step_t.dtype)
        if step_t.device.type == "cpu":  # torch's single-tensor formula, in Python floats
            step = step_t.item()
            size = lr / (1 - b1**step)
            bc2_sqrt = math.sqrt(1 - b2**step)
            step_id = int(step)
        else:  # capturable: the step count never leaves the device
            size = lr / (1 - torch.pow(b1, step_t))
            bc2_sqrt = torch.sqrt(1 - torch.pow(b2, step_t))
            step_id = step_t
        key, start = self.index.get(id(p), (0, 0))
        keys = {
            name: step_key(self.seed, step_id, hash32((key + stream * 0x9E3779B) & 0xFFFFFFFF))
            for name, stream in STREAMS.items()
        }
        skip = None if bad is None else bad.to(torch.bool)
        for a in range(0, p.numel(), CHUNK):
            b = min(a + CHUNK, p.numel())
            g = p.grad[a:b].float()
            m, v, w = st["exp_avg"][a:b], st["exp_avg_sq"][a:b], p[a:b]
            m32, v32, w32 = (_fp32(t, skip is not None) for t in (m, v, w))
            m32.lerp_(g, 1 - b1)
            v32.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v32.sqrt() / bc2_sqrt).add_(eps)
            w32.mul_(1 - lr * wd)
            if isinstance(size, float):
                w32.addcdiv_(m32, denom, value=-size)
            else:
                w32.sub_(m32 / denom * size)
            _store(m, m32, Rounding.stochastic, keys["exp_avg"], start + a, skip)
            _store(v, v32, Rounding.stochastic, keys["exp_avg_sq"], start + a, skip)
            _store(w, w32, self.rounding, keys["param"], start + a, skip)


def _fp32(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """t in fp32 to compute in: t itself when it is fp32 (updated in place) unless `copy` (a step
    that may be skipped must leave t as it was until it is known to be good)."""
    return t.to(torch.float32, copy=copy or t.dtype != torch.float32)


def _store(dst, value, rounding: Rounding, key, start: int, skip) -> None:
    """dst <- value (fp32, computed from dst), rounded into dst's dtype; kept as it was where
    `skip` (a device flag) is set."""
    if value is dst:  # fp32, updated in place
        return
    if skip is not None:
        value = torch.where(skip, dst.float(), value)  # a bf16 value rounds back to itself
    round_into(dst, value, rounding, key, start)
