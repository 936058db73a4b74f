"""Gradient shards to the host, for sharding.offload=optimizer and params: the master weights,
the gradient shard and AdamW's state live in (pinned) host memory and the optimizer steps there.

Each reduced gradient shard is copied to the host the moment its reduction is retired, on a copy
stream of its own, so the copies overlap the rest of backward; its device memory is released as
soon as its copy is seen done. At the end of backward the host waits for the device (the optimizer
on the host needs every gradient) and folds the staged shards into the fp32 gradient shards.

The other direction (the updated master weights back to the device) is the flat parameter's
`gather_source`, on the gather stream (flat_param.py): with offload=optimizer the unit's first
gather after an optimizer step refreshes the device copy; with offload=params every gather
copies the shard in and frees the copy after it.
"""

from __future__ import annotations

from typing import Optional

import torch

from .accounting import Accounting
from .flat_param import FlatParameter


class HostGrads:
    def __init__(self, device: torch.device, acct: Accounting):
        self.device, self.acct = torch.device(device), acct
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: dict[int, torch.Tensor] = {}  # id(flat) -> host buffer, reused every step
        # (flat, host staging buffer, copy-done event, the device shard kept alive until then)
        self._pending: list[tuple[FlatParameter, torch.Tensor, Optional[object], torch.Tensor]] = []

    def add(self, flat: FlatParameter, out: torch.Tensor) -> None:
        """Start copying the reduced shard `out` (device) into host memory; fold in the copies
        already done (their device shards go)."""
        stage = self._stage(flat, out.dtype)
        if not self.cuda:
            stage.copy_(out)
            self._pending.append((flat, stage, None, out))
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                stage.copy_(out, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            self._pending.append((flat, stage, done, out))
        self._fold(lambda done: done is None or done.query())

    def finish(self) -> None:
        """End of backward: every copy done, every staged shard folded into the gradient shards.
        The host waits for the device here: the optimizer steps on the host next."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._fold(lambda done: True)

    def _fold(self, ready) -> None:
        keep = []
        for item in self._pending:
            flat, stage, done, _ = item
            if ready(done):
                self.acct.alloc("host_grads", flat.add_grad(stage))
            else:
                keep.append(item)
        self._pending = keep

    def _stage(self, flat: FlatParameter, dtype: torch.dtype) -> torch.Tensor:
        buf = self._staging.get(id(flat))
        if buf is None or buf.dtype != dtype:
            buf = torch.empty(flat.shard_numel, dtype=dtype, pin_memory=self.cuda)
            self._staging[id(flat)] = buf
        return buf
