"""One FSDP unit: a module whose parameters live in FlatParameters. The unit owns its storage
(unshard / reshard) and its own lifecycle: each transition below is a method of the unit that
checks the state it starts from, so a hook that fires in the wrong state fails loudly instead of
corrupting gradients. The engine (engine.py) decides when to call them and what to prefetch.

    IDLE --begin_iteration--> FORWARD --pre_forward/post_forward--> FORWARD
         --pre_backward--> BACKWARD_PRE --(its flat gradients complete)--> BACKWARD_POST
         --end_iteration--> IDLE

The moment a flat's gradient is complete (autograd's post-accumulate-grad hook) the unit hands
it to `reduce` (the engine's reducer, reducer.py), or keeps it for gradient accumulation under
no_sync.

Storage invariants (checked by the accounting tests):
- Between steps a unit holds only master shards (`flat.shard`) and gradient shards.
- While gathered, `_buf[i]` holds the padded unsharded parameters in the compute dtype and the
  module attributes are views into it. Reshard frees `_buf`'s storage (resize to 0) and keeps the
  tensor object, so views saved by autograd see the data again once it is re-gathered.
- `_full[i]` shares `_buf[i]`'s storage but has its own version counter (set through `.data`):
  writing a new gather into `_buf` does not invalidate tensors autograd saved in forward.
"""

from __future__ import annotations

import enum
import weakref
from typing import Callable, Optional

import torch

from .accounting import Accounting
from .collectives import Collectives, Handle
from .flat_param import FlatParameter
from .mesh import Placement

ReduceFn = Callable[[FlatParameter, str, torch.Tensor], None]
"""reduce(flat, unit name, complete unsharded gradient): the reducer's (Reducer.reduce)."""


class TrainingState(enum.Enum):
    IDLE = "IDLE"
    FORWARD = "FORWARD"
    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"


