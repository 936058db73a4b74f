"""Flattening: many original parameters <-> one padded 1-D FlatParameter and its local shard.

Layout of one FlatParameter (flat element coordinates):

    [ decay params ... | no-decay params ... | padding ]   padded_numel = k * shard_size
      0            decay_end             numel      padded_numel

Rank r of the shard group owns [r * shard_numel, (r + 1) * shard_numel). Because decay and no-decay
parameters are contiguous regions, a rank's shard meets each region in at most one interval, so the
optimizer sees at most two tensors per FlatParameter (views into the one shard), with and without
weight decay. Padding lies past the last parameter and always holds zeros (values and gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .mesh import Placement


@dataclass(frozen=True)
class ParamInfo:
    fqn: str  # fully-qualified name in the wrapped model
    module_name: str  # fqn of the owning module
    attr: str  # attribute name on that module
    shape: torch.Size  # as this rank holds it (a mixture's experts: its experts only)
    offset: int  # element offset in the flat parameter
    decay: bool
    global_shape: Optional[tuple] = None
    """The whole tensor's shape when this rank holds only part of it (its experts: rows of dim 0
    of the stacked experts); None: `shape`. What checkpoints and full states name."""
    global_offset: int = 0
    """Where this rank's part starts in the whole tensor, flattened (first expert x row size)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def full_shape(self) -> tuple:
        return tuple(self.global_shape or self.shape)


