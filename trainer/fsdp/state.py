"""The engine's state, element range by element range: what a checkpoint saves and loads, and the
whole tensors that tests and exports compare.

Everything is named by the ORIGINAL parameter's fully-qualified name and a flat element range of
it, never by rank or flat parameter: so any world size, strategy or wrap policy can load what
any other saved (the checkpoint component turns these names into checkpoint keys).

    for fqn, shape, start, t in param_pieces(fsdp): ...            # master weights (fp32/bf16)
    for fqn, name, shape, start, t in optim_pieces(fsdp, opt): ... # AdamW exp_avg / exp_avg_sq
    sharded_state_dict(fsdp)           # {fqn: LocalShard(shape, start, values)}, no copies
    for fqn, t in iter_full_state(fsdp): ...  # whole parameters, one at a time, on rank 0
    load_params(fsdp, read)            # read(fqn, start, numel) -> those elements
    load_optim(fsdp, opt, read, step)  # read(fqn, state name, start, numel)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist

from .collectives import _all_gather
from .flat_param import FlatParameter
from .mesh import Mesh

OPTIM_STATES = ("exp_avg", "exp_avg_sq")
"""AdamW's per-element state, saved and loaded by name (the step count is a scalar)."""


class ShardedModel(Protocol):
    """What this module reads of the engine (engine.FSDPModel is one): its flat parameters, its
    mesh and the device its collectives run on. A protocol, not an import of the engine: the
    engine's own state methods call into this module."""

    mesh: Mesh
    device: torch.device

    def flats(self) -> Iterator[FlatParameter]: ...


def param_pieces(
    fsdp: ShardedModel, primary: bool = False
) -> Iterator[tuple[str, tuple, int, torch.Tensor]]:
    """(fqn, full shape, start element, shard tensor slice) for every piece this rank holds;
    `primary`: only those of flats whose first replica this rank is (what a checkpoint saves:
    replicas, NO_SHARD's or HYBRID_SHARD's across groups, hold the same bytes)."""
    for flat in fsdp.flats():
        if primary and not flat.placement.primary:
            continue
        for info, start, count, off in flat.local_pieces():
            yield info.fqn, info.full_shape, start, flat.shard[off : off + count]


def optim_pieces(fsdp: ShardedModel, optimizer: torch.optim.Optimizer, primary: bool = False):
    """(fqn, state name, full shape, start, tensor slice) for every optimizer state piece
    (`primary`: as param_pieces)."""
    for flat in fsdp.flats():
        if not flat.requires_grad or (primary and not flat.placement.primary):
            continue
        for info, start, count, off in flat.local_pieces():
            p, base = _view_at(flat, off)
            for name, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.numel() == p.numel() and value.dim() > 0:
                    yield (
                        info.fqn,
                        name,
                        info.full_shape,
                        start,
                        value[off - base : off - base + count],
                    )


@dataclass(frozen=True)
class LocalShard:
    """The elements [start, start + values.numel()) of the flattened parameter of `shape` that
    this rank holds (a view of its fp32 shard: writing it writes the model)."""

    shape: tuple
    start: int
    values: torch.Tensor


def sharded_state_dict(fsdp: ShardedModel) -> dict[str, LocalShard]:
    """Every parameter this rank holds a piece of, by its name in the unwrapped model. Nothing is
    communicated or copied; parameters lying wholly in other ranks' shards are absent."""
    return {fqn: LocalShard(shape, start, t) for fqn, shape, start, t in param_pieces(fsdp)}


