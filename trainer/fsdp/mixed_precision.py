"""Loss scaling for fp16 compute over sharded gradients.

fp16 gradients underflow unless the loss is scaled up before backward. Each rank holds only its
slice of the gradient, so an inf/nan found on one rank must skip the step on all ranks: the check
is a MAX all-reduce of one flag over the whole world. bf16 and fp32 need no scaler (enabled=False
makes every method a no-op that still returns sensible values).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class ShardedGradScaler:
    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = (
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        self._good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(
        self, grads: list[torch.Tensor], world_size: int, device: Optional[torch.device] = None
    ) -> bool:
        """Divide the local gradient shards by the scale; True if any rank saw inf/nan (skip the
        step). `device`: the process group's (the shards may live on the host when offloaded).
        One read back to the host per step: whether to step must be known there."""
        if not self.enabled:
            return False
        device = device or (grads[0].device if grads else torch.device("cpu"))
        bad = torch.zeros(1, device=device)
        for g in grads:
            g.mul_(1.0 / self.scale)
            bad = torch.maximum(bad, (~torch.isfinite(g).all()).float().to(device))
        if world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            self.skipped_steps += 1
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self._good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