class FlatParameter:
    """The metadata and the local master shard of one flattened group of parameters.

    Invariant: `shard` is this rank's master slice (fp32, or bf16 with sharding.master_dtype);
    it is the only persistent copy of the parameters on this rank (everything gathered is a
    temporary in the compute dtype). The gradient shard `grad` has the master's dtype.

    With `host` set (sharding.offload=optimizer or params) the master slice and the gradient
    slice live in host memory (pinned when the device is a GPU). With offload=optimizer
    (`keep_compute`) `compute` is the persistent copy of the slice on the device in the compute
    dtype, the input of every gather: refreshed from the master at the unit's first gather after
    the optimizer may have changed it (`stale`). With offload=params there is no such copy: each
    gather copies the master slice in, on the gather stream, and the copy dies with the gather.
    """

    def __init__(
        self,
        infos: list[ParamInfo],
        placement: Placement,
        requires_grad: bool,
        device: torch.device,
        host: bool = False,
        compute_dtype: torch.dtype = torch.float32,
        master_dtype: torch.dtype = torch.float32,
        keep_compute: bool = True,
    ):
        self.infos = infos
        self.requires_grad = requires_grad
        self.numel = sum(i.numel for i in infos)
        self.decay_end = sum(i.numel for i in infos if i.decay)
        self.placement = placement  # the mesh axes this flat is sharded and replicated over
        shard_size = placement.shard_size
        self.shard_size, self.shard_rank = shard_size, placement.shard_rank
        self.padded_numel = (
            math.ceil(self.numel / shard_size) * shard_size if self.numel else shard_size
        )
        self.shard_numel = self.padded_numel // shard_size
        self.lo = self.shard_rank * self.shard_numel
        self.hi = self.lo + self.shard_numel
        self.device = torch.device(device)  # where the unit computes
        self.host = host
        pin = host and self.device.type == "cuda"
        home = "cpu" if host else self.device
        self.shard = torch.zeros(self.shard_numel, dtype=master_dtype, device=home, pin_memory=pin)
        self.compute_dtype = compute_dtype
        self.compute: torch.Tensor | None = None
        if host and keep_compute:
            self.compute = torch.empty(self.shard_numel, dtype=compute_dtype, device=self.device)
        self.stale = host  # compute must be refreshed from shard before its next use
        self.grad: torch.Tensor | None = None  # gradient shard (master dtype), from 1st reduce
        self.grad_is_zero = True  # the next reduced gradient overwrites instead of adding
        self.opt_params = self._optimizer_views() if requires_grad else []

    @property
    def staged(self) -> bool:
        """offload=params: every gather copies the host master in (no device copy is kept)."""
        return self.host and self.compute is None

    @property
    def staging_bytes(self) -> int:
        """Device bytes a staged gather holds while in flight: the master slice copied in, and
        its cast to the compute dtype when the two differ (the gather casts on the device)."""
        if not self.staged:
            return 0
        cast = self.compute_dtype.itemsize if self.compute_dtype != self.shard.dtype else 0
        return self.shard_numel * (self.shard.element_size() + cast)

    def gather_source(self) -> torch.Tensor:
        """The slice a gather reads, on the current stream (the gather's): the master; with
        offload=optimizer its device copy, refreshed if the master changed since; with
        offload=params a fresh copy of the host master on the device (pinned, asynchronous; the
        gather casts it and keeps both alive until it is done, then they go)."""
        if not self.host:
            return self.shard
        if self.staged:
            return self.shard.to(self.device, non_blocking=True)
        if self.stale:
            self.compute.copy_(self.shard, non_blocking=True)
            self.stale = False
        return self.compute

    def add_grad(self, shard: torch.Tensor) -> int:
        """Fold a reduced gradient shard into the gradient shard (overwriting it after
        zero_grad). Returns the bytes allocated: the gradient shard is created at the first
        reduction (pinned on the host when offloaded), then kept."""
        if self.grad is None:
            adopt = (
                not self.host  # the host path hands over a staging buffer it reuses
                and shard.dtype == self.shard.dtype
                and shard.device == self.shard.device
                and shard.numel() == self.shard_numel
            )
            pin = self.host and self.device.type == "cuda"
            self.grad = (
                shard  # the reduced shard becomes the gradient shard: no copy, no second one
                if adopt
                else torch.empty(
                    self.shard_numel,
                    dtype=self.shard.dtype,
                    device=self.shard.device,
                    pin_memory=pin,
                )
            )
            self.attach_grad_views()
            allocated = self.shard_numel * self.shard.element_size()
            if adopt:
                self.grad_is_zero = False
                return allocated
            self.grad_is_zero = True
        else:
            allocated = 0
        if self.grad_is_zero:
            self.grad.copy_(shard)
        else:
            self.grad.add_(shard)
        self.grad_is_zero = False
        return allocated

    # ---- ranges ------------------------------------------------------------------------
    def local_pieces(self):
        """For each original parameter meeting this shard: (info, start in the whole parameter,
        count, offset in shard). The whole parameter: a rank's experts start at their global
        offset (ParamInfo.global_offset) in it."""
        for info in self.infos:
            a, b = max(info.offset, self.lo), min(info.offset + info.numel, self.hi)
            if a < b:
                yield info, info.global_offset + a - info.offset, b - a, a - self.lo

    @property
    def valid_numel(self) -> int:
        """Elements of the local shard that are real parameters (not padding)."""
        return max(0, min(self.numel, self.hi) - self.lo)

    def _optimizer_views(self) -> list[tuple[torch.nn.Parameter, bool, int]]:
        """(view into the shard, has weight decay, offset in shard) for each region met: the
        decayed and the undecayed parameters; a mixture's experts also one per parameter, so that
        each view's elements have consecutive indices in one whole parameter (element_index)."""
        cuts = {0, self.decay_end, self.numel}
        if self.experts:
            cuts |= {i.offset for i in self.infos}
        views = []
        bounds = sorted(cuts)
        for a, b in zip(bounds, bounds[1:]):
            decay = a < self.decay_end
            a, b = max(a, self.lo), min(b, self.hi)
            if a < b:
                p = torch.nn.Parameter(self.shard[a - self.lo : b - self.lo], requires_grad=True)
                views.append((p, decay, a - self.lo))
        return views

    @property
    def experts(self) -> bool:
        """A mixture's experts: this rank holds a part of each parameter (global_shape)."""
        return any(i.global_shape is not None for i in self.infos)

    def element_key(self, off: int) -> tuple[str, int]:
        """(the name whose key stochastic rounding uses, the index there) of shard offset `off`:
        the flat's first parameter and the index in the flat; a mixture's experts, the parameter
        and the index in the whole of it (the same at any expert degree)."""
        at = self.lo + off
        if not self.experts:
            return self.infos[0].fqn, at
        info = next(i for i in self.infos if i.offset <= at < i.offset + i.numel)
        return info.fqn, info.global_offset + at - info.offset

    def attach_grad_views(self) -> None:
        """Point each optimizer view's .grad at its slice of the gradient shard."""
        for p, _, off in self.opt_params:
            p.grad = None if self.grad is None else self.grad[off : off + p.numel()]

    # ---- flattening --------------------------------------------------------------------
    def split_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of an unsharded flat tensor shaped as the original parameters (one autograd
        node)."""
        sizes = [i.numel for i in self.infos] + [self.padded_numel - self.numel]
        pieces = torch.split(flat, sizes)
        return [p.view(i.shape) for p, i in zip(pieces, self.infos)]
