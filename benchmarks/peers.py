"""The references our engine is measured and tested against, in one home: torch FSDP2 wrapped into
the units our transformer_policy makes, torch DDP, and torch's AdamW grouped as
trainer/optim.py groups ours. benchmarks/engine.py, benchmarks/gpu_check.py, tests/fsdp and
tests/trainer/test_chunked_loss.py all take them from here, so "FSDP2" means one thing everywhere.

    model = build_model(cfg, device="cpu", seed=SEED)
    units = fsdp2(model, param_dtype=torch.bfloat16)      # fully_shard, torchtitan's units
    opt = adamw(model, lr=3e-4, weight_decay=0.1)         # decay on matrices only, as ours
    ddp_model = ddp(build_model(cfg, device="cpu", seed=SEED))

torch.distributed.fsdp and DDP are imported here and in tests only: trainer/ and cluster/ never
import them (DESIGN.md: the engine is ours).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.distributed.fsdp import (  # the reference, here only
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from trainer.optim import implementation


def fsdp2_units(model: torch.nn.Module) -> list[tuple[object, bool]]:
    """(module or modules, reshard_after_forward) of each FSDP2 group, torchtitan-style and the
    same units as our transformer_policy: the embedding, each block, and (norm, output), which
    is not resharded (backward starts with it). With tied embeddings (no `output`), the blocks
    only: the embedding and the norm stay with the root, as in our engine."""
    blocks = [(block, True) for block in model.layers]
    if getattr(model, "output", None) is None:
        return blocks
    return [(model.tok_embeddings, True), *blocks, ([model.norm, model.output], False)]


def fsdp2(
    model: torch.nn.Module,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    mesh=None,
    offload_params: bool = False,
) -> list[tuple[object, bool]]:
    """Wrap `model` (materialised, on its device) in torch FSDP2 in place: fully_shard on each
    unit of fsdp2_units, then the root. `mesh`: FSDP2's device mesh (None: the default group's).
    `offload_params`: CPUOffloadPolicy (pinned), as our sharding.offload=params. Returns the
    units (for the bytes they move)."""
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    if mesh is not None:
        kw["mesh"] = mesh
    kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True) if offload_params else OffloadPolicy()
    units = fsdp2_units(model)
    for modules, reshard in units:  # torch 2.13's fully_shard takes a list as one group
        fully_shard(modules, reshard_after_forward=reshard, **kw)
    fully_shard(model, **kw)
    return units


def ddp(model: torch.nn.Module) -> DistributedDataParallel:
    """torch DDP over the default group; gradients are views of its buckets (no copy)."""
    return DistributedDataParallel(model, gradient_as_bucket_view=True)


def adamw(
    params,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: Sequence[float] = (0.9, 0.95),
    eps: float = 1e-8,
    device: Optional[torch.device | str] = None,
) -> torch.optim.AdamW:
    """torch's AdamW with weight decay on matrices only (trainer/optim.py's rule: tensors of two
    or more dimensions decay). `params`: a module, its parameters, or ready param groups (a list
    of dicts: used as they are). `device`: take trainer/optim.py's implementation for it (fused
    on CUDA and the CPU); None: the single-tensor loop (foreach=False), the plainest reference."""
    if isinstance(params, torch.nn.Module):
        params = list(params.parameters())
    params = list(params)
    if params and not isinstance(params[0], dict):
        params = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    impl = implementation(device) if device is not None else {"foreach": False}
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, **impl)
