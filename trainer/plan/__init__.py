"""Memory planner: one worker's memory for any model, strategy and cluster size, without allocating.

    from trainer.plan import plan, check_fits
    print(plan(cfg, world_size=64, device_memory_bytes=80 * 2**30).table())

    # from the command line, on the Hydra job config (the CLI lives in the Ray layer):
    python -m cluster.plan model=8b sharding=full_shard cluster.num_workers=64 \
        train.global_batch_size=64 device_memory_gb=80

Exact state terms from the engine wrapped on the meta device (layout.py), activations measured by
tracing one block and the root on fake tensors (activations.py), the step's phases from the
engine's schedule (timeline.py), the bytes on the wire from its accounting (traffic.py), the ZeRO
paper's formulas for comparison (zero.py). The memory levers (bf16 moments, bf16 master,
optimizer or parameter offload) are priced from one table (levers.py), and choose.py lists every
combination (with every strategy, when asked) with its step-time estimate, chooses the one answer
by one rule (choose: the fastest predicted step that fits), and is the check a run makes before
its workers start (check_fits); answer.py words the answer, or that nothing fits. A plan fits
when its peak fits in the device's memory less what a CUDA worker cannot give to tensors: the
CUDA context, NCCL's buffers and the allocator's fragmentation (headroom.py), and its node's
workers fit in the host's memory.
"""

from .activations import ActivationProfile, profile
from .answer import format_answer, format_nothing_fits
from .choose import CHOICE_RULE, Option, cheapest, check_fits, choose, closest, options
from .context import ContextAnswer, activation_bytes, longest_sequence, smallest_context
from .headroom import Headroom, headroom_for, nccl_communicators
from .layout import Layout, layout
from .levers import BYTES, Costs
from .planner import MemoryPlan, candidates, plan, recommend, rows_per_micro_batch, strategies
from .report import format_options, format_recommendation
from .timeline import Phase, StepTimeline
from .traffic import bytes_per_step
from .zero import zero_stage_bytes

__all__ = [
    "ContextAnswer",
    "activation_bytes",
    "longest_sequence",
    "smallest_context",
    "BYTES",
    "CHOICE_RULE",
    "ActivationProfile",
    "Costs",
    "Option",
    "cheapest",
    "choose",
    "closest",
    "format_answer",
    "format_nothing_fits",
    "format_options",
    "options",
    "Headroom",
    "Layout",
    "MemoryPlan",
    "Phase",
    "StepTimeline",
    "bytes_per_step",
    "candidates",
    "check_fits",
    "format_recommendation",
    "headroom_for",
    "layout",
    "nccl_communicators",
    "plan",
    "profile",
    "recommend",
    "rows_per_micro_batch",
    "strategies",
    "zero_stage_bytes",
]
