"""Print a training config's memory plan and the one configuration to run it with, before renting
the GPUs.

    python -m cluster.plan model=8b cluster.num_workers=8 train.global_batch_size=64 \\
        data.seq_len=4096 sharding.param_dtype=bfloat16 device_memory_gb=80
    python -m cluster.plan model=8b cluster=ray train.global_batch_size=512 data.seq_len=4096
    python -m cluster.plan model=70b cluster.num_workers=8 device_memory_gb=80 \\
        sharding.param_dtype=bfloat16 data.seq_len=4096 train.global_batch_size=16 --table

The arguments are the training job's Hydra overrides (conf/), plus keys of the planner's own:
  device_memory_gb    GiB per device (else cluster.device_memory_gb, else 80)
  host_memory_gb      GiB of host memory per node, shared by its workers (else
                      cluster.host_memory_gb, else with cluster=ray what Ray reports of its GPU
                      nodes, else 1024)
  local_world_size    workers per node, the default HYBRID_SHARD group (else with cluster=ray the
                      GPUs of a node, else 8)
  pcie_gbs, compute_tflops, network_gbs, host_bandwidth_gbs: the rates of the step-time
                      estimate (defaults and their sources: trainer/plan/levers.py)
  --table (or table=true): also the table of every combination of the memory levers
A plan fits when its peak fits in the device's memory less a GPU worker's headroom (the CUDA
context, NCCL buffers and a fragmentation margin, trainer/plan/headroom.py), each a row of the
breakdown, and the node's workers fit in its host memory.

Per world size (an elastic job, cluster.min_workers/max_workers, is planned at both ends): the
configured job's breakdown, the assumptions (each with the key that sets it), and one line,
`recommended: <overrides>`: among every sharding strategy, activation checkpointing, micro-batch
count and memory lever (optim.state_dtype, sharding.master_dtype, sharding.offload, in-memory
snapshots), the fastest predicted step that fits, ties within 5% to the mildest levers (the
rule, printed with it: trainer/plan/choose.py CHOICE_RULE).
Exit status 0 when the configured job or the recommendation fits at every world size it may
have; 1 when nothing fits at one, with an `error:` line naming the closest configuration; 2 for
an invalid config.

With cluster=ray (a GPU job that joins a running Ray: RAY_ADDRESS or cluster.address) and
neither host key given, the planner connects to that Ray for a moment and reads its alive GPU
nodes' resources (memory and object store, GPUs); without one it says so and keeps the defaults.
The job is composed exactly as `python -m cluster.train` composes it (cluster/compose.py); the
planner itself is trainer/plan.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from cluster.address import NoCluster, join_address, joins_cluster
from cluster.compose import check_override_keys, register_schemas, to_job_config
from cluster.config import ClusterConfig, ConfigError, JobConfig
from trainer.plan import (
    Costs,
    choose,
    format_answer,
    format_nothing_fits,
    format_options,
    options,
    plan,
    rows_per_micro_batch,
    strategies,
)
from trainer.plan.choose import best_per_levers
from trainer.plan.context import SEQUENCE_STEP
from trainer.plan.levers import DEFAULT_HOST_MEMORY_GB
from trainer.plan.planner import GiB
from trainer.plan.report import duration, mem

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
RATES = Costs()
DEFAULT_DEVICE_MEMORY_GB = 80.0
DEFAULT_LOCAL_WORLD_SIZE = 8
PLAN_KEYS = {
    "device_memory_gb": float,
    "host_memory_gb": float,
    "local_world_size": int,
    "pcie_gbs": float,
    "compute_tflops": float,
    "network_gbs": float,
    "host_bandwidth_gbs": float,
}
TABLE_FLAGS = {"--table": True, "table=true": True, "table=false": False}
DEFAULTS_MODEL = "tiny"
"""conf/config.yaml's default model: its train and data keys are sized for it."""
BATCH_KEYS = ("train.global_batch_size", "data.seq_len", "data")
"""The keys (and the data group) that size a micro-batch's tokens."""


@dataclass(frozen=True)
class Setting:
    """A figure the plan assumes, and where it came from (said beside it)."""

    value: float
    source: str


def split_args(argv: list[str]) -> tuple[dict, list[str], bool]:
    """(the planner's own keys as given, the Hydra overrides, whether the table is asked for)."""
    own, overrides, table = {}, [], False
    for arg in argv:
        key, sep, value = arg.partition("=")
        if arg in TABLE_FLAGS:
            table = TABLE_FLAGS[arg]
        elif key == "table":
            raise ConfigError(f"invalid config: table={value!r}; valid: true or false (--table)")
        elif sep and key in PLAN_KEYS:
            own[key] = _positive(key, value, PLAN_KEYS[key])
        else:
            overrides.append(arg)
    return own, overrides, table


def _positive(key: str, value: str, kind: type) -> float:
    valid = "a positive integer" if kind is int else "a positive number"
    try:
        number = kind(value)
    except ValueError:
        raise ConfigError(f"invalid config: {key}={value!r}; valid: {valid}") from None
    if number <= 0:
        raise ConfigError(f"invalid config: {key}={value!r}; valid: {valid}")
    return number


