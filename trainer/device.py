"""The device a rank trains on, and what that device can do.

    device = resolve_device(cfg.train.device, local_rank, assigned=ray_device_or_None)

One resolver for every launcher: the cluster layer passes the device Ray assigned to the worker
(`ray.train.torch.get_device()` on GPU workers: Ray knows which of the visible GPUs is whose);
plain torch.multiprocessing runs pass nothing and get cuda:<local_rank> or the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from trainer.config import fail

# Dense peak FLOP/s of one device by name and compute dtype (vendor datasheets, no sparsity).
PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 30e12},
    "A10G": {"bfloat16": 125e12, "float16": 125e12, "float32": 31e12},
}


def resolve_device(
    requested: str, local_rank: int = 0, assigned: Optional[torch.device] = None
) -> torch.device:
    """`assigned` if given; else train.device: 'cuda' (or 'auto' with a GPU visible) is
    cuda:<local_rank mod visible GPUs>, otherwise the CPU."""
    if assigned is not None:
        return torch.device(assigned)
    if requested not in ("auto", "cpu", "cuda"):
        fail("train.device", requested, "auto, cpu or cuda")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def peak_flops(device: torch.device, dtype: str) -> Optional[float]:
    """The device's peak FLOP/s for `dtype`, or None when unknown (CPUs: no MFU is reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_FLOPS.items():
        if key in name:
            return table.get(str(dtype))
    return None
