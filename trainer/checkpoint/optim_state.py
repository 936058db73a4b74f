"""Loading AdamW's state when train.freeze changed since the save.

    notes = load_optimizer(model, optimizer, reader, optim_step, device)

A frozen parameter has no optimizer state, so a checkpoint holds `optim/<fqn>/*` only for the
parameters that trained. A resume may freeze or unfreeze parameters (stage-wise fine-tuning: the
projector first, then the decoder too), and it continues rather than refuses, because the saved
state of every parameter that trained before and trains now is used whole, and what is missing has
one sensible value:
- trainable now, frozen then: no saved state. AdamW starts it as it starts every parameter of a
  new run, from zero moments and a step count of 0 (its first update bias-corrected to about lr),
  when no parameter of its flat (a unit's trainable parameters: trainer/fsdp/flat_param.py) has
  saved state, as when a whole unit is unfrozen (a vision tower, a block): the flat's optimizer
  views are left without state and AdamW creates it at their first step. A flat that mixes
  both (a unit that trained part of itself before) has one step count per optimizer view, the
  saved one: the new parameter's moments start at zero under it (its first updates are smaller,
  about 0.45 lr with beta2 = 0.95, reaching lr within about ten steps). The rule is decided per
  flat, so it is the same at any world size or strategy.
- frozen now, trainable then: its saved state is not loaded (a frozen parameter has none), and
  the next save drops it; its weights load as saved and stay so.
Both are said in the log (the returned notes).
"""

from __future__ import annotations

import torch

from trainer.checkpoint.keys import OPTIM, optim_key
from trainer.checkpoint.reader import CheckpointReader
from trainer.fsdp import FSDPModel
from trainer.fsdp.state import load_optim

SHOWN = 4
"""Parameter names a note lists before "and N more"."""


def load_optimizer(
    model: FSDPModel,
    optimizer: torch.optim.Optimizer,
    reader: CheckpointReader,
    optim_step: float,
    device: torch.device,
) -> list[str]:
    """This rank's AdamW state from `reader`, for any change of the frozen set (module
    docstring); returns a note for each parameter set whose state was started or dropped."""
    keys = set(reader.keys())
    saved = {k[len(OPTIM) :].rsplit("/", 1)[0] for k in keys if k.startswith(OPTIM)}
    trainable = {i.fqn for f in model.flats() if f.requires_grad for i in f.infos}
    frozen = {i.fqn for f in model.flats() if not f.requires_grad for i in f.infos}
    new = trainable - saved

    def read(fqn: str, name: str, start: int, n: int) -> torch.Tensor:
        key = optim_key(fqn, name)
        if key not in keys:  # trainable now, frozen at the save: zero moments
            return torch.zeros(n, device=device)
        return reader.read(key, start, n).to(device)

    load_optim(model, optimizer, read, step=optim_step)
    if new:
        _restart_new_views(model, optimizer, new)
    notes = []
    if new:
        notes.append(
            f"optimizer state: {_names(new)} train now but were frozen at the save: AdamW "
            "starts them from zero moments"
        )
    dropped = saved & frozen
    if dropped:
        notes.append(
            f"optimizer state: {_names(dropped)} are frozen now: their saved AdamW state is "
            "not loaded (their weights are, and stay as saved)"
        )
    return notes


def _restart_new_views(model: FSDPModel, optimizer: torch.optim.Optimizer, new: set[str]):
    """Empty the state of every optimizer view of each flat whose parameters all lack saved
    state: AdamW creates it at the next step, step count 0, as for a new run. Decided per flat
    (the same on every rank, at any world size and strategy), never per view: a rank's view is
    a slice of the flat that another world size cuts elsewhere."""
    for flat in (f for f in model.flats() if f.requires_grad):
        if all(info.fqn in new for info in flat.infos):
            for p, _, _ in flat.opt_params:
                optimizer.state.pop(p, None)


def _names(fqns: set[str]) -> str:
    shown = sorted(fqns)[:SHOWN]
    more = f" and {len(fqns) - SHOWN} more" if len(fqns) > SHOWN else ""
    return f"{len(fqns)} parameters ({', '.join(shown)}{more})"
