"""Headroom: the device memory a CUDA worker cannot give to tensors, besides the step's own peak.

    from trainer.plan.headroom import Headroom, headroom_for
    h = headroom_for(world_size=64, shard_size=8, replicate_size=8, peak=30 * 2**30)
    h.total        # CUDA context + 3 NCCL communicators + 10% of the peak: 6.25 GiB
    Headroom.none()  # CPU workers, or the raw figure: nothing reserved

The planner's `total` is the caching allocator's peak of the step: what torch.cuda's
max_memory_allocated would read. A real GPU also holds the CUDA context and the libraries'
kernels and workspaces, NCCL's buffers for each communicator, and the blocks the caching allocator
reserved but could not hand out (fragmentation). None of them are tensors, so the step fits when
peak <= device memory - headroom.

The three figures are estimates from the sources cited at each constant; benchmarks/gpu_check.py
records what a real H200 shows (total - free - torch's reserved after start-up for the context,
max_memory_reserved against max_memory_allocated for fragmentation) and they should be calibrated
from it. This module is the planner's ground floor: it imports nothing of its siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30

CUDA_CONTEXT_BYTES = 1 * GiB
"""Per process: the CUDA context with the kernels and workspaces of the libraries a step loads.
PyTorch's maintainers put the context alone at ~300-400 MB with lazy module loading (CUDA >= 11.7;
pytorch/pytorch#107667, #109888), more on newer GPUs; pytorch/pytorch#55277 measured 1.7 GB on a
3090 with CUDA 11.1, before lazy loading. cuBLAS/cuBLASLt workspaces (one per stream) and the
NCCL and cuDNN kernels, loaded lazily at first use, come on top. An estimate: gpu_check measures
it (total - free - torch's reserved after start-up) and it should be calibrated from that."""

NCCL_COMMUNICATOR_BYTES = 3 * GiB // 4
"""Per NCCL communicator of more than one rank that this rank takes part in: its channels' send
and receive buffers, allocated at the communicator's first collective. NVIDIA/nccl#964 measured
544 MB for a 2-GPU communicator and 688 MB for 3-4 GPUs (4 x A100, NVLink) after one all-reduce;
NVIDIA/nccl#986 (sjeaugey): the memory grows linearly with the number of channels, and H100 NVLink
uses more channels than A100. 0.75 GiB covers those, with a margin for the more channels."""

FRAGMENTATION_FRACTION = 0.10
"""Of the step's planned peak: the caching allocator rounds requests up (512 B, 2 MiB blocks for
the large pool) and splits cached blocks, so what it reserves exceeds what is allocated, typically
by 5-15% in training runs. gpu_check records max_memory_reserved against max_memory_allocated, to
calibrate it."""

FRAGMENTATION_FLOOR_BYTES = GiB // 2
"""The fragmentation margin is at least this much: small steps still round every block up and
keep per-stream pools."""


@dataclass(frozen=True)
class Headroom:
    """Bytes of one worker's device that are not available to tensors (all 0: nothing reserved)."""

    cuda_context: int
    """CUDA_CONTEXT_BYTES for a CUDA worker."""
    nccl_communicators: int
    """NCCL communicators of more than one rank this rank takes part in (nccl_communicators)."""
    nccl_buffers: int
    """nccl_communicators x NCCL_COMMUNICATOR_BYTES."""
    fragmentation: int
    """FRAGMENTATION_FRACTION of the step's peak, at least FRAGMENTATION_FLOOR_BYTES."""

    @classmethod
    def none(cls) -> Headroom:
        """Nothing reserved: CPU workers, or the plan against the whole device."""
        return cls(0, 0, 0, 0)

    @property
    def total(self) -> int:
        return self.cuda_context + self.nccl_buffers + self.fragmentation

    @property
    def fragmentation_at_floor(self) -> bool:
        """True when the margin is the floor, not the fraction of the peak."""
        return 0 < self.fragmentation == FRAGMENTATION_FLOOR_BYTES


def nccl_communicators(world_size: int, shard_size: int, replicate_size: int) -> int:
    """NCCL communicators of more than one rank that a rank of this mesh uses, as
    trainer/fsdp/mesh.py build_mesh makes them (NCCL creates a communicator at a group's first
    collective, and only on its members).

    World size 1: no collective runs at all (the engine casts locally, the loop skips its
    all-reduces), so 0. Otherwise the world group always (the loop's loss all-reduce, the grad
    scaler's flag), and build_mesh's own groups: the shard group (all-gather, reduce-scatter, the
    gradient norm) and the replicate group (all-reduce of the shards) are each the world group
    when as large as the world, absent when of one rank, and a group of their own only in between
    (1 < size < world, HYBRID_SHARD across nodes). So FULL_SHARD, SHARD_GRAD_OP and NO_SHARD use
    1, HYBRID_SHARD with 1 < shard group < world uses 3. The loop's and the checkpointer's
    control groups are gloo (host memory), not NCCL."""
    if world_size <= 1:
        return 0
    own_groups = sum(1 < size < world_size for size in (shard_size, replicate_size))
    return 1 + own_groups


def headroom_for(world_size: int, shard_size: int, replicate_size: int, peak: int) -> Headroom:
    """A CUDA worker's headroom in a mesh of this shape (trainer/fsdp/mesh.py mesh_shape) for a
    step whose planned allocator peak is `peak` bytes."""
    n = nccl_communicators(world_size, shard_size, replicate_size)
    return Headroom(
        cuda_context=CUDA_CONTEXT_BYTES,
        nccl_communicators=n,
        nccl_buffers=n * NCCL_COMMUNICATOR_BYTES,
        fragmentation=max(round(FRAGMENTATION_FRACTION * peak), FRAGMENTATION_FLOOR_BYTES),
    )
