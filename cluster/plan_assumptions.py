"""What `python -m cluster.plan` assumes, each figure with what set it: device and host memory,
workers per node (the planner's keys, the job's cluster keys, a running Ray's GPU nodes, the
defaults), the micro-batch, and the hardware the step times are priced on.

    s = settings(own_keys, cfg)      # {'device': Setting(80.0, 'device_memory_gb'), ...}
    print(format_assumptions(cfg, world, s, cluster_hardware(own_keys, s, costs), note))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from cluster.address import NoCluster, join_address, joins_cluster
from cluster.config import ClusterConfig, JobConfig
from trainer.plan import Costs, rows_per_micro_batch
from trainer.plan.hardware import DEVICES, Hardware, hardware
from trainer.plan.levers import DEFAULT_HOST_MEMORY_GB
from trainer.plan.planner import GiB

DEFAULT_DEVICE_MEMORY_GB = 80.0
DEFAULT_LOCAL_WORLD_SIZE = 8
DEFAULTS_MODEL = "tiny"
"""conf/config.yaml's default model: its train and data keys are sized for it."""
BATCH_KEYS = ("train.global_batch_size", "data.seq_len", "data")
"""The keys (and the data group) that size a micro-batch's tokens."""


@dataclass(frozen=True)
class Setting:
    """A figure the plan assumes, and where it came from (said beside it)."""

    value: float
    source: str


def node_shape(nodes: list[dict]) -> Optional[tuple[float, int, str]]:
    """(host GiB, GPUs, what it is) of the tightest GPU node among Ray's alive nodes' resources
    (the least host memory a GPU), or None without a GPU node. A node's host memory is Ray's
    `memory` + `object_store_memory`: the memory available when the node started, split."""
    gpu_nodes = [n for n in nodes if n.get("GPU", 0) >= 1]
    if not gpu_nodes:
        return None
    host = [(n.get("memory", 0) + n.get("object_store_memory", 0)) / GiB for n in gpu_nodes]
    gpus = [int(n["GPU"]) for n in gpu_nodes]
    i = min(range(len(gpu_nodes)), key=lambda k: host[k] / gpus[k])
    many = len(gpu_nodes) > 1
    what = f"the tightest of {len(gpu_nodes)} GPU nodes" if many else "its GPU node"
    return host[i], gpus[i], what


def ray_nodes(cluster: ClusterConfig) -> tuple[Optional[list[dict]], str]:
    """(the alive nodes' resources, the address) of the Ray this job joins, read in a moment;
    or (None, why not)."""
    try:
        address = join_address(cluster)
    except NoCluster as e:
        return None, str(e).split("; valid:")[0]
    import ray  # noqa: PLC0415 -- ray costs seconds to import: only for cluster=ray

    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        return None, f"Ray at {address}: {type(e).__name__}: {e}"
    finally:
        ray.shutdown()
    return nodes, address


def settings(own: dict, cfg: JobConfig) -> dict[str, Setting]:
    """device, host (GiB) and local (workers per node): the planner's keys as given, else the
    job's cluster keys, else (cluster=ray) the Ray cluster's GPU nodes, else the defaults."""
    c = cfg.cluster
    out = {}
    if "device_memory_gb" in own:
        out["device"] = Setting(own["device_memory_gb"], "device_memory_gb")
    elif c.device_memory_gb is not None:
        out["device"] = Setting(c.device_memory_gb, "cluster.device_memory_gb")
    elif own.get("gpu") in DEVICES:
        out["device"] = Setting(DEVICES[own["gpu"]].memory_gib, f"gpu={own['gpu']}")
    else:
        out["device"] = Setting(DEFAULT_DEVICE_MEMORY_GB, "the default; device_memory_gb sets it")
    if "host_memory_gb" in own:
        out["host"] = Setting(own["host_memory_gb"], "host_memory_gb")
    elif c.host_memory_gb is not None:
        out["host"] = Setting(c.host_memory_gb, "cluster.host_memory_gb")
    if "local_world_size" in own:
        out["local"] = Setting(own["local_world_size"], "local_world_size")
    if len(out) < 3 and c.use_gpu and joins_cluster(c):
        out = {**_from_ray(c), **out}
    out.setdefault(
        "host",
        Setting(DEFAULT_HOST_MEMORY_GB, "the default, an 8-GPU DGX node's; host_memory_gb sets it"),
    )
    out.setdefault(
        "local", Setting(DEFAULT_LOCAL_WORLD_SIZE, "the default; local_world_size sets it")
    )
    return out


