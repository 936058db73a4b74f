"""The optimizer and its schedule: AdamW over the engine's flat shards, warmup then cosine decay.

    optimizer = build_optimizer(fsdp, cfg.optim)
    for group in optimizer.param_groups: group["lr"] = lr_at(cfg.optim, cfg.train.steps, step)

The engine hands the optimizer at most two views per flat parameter (with and without weight
decay), so AdamW's state lives on exactly this rank's shard: 8 bytes per parameter over N ranks,
and the step is a handful of multi-tensor (or, on CUDA, fused) kernels over a few large tensors.
"""

from __future__ import annotations

import math

import torch

from trainer.config import OptimConfig
from trainer.fsdp import FSDPModel


def build_optimizer(model: FSDPModel, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the flat shards, weight decay on matrices only: the fused implementation on
    CUDA (one kernel for every shard of a group), the multi-tensor (foreach) one elsewhere
    (the host, with sharding.offload=optimizer)."""
    return torch.optim.AdamW(
        model.param_groups(cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **implementation(model.optimizer_device),
    )


def implementation(device: torch.device) -> dict:
    """AdamW's keyword for the fastest implementation on `device` (the two are exclusive)."""
    return {"fused": True} if torch.device(device).type == "cuda" else {"foreach": True}


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
    (CUDA) AdamW takes the flag as its found_inf and skips on the device, step count included, so
    the host never waits; otherwise the flag is read here (free on a CPU; with the optimizer
    offloaded the host steps anyway)."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = bad.to(torch.float32)
        optimizer.step()
    elif not bool(bad):
        optimizer.step()
