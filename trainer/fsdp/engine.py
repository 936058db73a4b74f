"""The engine: any nn.Module tree wrapped into FSDP units on a device mesh.

Build it with `parallelize` (parallelize.py), which translates a ShardingConfig into the explicit
arguments below:

    fsdp = parallelize(build_model(cfg, device="meta"), sharding, mesh, device, init_fn=...)
    opt = torch.optim.AdamW(fsdp.param_groups(weight_decay=0.1), lr=...)
    loss_fn(fsdp(tokens)).backward()
    fsdp.clip_grad_norm_(1.0); opt.step(); fsdp.zero_grad()
    metrics = fsdp.metrics(opt)            # comm/* and mem/* of the step

Each unit is placed on the mesh by its own strategy (the mesh's, or sharding.modules'): its flat
parameters are sharded over some axes and replicated over others (mesh.py Placement), and every
gather, reduction and norm of that unit runs over those axes' groups. The hooks that drive the
units through a step are hooks.py's; the unit (unit.py) owns its storage and lifecycle, the
scheduler (scheduler.py) the order and prefetch, the reducer (reducer.py) the reductions.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from . import state
from .accounting import Accounting
from .collectives import Collectives
from .config import Offload, Rounding, ShardingStrategy
from .context import split_sequences
from .experts import localize_experts
from .flat_param import FlatParameter
from .hooks import StepHooks
from .mesh import Mesh, Placement
from .offload import HostGrads
from .reducer import Reducer
from .rounding import name_key
from .scheduler import Scheduler
from .unit import FSDPUnit
from .wrap import ROOT, InitFn, UnitBuilder, UnitSpec, transformer_policy


class FSDPModel(torch.nn.Module):
    def __init__(
        self,
        model: torch.nn.Module,
        mesh: Mesh,
        device: torch.device,
        *,
        units: Optional[list[UnitSpec]] = None,
        strategies: Optional[Sequence[ShardingStrategy]] = None,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        forward_prefetch: bool = True,
        backward_prefetch: bool = True,
        max_gathers_in_flight: int = 1,
        max_reductions_in_flight: int = 2,
        sharded_grad_accumulation: bool = False,
        offload: Offload | str | bool = Offload.none,
        master_dtype: torch.dtype = torch.float32,
        master_rounding: Rounding | str = Rounding.stochastic,
        trace: bool = False,
        init_fn: Optional[InitFn] = None,
    ):
        """`units`: the modules that become units (default: transformer_policy); the rest of
        `model` is the root unit, placed as the mesh's strategy says. `strategies`: each unit's
        own (default: the mesh's): where its flats lie on the mesh and whether it frees its
        gathered parameters after forward (FULL_SHARD, HYBRID_SHARD; never the root).
        `sharded_grad_accumulation`: no_sync() reduces every micro-batch into the gradient
        shards instead of keeping unsharded gradients. `offload`: Offload.optimizer (True):
        master weights, gradient shards and optimizer state in host memory (see offload.py), the
        optimizer built over param_groups() steps on the host; Offload.params: and no copy of the
        shard on the device between gathers. `master_dtype`: the shards' (and gradient shards')
        dtype, float32 or bfloat16; `master_rounding`: how the optimizer (trainer/optim.py)
        rounds updates into a bf16 master (rounding.py)."""
        super().__init__()
        self.module = model
        self.mesh, self.device = mesh, torch.device(device)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.acct = Accounting(trace_enabled=trace)
        self.comm = Collectives(self.acct, self.device)
        localize_experts(model, mesh, self.acct)  # a mixture on the expert axis: its experts
        split_sequences(model, mesh, self.acct)  # the context axis: this rank's chunks, K/V
        specs = transformer_policy(model) if units is None else units
        strategies = [mesh.strategy] * len(specs) if strategies is None else list(strategies)
        if isinstance(offload, bool):
            offload = Offload.optimizer if offload else Offload.none
        self.offload_level = Offload.parse(offload, "sharding.offload")
        self.offload = self.offload_level.host  # the shards and the optimizer live on the host
        self.master_dtype = master_dtype
        self.master_rounding = Rounding.parse(master_rounding, "sharding.master_rounding")
        host_grads = HostGrads(self.device, self.acct) if self.offload else None
        self.reducer = Reducer(
            self.comm, self.acct, reduce_dtype, max_reductions_in_flight, host_grads
        )
        build = UnitBuilder(
            model,
            mesh,
            self.device,
            self.comm,
            self.acct,
            self.reducer.reduce,
            param_dtype,
            reduce_dtype,
            init_fn,
            self.offload_level,
            master_dtype,
        )
        self.units: list[FSDPUnit] = [
            build.unit(build.name(spec), spec, strategy)
            for spec, strategy in zip(specs, strategies)
        ]
        self.root = build.unit(ROOT, model, mesh.strategy, exclude=specs, root=True)
        self.scheduler = Scheduler(
            self.root, self.units, max_gathers_in_flight, forward_prefetch, backward_prefetch
        )
        self.sharded_grad_accumulation = sharded_grad_accumulation
        self.hooks = StepHooks(
            model, self.root, self.units, self.scheduler, self.reducer, self.acct
        )
        master = sum(f.shard.numel() * f.shard.element_size() for f in self.flats())
        if self.offload:  # offload=optimizer: the device keeps the compute-dtype copy only;
            # offload=params: nothing between gathers (the copies in are gathered_params)
            on_device = sum(f.compute.numel() * f.compute.element_size() for f in self._kept())
            self.acct.set("sharded_params", on_device)
            self.acct.set("host_params", master)
        else:
            self.acct.set("sharded_params", master)

    def _kept(self) -> Iterator[FlatParameter]:
        return (f for f in self.flats() if f.compute is not None)

    @property
    def optimizer_device(self) -> torch.device:
        """Where the optimizer's tensors live: the host when offloading, else the device."""
        return torch.device("cpu") if self.offload else self.device

    def flats(self) -> Iterator[FlatParameter]:
        for u in self.all_units():
            yield from u.flats

    def all_units(self) -> list[FSDPUnit]:
        return [self.root, *self.units]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ---- what users hold ------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        """What the optimizer updates: this rank's master shard of each flat parameter, as at most
        two views (with and without weight decay), named `<unit>.flat<i>.<decay|no_decay>`. The
        original parameters are views of gathered buffers that exist only around their unit's
        compute; sharded_state_dict() / full_state_dict() name them."""
        for u in self.all_units():
            for i, flat in enumerate(u.flats):
                seen: dict[str, int] = {}
                for p, decay, _ in flat.opt_params:
                    kind = "decay" if decay else "no_decay"
                    n = seen[kind] = seen.get(kind, -1) + 1  # a mixture's experts: one a tensor
                    yield f"{prefix}{u.name}.flat{i}.{kind}" + (f".{n}" if n else ""), p

    def sharded_state_dict(self) -> dict:
        """{name in the unwrapped model: LocalShard(shape, start, values)}; see state.py."""
        return state.sharded_state_dict(self)

    def full_state_dict(self, dtype: Optional[torch.dtype] = None) -> dict:
        """Every parameter whole on rank 0, streamed one at a time; see state.py."""
        return state.full_state_dict(self, dtype)

    # ---- gradients and the optimizer ------------------------------------------------------
    def element_index(self) -> dict[int, tuple[int, int]]:
        """id(optimizer view) -> (a key of its flat parameter, the index of its first element in
        the flat parameter): what stochastic rounding keys its noise by. Neither depends on the
        world size (a flat's layout does not; only its cut into shards does), nor, for a
        mixture's experts (keyed by parameter and index in the whole), on the expert degree."""
        out = {}
        for flat in self.flats():
            for p, _, off in flat.opt_params:
                name, index = flat.element_key(off)
                out[id(p)] = (name_key(name), index)
        return out

    def param_groups(self, weight_decay: float) -> list[dict]:
        decay, no_decay = [], []
        for flat in self.flats():
            for p, d, _ in flat.opt_params:
                (decay if d else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside accumulate unsharded gradients locally; the next backward outside
        reduces. With sharded_grad_accumulation it does nothing: every micro-batch reduces into
        the fp32 gradient shards (micro_batches x the reduce traffic, 1/N of the memory)."""
        if self.sharded_grad_accumulation:
            yield
            return
        for u in self.all_units():
            u.no_sync = True
        try:
            yield
        finally:
            for u in self.all_units():
                u.no_sync = False

    def grad_shards(self) -> list[torch.Tensor]:
        return [f.grad for f in self.flats() if f.grad is not None]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradient across shards (padding excluded, replicas counted once);
        scales the gradients by min(1, max_norm / (norm + 1e-6)) when max_norm > 0. Returns the
        norm. Each placement's squares are summed over the ranks holding different elements of
        it (its shard group; a NO_SHARD unit's none: every rank holds all of it; experts' also
        over the expert axis: other ranks, other experts), then the placements' sums are added."""
        home = "cpu" if self.offload else self.device  # where the gradient shards live
        sums: dict[Placement, torch.Tensor] = {}  # in unit order: the same on every rank
        for flat in (f for f in self.flats() if f.requires_grad):
            sq = sums.setdefault(flat.placement, torch.zeros((), dtype=torch.float32, device=home))
            if flat.grad is not None and flat.valid_numel:  # summed in fp32 (bf16 shards too)
                sq += flat.grad[: flat.valid_numel].pow(2).sum(dtype=torch.float32)
        total = None
        for placement, sq in sums.items():
            sq = sq.to(self.device)  # the process group's device
            if placement.distinct_size > 1:
                dist.all_reduce(sq, group=placement.distinct_group)
            total = sq if total is None else total + sq
        norm = total.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(home)
            for flat in self.flats():
                if flat.grad is not None:
                    flat.grad.mul_(coef)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """End the step's gradients; the next forward starts the next step's accounting.

        set_to_none (the default, as torch's optimizers and FSDP2): free the fp32 gradient shards
        (4 B/param/N), so between steps and through the next forward only the parameters and the
        optimizer state stay; each shard comes back at its unit's first reduction, taking the
        reduced shard itself when it is already fp32. Offloaded shards stay (pinned host memory
        is too slow to allocate per step) and are zeroed; so are all with set_to_none=False."""
        for flat in self.flats():
            if flat.grad is not None:
                if set_to_none and not flat.host:
                    self.acct.free("sharded_grads", flat.grad.numel() * flat.grad.element_size())
                    flat.grad = None
                    flat.attach_grad_views()
                else:
                    flat.grad.zero_()
            flat.grad_is_zero = True
        self.hooks.step_open = False

    # ---- figures --------------------------------------------------------------------------
    def metrics(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, float]:
        """comm/* (bytes each collective kind moved this step) and mem/* (live and peak bytes by
        kind), with the optimizer's state counted when it is given."""
        if optimizer is not None:
            kind = "host_optim_state" if self.offload else "optim_state"
            self.acct.set(kind, _optimizer_state_bytes(optimizer))
        return self.acct.metrics()

    def num_params(self) -> int:
        return sum(f.numel for f in self.flats())

    def largest_unit_bytes(self) -> int:
        return max(u.gathered_bytes for u in self.all_units())


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Per-element optimizer state of this rank (scalar step counters excluded)."""
    return sum(
        v.numel() * v.element_size()
        for st in optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
