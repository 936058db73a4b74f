"""The memory levers in bytes, and what each costs a step: the planner's one table of figures.

    from trainer.plan.levers import BYTES, state_bytes, pcie_bytes_per_step
    BYTES["moments"]["bfloat16"]      # 4: AdamW's exp_avg + exp_avg_sq in bf16, per parameter

Every byte count of a lever the planner uses is a row of `BYTES`, so correcting one figure (say
the engine came to keep a bf16 master's gradient shard in fp32) is one edit here.
The layout (layout.py) reads element counts from the engine wrapped on the meta device (fp32
master, no offload, as the engine is built for planning) and this module prices them:

  P  shard elements of this rank (padding included: the engine allocates it)
  G  gradient-shard elements (the trainable flats' shards)
  O  optimizer elements (the real parameters of the shard, no padding: AdamW keeps no state
     for padding)

                             device (persistent / step)                host (per worker)
  offload=none               master P + moments O + comp. O / grads G  -
  offload=optimizer          compute copy P (param_dtype)              master, grads, moments,
                                                                       comp., staging G
  offload=params             nothing / the master slices of the units  as optimizer
                             being gathered, copied in (+ their cast)

Bytes over PCIe per step and worker (each GPU has its own x16 link; copies counted serially, an
upper bound: the engine overlaps them with compute where it can):
  offload=optimizer: the reduced gradient shards device -> host (reduce_dtype x G, once per
    reduction: every micro-batch with sharded gradient accumulation, else once) and the updated
    compute copy host -> device (param_dtype x P, at each unit's first gather after the step).
  offload=params: the same gradients, and every gather's master slice host -> device
    (master_dtype x the unit's shard, at every gather of every micro-batch: FULL_SHARD gathers
    each unit twice; the gather casts it on the device, trainer/fsdp/flat_param.py).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30

BYTES: dict[str, dict[str, int]] = {
    # sharding.master_dtype: the sharded master parameters the optimizer updates.
    "master": {"float32": 4, "bfloat16": 2},
    # optim.state_dtype: AdamW's two moments together (exp_avg, exp_avg_sq).
    "moments": {"float32": 8, "bfloat16": 4},
    # sharding.master_rounding: what the rounding scheme keeps per parameter besides the master.
    # The engine's stochastic rounding draws its noise from a hash (trainer/fsdp/rounding.py)
    # and nearest keeps nothing; a Kahan scheme would keep a bf16 compensation buffer.
    "compensation": {"stochastic": 0, "nearest": 0, "kahan": 2},
    # The gradient shard the optimizer reads, by sharding.master_dtype: the engine keeps it in
    # the master's dtype (trainer/fsdp/flat_param.py).
    "grad_shard": {"float32": 4, "bfloat16": 2},
    # The compute copy, sharding.param_dtype: offload=optimizer's device copy of the shard, and
    # a staged gather's cast (offload=params).
    "compute": {"float32": 4, "bfloat16": 2, "float16": 2},
}
"""Bytes per element, by lever and value: read by this module's functions only."""

HOST_BASELINE_BYTES = 2 * GiB
"""Host memory of one GPU worker before any state: the Python process with torch, Ray Train and
MLflow imported (a spare worker holds ~0.54 GiB, cluster/config.py's spare_workers) and the CUDA
runtime's host side (pinned staging, the driver's mappings). An estimate; the host check adds
it once per worker."""

PCIE_GBS = 25.0
"""Effective host <-> device bandwidth per GPU, GB/s (10^9): PCIe Gen4 x16 is 32 GB/s raw, ~25
in pinned copies; Gen5 x16 doubles it. The planner's `pcie_gbs` key overrides it."""

HOST_BANDWIDTH_GBS = 100.0
"""Host memory bandwidth per node that the offloaded optimizer step attains, GB/s. AdamW on the
host is memory-bound: a fused CPU AdamW touched 23.5 GB/s on the 2-core test machine against
20.0 GB/s for a plain copy (torch 2.x, 20M fp32 parameters); the multi-tensor (foreach) one that
trainer/optim.py uses on the host for fp32 state touched 4.4 GB/s there. A 2-socket server
streams a few hundred GB/s; 100 is a cautious share for the optimizer. Split evenly over the
node's workers. The planner's `host_bandwidth_gbs` key overrides it."""