def _from_ray(cluster: ClusterConfig) -> dict[str, Setting]:
    nodes, where = ray_nodes(cluster)
    shape = None if nodes is None else node_shape(nodes)
    if shape is None:
        why = where if nodes is None else f"Ray at {where} has no GPU node"
        return {
            "host": Setting(DEFAULT_HOST_MEMORY_GB, f"the default: {why}; host_memory_gb sets it")
        }
    host, gpus, what = shape
    return {
        "host": Setting(host, f"Ray at {where}, {what}: its memory + object store"),
        "local": Setting(gpus, f"Ray at {where}, {what}: its GPUs"),
    }


def batch_note(cfg: JobConfig, overrides: list[str]) -> Optional[str]:
    """What to say when a model other than conf/'s default runs on conf/'s default batch (no key
    of BATCH_KEYS given): it is sized for the tiny model, so name the keys to set."""
    given = {arg.partition("=")[0].lstrip("+~") for arg in overrides}
    if cfg.model.name == DEFAULTS_MODEL or given & set(BATCH_KEYS):
        return None
    return (
        f"conf/'s defaults, sized for the {DEFAULTS_MODEL} model, not for {cfg.model.name}: set "
        "train.global_batch_size, data.seq_len and train.micro_batches to the job's"
    )


def format_assumptions(
    cfg: JobConfig, world: int, s: dict[str, Setting], hw: Hardware, note: Optional[str]
) -> str:
    """The short block before the answer: each figure the plan assumes, and what sets it."""
    t, seq = cfg.train, cfg.data.seq_len
    rows = rows_per_micro_batch(t.global_batch_size, world // t.context_parallel, t.micro_batches)
    local = int(s["local"].value)
    lines = [
        "Assumed:",
        f"  device memory  {s['device'].value:.2f} GiB a worker ({s['device'].source})",
        f"  host memory    {s['host'].value:.2f} GiB a node ({s['host'].source})",
        f"  workers/node   {min(local, world)} sharing that host (local_world_size={local}: "
        f"{s['local'].source})",
        f"  micro-batch    {rows} x {seq} tokens a worker, {t.micro_batches} a step "
        f"(train.global_batch_size={t.global_batch_size} over {world} "
        f"worker{'s' if world > 1 else ''}, "
        f"train.micro_batches={t.micro_batches}, data.seq_len={seq})",
    ]
    if note:
        lines.append(f"                 {note}")
    lines.append(
        f"  step time      {hw.describe()}; PCIe {hw.pcie_gbs:g} GB/s, host memory "
        f"{hw.host_bandwidth_gbs:g} GB/s a node (gpu, intra, network, compute_tflops, intra_gbs, "
        "network_gbs, pcie_gbs, host_bandwidth_gbs)"
    )
    return "\n".join(lines)


def cluster_hardware(own: dict, s: dict[str, Setting], costs: Costs) -> Hardware:
    """The GPUs and links the step times are priced on: the planner's keys over the gpu's."""
    return hardware(
        own.get("gpu", "h100"),
        int(s["local"].value),
        intra=own.get("intra"),
        inter=own.get("network"),
        compute_tflops=own.get("compute_tflops"),
        intra_gbs=own.get("intra_gbs"),
        network_gbs=own.get("network_gbs"),
        pcie_gbs=costs.pcie_gbs,
        host_bandwidth_gbs=costs.host_bandwidth_gbs,
    )


# ----------------------------------------------------------------------------- the command