def _free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class FSDPUnit:
    def __init__(
        self,
        name: str,
        modules: tuple[torch.nn.Module, ...],
        flats: list[FlatParameter],
        owners: dict[str, torch.nn.Module],
        placement: Placement,  # the unit's own (its flats may carry others: experts)
        comm: Collectives,
        acct: Accounting,
        reduce: ReduceFn,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        reshard_after_forward: bool,
    ):
        self.name, self.modules, self.flats, self.owners = name, modules, flats, owners
        self.placement, self.comm, self.acct = placement, comm, acct
        self.reduce = reduce  # takes each complete flat gradient (not under no_sync)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward = reshard_after_forward
        self.state = TrainingState.IDLE
        # No communication and no copy when the shard IS the full parameter in the compute dtype
        # (and lives where the unit computes).
        offloaded = any(f.host for f in flats)
        self.alias = (
            all(f.placement.shard_size == 1 for f in flats)
            and all(f.shard.dtype == param_dtype for f in flats)
            and not offloaded
        )
        self.gathered = False
        self._gather: list[Handle] = []
        # offload=params: device bytes of the shards copied in for the gathers in flight.
        self.staging_bytes = sum(f.staging_bytes for f in flats)
        self._buf: list[torch.Tensor] = []
        self._full: list[torch.Tensor] = []
        for flat in flats:
            if self.alias:
                buf = flat.shard
            else:
                buf = torch.empty(flat.padded_numel, dtype=param_dtype, device=flat.device)
                _free_storage(buf)
            full = torch.empty(0, dtype=buf.dtype, device=buf.device)
            full.data = buf  # shares storage, own version counter (see module docstring)
            full.requires_grad_(flat.requires_grad)
            self._buf.append(buf)
            self._full.append(full)
        self.no_sync = False
        self._grad_accum: list[Optional[torch.Tensor]] = [None] * len(flats)
        self._grads_seen: set[int] = set()
        self.pre_backward_done = False
        # The hook lives on the tensor (in C++, where Python's collector cannot see it) and the
        # unit holds the tensor: a hook that held the unit would keep the whole engine, shards
        # included, alive forever. It holds the unit weakly; a unit already gone has no gradient
        # to take.
        me = weakref.ref(self)
        for i, full in enumerate(self._full):
            if full.requires_grad:
                full.register_post_accumulate_grad_hook(lambda t, i=i: _post_accumulate(me, i))

    # ---- lifecycle -----------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """A forward of the whole model starts (each micro-batch is one iteration). An offloaded
        master shard may have been stepped by the optimizer since the last: refresh before use."""
        for flat in self.flats:
            flat.stale = flat.host
        self._grads_seen.clear()
        self.pre_backward_done = False
        self.state = TrainingState.FORWARD

    def pre_forward(self, prefetch: Callable[[], None]) -> None:
        """Before this unit's forward: its parameters gathered and in place as views. `prefetch`
        (the engine's) runs after this unit's own gather is waited for, before compute starts."""
        assert self.state is TrainingState.FORWARD, f"{self.name}: forward in state {self.state}"
        self.wait_gather()
        self.use_views()
        prefetch()
        self.acct.event("compute_start", "forward", self.name)

    def post_forward(self, keep: bool = False) -> None:
        """After this unit's forward: free the gathered parameters if it reshards after forward
        and the scheduler does not `keep` them for a backward that starts at once. Without
        gradients (evaluation, generation) nothing comes back for them: always free."""
        self.acct.event("compute_end", "forward", self.name)
        if not torch.is_grad_enabled() or (self.reshard_after_forward and not keep):
            self.reshard()

    def pre_backward(self, prefetch: Callable[[], None]) -> bool:
        """The gradient of this unit's output arrived: gather for its backward (once per iteration;
        False if already done). `prefetch` runs once this unit's own gather is waited for."""
        if self.pre_backward_done:
            return False
        assert self.state is TrainingState.FORWARD, f"{self.name}: backward in state {self.state}"
        self.pre_backward_done = True
        self.state = TrainingState.BACKWARD_PRE
        self.wait_gather()
        prefetch()
        self.acct.event("compute_start", "backward", self.name)
        return True

    def end_iteration(self) -> None:
        """Backward is over (or a forward ran without gradients): back to the master shards only.

        A gather may still be in flight: a unit prefetched for a backward that never ran (its
        parameters frozen, or nothing upstream needing a gradient). It is waited for before its
        buffer is freed: a collective still writing into freed memory would corrupt whatever
        reuses it."""
        if self._gather:
            self.wait_gather()
        self.reshard()
        self.state = TrainingState.IDLE

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def gathered_bytes(self) -> int:
        return (
            sum(f.padded_numel for f in self.flats)
            * torch.empty(0, dtype=self.param_dtype).element_size()
        )

    # ---- unshard / reshard ------------------------------------------------------------
    def issue_gather(self) -> None:
        """Allocate the unsharded buffers and start the all-gathers (no wait)."""
        if self.gathered or self._gather:
            return
        if self.alias:
            self.gathered = True
            return
        self.acct.alloc("gathered_params", self.gathered_bytes)
        for flat, buf in zip(self.flats, self._buf):
            _alloc_storage(buf)
            if flat.placement.shard_size == 1:
                # The compute-dtype copy is a local cast (offload=params: straight from the host).
                buf.copy_(flat.shard if flat.staged else flat.gather_source(), non_blocking=True)
                self.gathered = True
            else:
                # The shard is cast to the compute dtype before the gather (a bf16 gather moves
                # half the bytes of an fp32 one), on the gather's stream; with offload=params
                # the shard is first copied in from the host there too, prefetched with it.
                self._gather.append(
                    self.comm.all_gather(
                        buf,
                        flat.gather_source,
                        flat.placement.shard_group,
                        flat.placement.shard_size,
                        self.name,
                    )
                )
        if self._gather and self.staging_bytes:
            self.acct.alloc("gathered_params", self.staging_bytes)

    def wait_gather(self) -> None:
        self.issue_gather()
        for h in self._gather:
            h.wait()
        if self._gather and self.staging_bytes:  # the copies in from the host die with them
            self.acct.free("gathered_params", self.staging_bytes)
        self._gather = []
        self.gathered = True

    def use_views(self) -> None:
        """Point the modules' parameter attributes at views of the unsharded flat tensors.

        Called under the forward's grad mode: the views hang off one autograd node per flat, so
        the flat's gradient accumulates (and its hook fires) once all of the unit's grads are in."""
        for flat, full in zip(self.flats, self._full):
            for info, view in zip(flat.infos, flat.split_views(full)):
                setattr(self.owners[info.module_name], info.attr, view)

    def reshard(self) -> None:
        """Free the unsharded buffers. After this only the master shards remain."""
        assert not self._gather, f"{self.name}: reshard while a gather is in flight"
        if not self.gathered or self.alias:
            return
        for buf in self._buf:
            _free_storage(buf)
        self.acct.free("gathered_params", self.gathered_bytes)
        self.gathered = False

    def gather_in_flight(self) -> bool:
        return bool(self._gather)

    def is_resident(self) -> bool:
        """True when the unit holds unsharded memory that reshard would free."""
        return (self.gathered or bool(self._gather)) and not self.alias

    # ---- gradients ----------------------------------------------------------------------
    def _post_accumulate(self, i: int) -> None:
        """All of flat i's gradients are in `_full[i].grad`: accumulate (no_sync) or reduce now."""
        assert self.state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST), (
            f"{self.name}: gradient hook fired in state {self.state}"
        )
        self.state = TrainingState.BACKWARD_POST
        full = self._full[i]
        g = full.grad
        full.grad = None
        if self._grad_accum[i] is not None:
            g = self._grad_accum[i].add_(g)
            self._grad_accum[i] = None
            self.acct.free("unsharded_grads", g.numel() * g.element_size())
        if self.no_sync:
            # Keep the unsharded gradient, in reduce_dtype, until the micro-batch that syncs.
            acc = g.to(self.reduce_dtype) if g.dtype != self.reduce_dtype else g
            self.acct.alloc("unsharded_grads", acc.numel() * acc.element_size())
            self._grad_accum[i] = acc
        else:
            self.reduce(self.flats[i], self.name, g)
        self._grads_seen.add(i)
        if len(self._grads_seen) == sum(f.requires_grad for f in self.flats):
            self.acct.event("compute_end", "backward", self.name)
            if self.reshard_after_forward:
                self.reshard()


def _post_accumulate(unit: "weakref.ref[FSDPUnit]", i: int) -> None:
    u = unit()
    if u is not None:
        u._post_accumulate(i)