DEFAULT_HOST_MEMORY_GB = 1024.0
"""Host memory per node the planner checks against when not told (an 8-GPU DGX A100 node has 1
TiB). The planner's `host_memory_gb` key overrides it."""


@dataclass(frozen=True)
class Costs:
    """The host-side rates that turn offload bytes into seconds. Compute and the collectives'
    links are the step-time model's (hardware.py: the planner's gpu, compute_tflops, intra,
    network, intra_gbs and network_gbs keys)."""

    pcie_gbs: float = PCIE_GBS
    host_bandwidth_gbs: float = HOST_BANDWIDTH_GBS


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one worker's state under a choice of levers."""

    device_params: int
    """Persistent parameter bytes on the device: the master shard (offload=none), its compute
    copy (offload=optimizer) or nothing (offload=params)."""
    device_grads: int
    """Gradient shards on the device, in the master's dtype (0 when offloaded)."""
    device_optim: int
    """AdamW's moments and the rounding's compensation on the device (0 when offloaded)."""
    host_state: int
    """Offloaded master, gradient shards, moments and compensation."""
    host_staging: int
    """Pinned buffers the reduced gradients are copied into on the host, reused every step."""
    shard_state: int
    """Master + moments + compensation wherever they live: what a snapshot copies."""


def state_bytes(
    params: int,
    grads: int,
    optim: int,
    *,
    master: str,
    moments: str,
    rounding: str,
    offload: str,
    param_dtype: str,
    reduce_bytes: int,
) -> StateBytes:
    """The bytes of P = params, G = grads, O = optim elements under the levers (module table)."""
    master_b = params * BYTES["master"][master]
    grads_b = grads * BYTES["grad_shard"][master]
    comp = BYTES["compensation"][rounding] if master != "float32" else 0
    optim_b = optim * (BYTES["moments"][moments] + comp)
    shard_state = master_b + optim_b
    if offload == "none":
        return StateBytes(master_b, grads_b, optim_b, 0, 0, shard_state)
    compute_b = params * BYTES["compute"][param_dtype]
    host = master_b + grads_b + optim_b
    staging = grads * reduce_bytes
    if offload == "optimizer":
        return StateBytes(compute_b, 0, 0, host, staging, shard_state)
    return StateBytes(0, 0, 0, host, staging, shard_state)


def staged_bytes_per_element(master: str, param_dtype: str) -> int:
    """offload=params: device bytes per shard element of a gather in flight: the master slice
    copied in, and its cast to the compute dtype when the dtypes differ."""
    cast = BYTES["compute"][param_dtype] if param_dtype != master else 0
    return BYTES["master"][master] + cast


def host_step_bytes(params: int, grads: int, optim: int, master: str, moments: str) -> int:
    """Host memory traffic of one offloaded AdamW step: read master, gradient and moments, write
    master and moments (the compute copy's refresh is counted as PCIe)."""
    m, g, v = BYTES["master"][master], BYTES["grad_shard"][master], BYTES["moments"][moments]
    return params * 2 * m + grads * g + optim * 2 * v


def pcie_bytes_per_step(
    offload: str,
    shard_elements: int,
    grad_elements: int,
    gathered_shards_per_micro_batch: int,
    *,
    micro_batches: int,
    reductions: int,
    param_dtype: str,
    master: str,
    reduce_bytes: int,
) -> dict[str, int]:
    """{'host_to_device': ..., 'device_to_host': ...} for one worker and one optimizer step.

    gathered_shards_per_micro_batch: shard elements of every gather of one micro-batch (each
    unit's shard once per gather it makes)."""
    if offload == "none":
        return {"host_to_device": 0, "device_to_host": 0}
    d2h = reductions * grad_elements * reduce_bytes
    if offload == "optimizer":
        h2d = shard_elements * BYTES["compute"][param_dtype]
    else:
        h2d = micro_batches * gathered_shards_per_micro_batch * BYTES["master"][master]
    return {"host_to_device": h2d, "device_to_host": d2h}
