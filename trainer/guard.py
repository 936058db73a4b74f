"""The divergence guard: nothing non-finite is applied or saved.

    guard = DivergenceGuard(cfg.train.max_bad_steps, result, last_good_step, log=print0)
    guard.push(step, out.loss, out.bad)       # every step: device scalars, no sync
    guard.read()                              # on logging steps and before saves: one sync
    guard.check_finite(step, tensors, ...)    # before a save: the state itself is finite

A step whose loss or gradient norm is not finite was not applied (trainer/step.py); this counts
them as they are read back, and train.max_bad_steps of them IN A ROW (a good step between resets
the count) stop the run with DivergenceError, as do non-finite parameters or optimizer state
found before a save. Every rank reads the same flags at the same steps, so all raise together,
and the checkpoints already committed stay the last good state.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class DivergenceError(RuntimeError):
    """The run diverged: train.max_bad_steps steps in a row had a non-finite loss or gradient
    norm, or the parameters or optimizer state are non-finite. Restarting from the last
    checkpoint with the same configuration would repeat it, so it is not a failure to retry."""


class DivergenceGuard:
    """Reads the losses and bad-step flags back in batches; writes them into `result`'s
    losses, bad_steps and final_loss (a TrainResult)."""

    def __init__(self, limit: int, result, last_good_step: Callable[[], int], log: Callable):
        self.limit, self.result, self.last_good_step, self.log = limit, result, last_good_step, log
        self._unread: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, bad)
        self.streak = 0  # non-finite steps in a row, as read back

    def push(self, step: int, loss: torch.Tensor, bad: torch.Tensor) -> None:
        self._unread.append((step, loss, bad))

    def read(self) -> float:
        """Bring the losses and flags since the last read to the host (one device sync); raise
        DivergenceError at the limit. Returns the last loss."""
        unread, self._unread = self._unread, []
        if not unread:
            return self.result.final_loss
        values = torch.stack([t.float() for _, t, _ in unread]).tolist()
        flags = torch.stack([b for _, _, b in unread]).tolist()
        for (step, _, _), value, bad in zip(unread, values, flags):
            self.result.losses.append((step, value))
            self.result.final_loss = value
            if not bad:
                self.streak = 0
                continue
            self.streak += 1
            self.result.bad_steps.append(step)
            self.log(
                f"step {step + 1}: loss {value} or its gradient norm is not finite: update not "
                f"applied ({self.streak} of train.max_bad_steps={self.limit} in a row)"
            )
            if self.streak >= self.limit:
                raise DivergenceError(
                    f"training diverged: {self.limit} steps in a row (steps "
                    f"{step - self.limit + 2} to {step + 1}) "
                    f"had a non-finite loss or gradient norm (last loss {value}); none was "
                    f"applied and nothing after step {self.last_good_step()} was "
                    "saved. Lower optim.lr, raise optim.warmup_steps or check the data, then "
                    "resume (the newest checkpoint is the last good state)"
                )
        return self.result.final_loss

    def check_finite(
        self, step: int, tensors: list, device: torch.device, world: int, group
    ) -> None:
        """Before saving `step`: the flags are read (a streak raises), and `tensors` (the
        parameter shards and optimizer state) must be finite on every rank, else
        DivergenceError and nothing is saved. min/max reductions (a NaN propagates, an inf is an
        extreme): no temporary the size of a tensor. `group`: the CPU group of the agreement."""
        self.read()
        ok = torch.ones((), dtype=torch.float32, device=device)
        for t in tensors:
            if t.numel():
                lo, hi = torch.aminmax(t.detach())
                ok = ok * (torch.isfinite(lo) & torch.isfinite(hi)).to(ok.device, torch.float32)
        if world > 1:
            flag = ok.cpu()
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            ok = flag
        if not bool(ok):
            raise DivergenceError(
                f"not saving step {step}: the parameters or optimizer state are not finite on "
                f"at least one rank (the last update overflowed, though its loss and gradient "
                f"norm were finite). Nothing after step {self.last_good_step()} was "
                "saved; lower optim.lr or raise optim.warmup_steps, then resume"
            )