def compose_job(overrides: list[str]) -> JobConfig:
    """The same typed, validated JobConfig training gets from these overrides (model=hf: the
    shape of model.hf_path's config.json)."""
    from trainer.hf import resolve_model  # noqa: PLC0415 -- torch: after the overrides parse

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dictcfg = compose(config_name="config", overrides=overrides)
    cfg = to_job_config(dictcfg).validate()
    return dataclasses.replace(cfg, model=resolve_model(cfg.model)).validate()


# ----------------------------------------------------------------------------- the assumptions


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
    cfg: JobConfig, world: int, s: dict[str, Setting], costs: Costs, note: Optional[str]
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
        f"  step time      {costs.compute_tflops:g} TFLOP/s, network {costs.network_gbs:g} GB/s, "
        f"PCIe {costs.pcie_gbs:g} GB/s, host memory {costs.host_bandwidth_gbs:g} GB/s a node, "
        "nothing overlapped (compute_tflops, network_gbs, pcie_gbs, host_bandwidth_gbs)"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command


def plan_world(
    cfg: JobConfig, world: int, s: dict[str, Setting], costs: Costs, note, table: bool
) -> bool:
    """Print one world size's breakdown, assumptions and answer (and the table when asked);
    False when nothing fits (the error line on stderr)."""
    device, host = int(s["device"].value * GiB), int(s["host"].value * GiB)
    local = int(s["local"].value)
    p = plan(cfg, world, device, local, host_memory_bytes=host)
    opts = options(
        cfg,
        world,
        device,
        local,
        host_memory_bytes=host,
        costs=costs,
        strategies=strategies(cfg, world, local),
    )
    best = choose(opts)
    print(p.table())
    print()
    print(format_assumptions(cfg, world, s, costs, note))
    print()
    if best is not None:
        print(format_answer(best, opts, p))
    if table:
        print()
        rows = best_per_levers(([best] if best else []) + opts)  # the answer's row first
        print(format_options(opts, rows, costs))
    print()
    if long_sequences(cfg):
        found = context_lines(cfg, world, device, local, host, costs, best)
        best = best or found
    if best is None:
        print(format_nothing_fits(opts), file=sys.stderr)
    return best is not None


LONG_SEQUENCE = 32768
"""From this data.seq_len up (or with train.context_parallel set) the planner also says which
context degree fits and the longest sequence the cluster can train."""


def long_sequences(cfg: JobConfig) -> bool:
    return cfg.data.seq_len >= LONG_SEQUENCE or cfg.train.context_parallel > 1


def context_lines(cfg, world: int, device: int, local: int, host: int, costs, best):
    """Print the context-parallel answer (when the configured degree does not fit: the smallest
    that does) and the longest sequence at the largest degree; the answer found, or None."""
    from trainer.plan import longest_sequence, smallest_context  # noqa: PLC0415
    from trainer.plan.context import context_degrees  # noqa: PLC0415

    n = cfg.train.context_parallel
    found = None
    if best is None:
        answer = smallest_context(cfg, world, device, local, host_memory_bytes=host, costs=costs)
        found = answer.best
        tried = ", ".join(map(str, answer.tried))
        if found is None:
            print(
                f"context parallelism: nothing fits at data.seq_len={cfg.data.seq_len} with any "
                f"context degree ({tried}) on {world} workers"
            )
        else:
            p = found.plan
            print(
                f"context parallelism: train.context_parallel={n} does not fit; "
                f"train.context_parallel={answer.degree} is the smallest that does (tried "
                f"{tried}): {' '.join(found.overrides)}  ({mem(p.total)} peak of "
                f"{mem(p.usable)} usable, "
                f"{p.rows} x {p.tokens_per_row} tokens a worker per micro-batch, "
                f"~{duration(found.step_s)} a step)"
            )
    degrees = context_degrees(cfg, world, local)
    top = degrees[-1]
    longest = longest_sequence(
        cfg,
        world,
        device,
        local,
        context=top,
        at_least=cfg.data.seq_len,
        host_memory_bytes=host,
    )
    b = cfg.train.global_batch_size
    print(
        f"longest sequence: {longest:,} tokens at train.context_parallel={top} on {world} "
        f"workers of {mem(device)} (train.global_batch_size={b}; the leanest configuration: "
        f"activation checkpointing, one sequence per micro-batch where the batch allows, "
        f"bf16 moments and master, offload if needed; in steps of "
        f"{max(SEQUENCE_STEP, 2 * top):,} tokens)"
    )
    return found


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:
        own, overrides, table = split_args(argv)
        check_override_keys(overrides)
        cfg = compose_job(overrides)
    except (ConfigError, OmegaConfBaseException, HydraException) as e:
        cause = f": {str(e.__cause__).splitlines()[0]}" if e.__cause__ else ""
        print(f"error: {e}{cause}", file=sys.stderr)
        return 2
    s = settings(own, cfg)
    costs = dataclasses.replace(RATES, **{k: v for k, v in own.items() if hasattr(RATES, k)})
    note = batch_note(cfg, overrides)
    ok = True
    for world in sorted(set(cfg.cluster.world_sizes)):
        try:
            ok = plan_world(cfg, world, s, costs, note, table) and ok
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