def iter_full_state(
    fsdp: ShardedModel, dtype: Optional[torch.dtype] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole parameter) on rank 0, one parameter at a time: each rank holding a piece of it
    sends that piece to rank 0, which never holds more than the one parameter it yields (on the
    device the shards live on; `dtype` casts it). Other ranks yield nothing, but every rank must
    run the iterator to its end: the pieces are sent as it advances. Replicas (NO_SHARD's,
    HYBRID_SHARD's groups after the first) take no part: the first replica's shard group sends,
    each flat over its own placement; its shard rank 0 (global rank 0: replicate axes are the
    outer ones) receives. A mixture's experts are gathered whole on every rank (their rows lie
    on the ranks of every expert coordinate) and yielded by rank 0."""
    for flat in fsdp.flats():
        if flat.placement.expert_size > 1:
            for fqn, whole in _gather_flat(flat, fsdp.device, flat.shard).items():
                if dist.get_rank() == 0:
                    yield fqn, whole.to(dtype or torch.float32)
            continue
        if not flat.placement.primary:
            continue
        me, group = flat.placement.shard_rank, flat.placement.shard_group
        n = flat.shard_numel
        for info in flat.infos:
            lo, hi = info.offset, info.offset + info.numel
            owners = range(lo // n, (hi - 1) // n + 1)
            if me == 0:
                out = torch.empty(info.numel, dtype=torch.float32, device=flat.device)
                for r in owners:
                    a, b = max(lo, r * n), min(hi, (r + 1) * n)
                    if r == 0:
                        out[a - lo : b - lo].copy_(flat.shard[a:b])
                    else:
                        src = flat.placement.shard_ranks[r]
                        dist.recv(out[a - lo : b - lo], src=src, group=group)
                yield info.fqn, out.view(info.shape).to(dtype or torch.float32)
            elif me in owners:
                a, b = max(lo, me * n), min(hi, (me + 1) * n)
                piece = flat.shard[a - flat.lo : b - flat.lo]
                dst = flat.placement.shard_ranks[0]
                dist.send(piece.to(flat.device, torch.float32).contiguous(), dst=dst, group=group)


def full_state_dict(fsdp: ShardedModel, dtype: Optional[torch.dtype] = None) -> dict:
    """Every parameter whole, on rank 0 (an empty dict elsewhere); see iter_full_state. Rank 0
    holds the whole model at the end: stream with iter_full_state for one that does not fit."""
    return dict(iter_full_state(fsdp, dtype))


def load_params(fsdp: ShardedModel, read: Callable[[str, int, int], torch.Tensor]) -> None:
    """Fill this rank's master shards: read(fqn, start, numel) returns elements [start,
    start+numel) of the full parameter `fqn`, from any layout, in any dtype (an fp32 value
    loaded into a bf16 master is rounded to nearest)."""
    with torch.no_grad():
        for flat in fsdp.flats():
            for info, start, count, off in flat.local_pieces():
                flat.shard[off : off + count].copy_(read(info.fqn, start, count))


def load_optim(
    fsdp: ShardedModel,
    optimizer: torch.optim.Optimizer,
    read: Callable[[str, str, int, int], torch.Tensor],
    step: float,
    names: tuple[str, ...] = OPTIM_STATES,
) -> None:
    """Create and fill this rank's optimizer state: read(fqn, state name, start, numel), in any
    dtype: it is converted to the state's (an optimizer with `state_like(p)`, trainer/optim.py's,
    says which; torch's keeps the parameter's)."""
    # The fused and capturable implementations keep the step count on the parameter's device.
    on_device = any(optimizer.defaults.get(k) for k in ("fused", "capturable"))
    with torch.no_grad():
        for flat in (f for f in fsdp.flats() if f.requires_grad):
            for p, _, _ in flat.opt_params:
                st = optimizer.state[p]
                st["step"] = torch.tensor(
                    float(step), dtype=torch.float32, device=p.device if on_device else "cpu"
                )
                like = getattr(optimizer, "state_like", None)
                for name in names:
                    st[name] = like(p) if like else torch.zeros_like(p)
            for info, start, count, off in flat.local_pieces():
                p, base = _view_at(flat, off)
                for name in names:
                    optimizer.state[p][name][off - base : off - base + count].copy_(
                        read(info.fqn, name, start, count)
                    )


def full_parameters(fsdp: ShardedModel) -> dict[str, torch.Tensor]:
    """Every original parameter, gathered in fp32 (for tests and export; costs a full copy)."""
    return _gather_full(fsdp, lambda flat: flat.shard, trainable_only=False)


def full_gradients(fsdp: ShardedModel) -> dict[str, torch.Tensor]:
    """Every original parameter's reduced gradient, gathered in fp32 (for tests)."""
    return _gather_full(
        fsdp,
        lambda flat: flat.grad if flat.grad is not None else torch.zeros_like(flat.shard),
        trainable_only=True,
    )


def _gather_full(
    fsdp: ShardedModel, local: Callable[[FlatParameter], torch.Tensor], trainable_only: bool
) -> dict[str, torch.Tensor]:
    out = {}
    for flat in fsdp.flats():
        if trainable_only and not flat.requires_grad:
            continue
        out.update(_gather_flat(flat, fsdp.device, local(flat)))
    return out


def _gather_flat(flat: FlatParameter, device, mine: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter of `flat` whole, from this rank's shard `mine` of it (collective over the
    flat's shard group, and for experts over the expert axis: all expert rows, in order)."""
    mine = mine.to(device, torch.float32)  # offloaded shards live on the host
    full = torch.empty(flat.padded_numel, dtype=torch.float32, device=mine.device)
    m = flat.placement
    if m.shard_size > 1:
        _all_gather(full, mine, group=m.shard_group)
    else:
        full.copy_(mine)
    out = {}
    for info in flat.infos:
        value = full[info.offset : info.offset + info.numel].view(info.shape)
        if m.expert_size > 1:  # every expert coordinate's rows, in order
            whole = torch.empty(m.expert_size * info.numel, device=value.device)
            _all_gather(whole, value.reshape(-1), group=m.expert_group)
            value = whole.view(info.full_shape)
        out[info.fqn] = value.clone()
    return out


def _view_at(flat: FlatParameter, off: int):
    """The optimizer view (and its start in the shard) that holds shard offset `off`."""
    for p, _, base in flat.opt_params:
        if base <= off < base + p.numel():
            return p, base
    raise KeyError(off)
