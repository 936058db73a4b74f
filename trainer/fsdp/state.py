"""The engine's state, element range by element range: what a checkpoint saves and loads, and the
whole tensors that tests and exports compare.

Everything is named by the ORIGINAL parameter's fully-qualified name and a flat element range of
it, never by rank or flat parameter: so any world size, strategy or wrap policy can load what
any other saved (trainer/checkpointing.py turns these names into checkpoint keys).

    for fqn, shape, start, t in param_pieces(fsdp): ...            # fp32 master weights
    for fqn, name, shape, start, t in optim_pieces(fsdp, opt): ... # AdamW exp_avg / exp_avg_sq
    load_params(fsdp, read)            # read(fqn, start, numel) -> those elements
    load_optim(fsdp, opt, read, step)  # read(fqn, state name, start, numel)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .collectives import _all_gather
from .flat_param import FlatParameter

if TYPE_CHECKING:
    from .engine import FSDPModel

OPTIM_STATES = ("exp_avg", "exp_avg_sq")
"""AdamW's per-element state, saved and loaded by name (the step count is a scalar)."""


def param_pieces(fsdp: FSDPModel) -> Iterator[tuple[str, tuple, int, torch.Tensor]]:
    """(fqn, full shape, start element, shard tensor slice) for every piece this rank holds."""
    for flat in fsdp.flats():
        for info, start, count, off in flat.local_pieces():
            yield info.fqn, tuple(info.shape), start, flat.shard[off : off + count]


def optim_pieces(fsdp: FSDPModel, optimizer: torch.optim.Optimizer):
    """(fqn, state name, full shape, start, tensor slice) for every optimizer state piece."""
    for flat in fsdp.flats():
        if not flat.requires_grad:
            continue
        for info, start, count, off in flat.local_pieces():
            p, base = _view_at(flat, off)
            for name, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.numel() == p.numel() and value.dim() > 0:
                    yield (
                        info.fqn,
                        name,
                        tuple(info.shape),
                        start,
                        value[off - base : off - base + count],
                    )


def load_params(fsdp: FSDPModel, read: Callable[[str, int, int], torch.Tensor]) -> None:
    """Fill this rank's fp32 shards: read(fqn, start, numel) returns elements [start, start+numel)
    of the full parameter `fqn`, from any layout."""
    with torch.no_grad():
        for flat in fsdp.flats():
            for info, start, count, off in flat.local_pieces():
                flat.shard[off : off + count].copy_(read(info.fqn, start, count))


def load_optim(
    fsdp: FSDPModel,
    optimizer: torch.optim.Optimizer,
    read: Callable[[str, str, int, int], torch.Tensor],
    step: float,
    names: tuple[str, ...] = OPTIM_STATES,
) -> None:
    """Create and fill this rank's optimizer state: read(fqn, state name, start, numel)."""
    with torch.no_grad():
        for flat in (f for f in fsdp.flats() if f.requires_grad):
            for p, _, _ in flat.opt_params:
                st = optimizer.state[p]
                st["step"] = torch.tensor(float(step), dtype=torch.float32)
                for name in names:
                    st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for info, start, count, off in flat.local_pieces():
                p, base = _view_at(flat, off)
                for name in names:
                    optimizer.state[p][name][off - base : off - base + count].copy_(
                        read(info.fqn, name, start, count)
                    )


def full_parameters(fsdp: FSDPModel) -> dict[str, torch.Tensor]:
    """Every original parameter, gathered in fp32 (for tests and export; costs a full copy)."""
    return _gather_full(fsdp, lambda flat: flat.shard, trainable_only=False)


def full_gradients(fsdp: FSDPModel) -> dict[str, torch.Tensor]:
    """Every original parameter's reduced fp32 gradient, gathered (for tests)."""
    return _gather_full(
        fsdp,
        lambda flat: flat.grad if flat.grad is not None else torch.zeros_like(flat.shard),
        trainable_only=True,
    )


def _gather_full(
    fsdp: FSDPModel, local: Callable[[FlatParameter], torch.Tensor], trainable_only: bool
) -> dict[str, torch.Tensor]:
    out = {}
    mesh = fsdp.mesh
    for flat in fsdp.flats():
        if trainable_only and not flat.requires_grad:
            continue
        mine = local(flat)
        full = torch.empty(flat.padded_numel, dtype=torch.float32, device=mine.device)
        if mesh.shard_size > 1:
            _all_gather(full, mine, group=mesh.shard_group)
        else:
            full.copy_(mine)
        for info in flat.infos:
            out[info.fqn] = full[info.offset : info.offset + info.numel].view(info.shape).clone()
    return out


def _view_at(flat: FlatParameter, off: int):
    """The optimizer view (and its start in the shard) that holds shard offset `off`."""
    for p, _, base in flat.opt_params:
        if base <= off < base + p.numel():
            return p, base
    raise KeyError(off)
