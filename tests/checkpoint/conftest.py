"""Fixtures for checkpoint tests: FSDP-like splits of named tensors, and N simulated ranks.

Ranks are simulated in one process: one CheckpointWriter per rank, each with its own background
thread, meeting at a threading.Barrier(N) (what the lead's gloo barrier is to real ranks).
"""

from __future__ import annotations

import threading

import pytest
import torch

from trainer.checkpoint import CheckpointWriter, TensorChunk


def split(tensors: dict[str, torch.Tensor], world_size: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, the (key, start, numel) ranges it holds when all tensors are laid end to end in
    one flat space, padded to a multiple of world_size and cut into equal slices (as a flat
    parameter is): ranges are uneven per tensor and a rank may span several tensors."""
    spans, pos = [], 0
    for key, t in tensors.items():
        spans.append((key, pos, t.numel()))
        pos += t.numel()
    per_rank = -(-pos // world_size)
    out = []
    for r in range(world_size):
        lo, hi = r * per_rank, (r + 1) * per_rank
        mine = []
        for key, s, n in spans:
            a, b = max(lo, s), min(hi, s + n)
            if a < b:
                mine.append((key, a - s, b - a))
        out.append(mine)
    return out


def chunks_for(tensors: dict[str, torch.Tensor], ranges) -> list[TensorChunk]:
    return [
        TensorChunk(
            k, tuple(tensors[k].shape), tensors[k].dtype, s, tensors[k].reshape(-1)[s : s + n]
        )
        for k, s, n in ranges
    ]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads and -0.0 included), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(37, 29, generator=g)
    w[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return {
        "model/layers.0.attention.wq.weight": w,
        "model/norm.weight": torch.randn(29, generator=g).to(torch.bfloat16),
        "optim/layers.0.attention.wq.weight/exp_avg": torch.randn(37, 29, generator=g),
        "optim/step": torch.tensor(7, dtype=torch.int64),  # a 0-d tensor
        "data/token_counts": torch.randint(-(2**62), 2**62, (301,), generator=g, dtype=torch.int64),
    }


def save_ranks(
    root: str,
    step: int,
    tensors: dict[str, torch.Tensor],
    world_size: int,
    state=None,
    writers=None,
    **writer_kw,
) -> str:
    """Save `tensors` split over `world_size` simulated ranks; return the committed path."""
    own = writers is None
    writers = writers or [CheckpointWriter(root, **writer_kw) for _ in range(world_size)]
    barrier = threading.Barrier(world_size)
    for rank, ranges in enumerate(split(tensors, world_size)):
        writers[rank].save(
            step,
            rank,
            world_size,
            chunks_for(tensors, ranges),
            dict(state or {"strategy": "FULL_SHARD", "step": step}),
            barrier.wait,
        )
    paths = [w.wait() for w in writers]
    if own:
        for w in writers:
            w.close()
    return paths[0]


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return sample_tensors()


class Helpers:
    """The helpers above, handed to tests as the `ck` fixture (test modules never import
    conftest: with several conftest.py files in the tree that import is ambiguous)."""

    split = staticmethod(split)
    chunks_for = staticmethod(chunks_for)
    bitwise_equal = staticmethod(bitwise_equal)
    sample_tensors = staticmethod(sample_tensors)
    save_ranks = staticmethod(save_ranks)


@pytest.fixture
def ck() -> type[Helpers]:
    return Helpers
