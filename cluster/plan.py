"""Print a training config's memory plan and the one configuration to run it with, before renting
the GPUs.

    python -m cluster.plan model=8b cluster.num_workers=8 train.global_batch_size=64 \\
        data.seq_len=4096 sharding.param_dtype=bfloat16 device_memory_gb=80
    python -m cluster.plan model=8b cluster=ray train.global_batch_size=512 data.seq_len=4096
    python -m cluster.plan model=70b cluster.num_workers=8 device_memory_gb=80 \\
        sharding.param_dtype=bfloat16 data.seq_len=4096 train.global_batch_size=16 --table

    python -m cluster.plan model=70b --gpus 4096 sharding.param_dtype=bfloat16 \\
        data.seq_len=4096 train.global_batch_size=4096     # a cluster this machine never sees

The arguments are the training job's Hydra overrides (conf/), plus keys of the planner's own:
  --gpus N (gpus=N)   the workers to plan for (cluster.num_workers=N)
  device_memory_gb    GiB per device (else cluster.device_memory_gb, else the gpu's, else 80)
  host_memory_gb      GiB of host memory per node, shared by its workers (else
                      cluster.host_memory_gb, else with cluster=ray what Ray reports of its GPU
                      nodes, else 1024)
  local_world_size    workers per node, the default HYBRID_SHARD group (else with cluster=ray the
                      GPUs of a node, else 8)
  gpu                 the GPU kind: h100 (default), h200, a100, a100-40, l40s, rtx4090
                      (peak, efficiency, memory bandwidth and usual links: trainer/plan/hardware.py)
  intra, network      the links inside a node and between nodes by name (nvlink-4, pcie-4,
                      ib-ndr-400, roce-400, efa-400-node, eth-100, ...: hardware.LINKS)
  compute_tflops, intra_gbs, network_gbs, pcie_gbs, host_bandwidth_gbs: rates overriding the
                      gpu's (achieved TFLOP/s a GPU; GB/s a GPU inside a node, between nodes,
                      over PCIe; host memory GB/s a node)
  failures_per_gpu_hour  for the goodput lines (default: the Llama 3 report's, 1.97e-5)
  --table (or table=true): also the table of every combination of the memory levers
A plan fits when its peak fits in the device's memory less a GPU worker's headroom (the CUDA
context, NCCL buffers and a fragmentation margin, trainer/plan/headroom.py), each a row of the
breakdown, and the node's workers fit in its host memory.

Per world size (an elastic job, cluster.min_workers/max_workers, is planned at both ends): the
configured job's breakdown, the assumptions (each with the key that sets it), and one line,
`recommended: <overrides>`: among every mesh (each sharding strategy; HYBRID_SHARD with shard
groups of a node x 1, 2, 4, ...), activation checkpointing, micro-batch count and memory lever
(optim.state_dtype, sharding.master_dtype, sharding.offload, in-memory snapshots), the best
predicted tokens/s per GPU that fits (trainer/plan/steptime.py), ties within 5% to the mildest
levers (the rule, printed with it: trainer/plan/choose.py CHOICE_RULE); then `why:` (where the
answer's collectives run, what of its step computes, its tokens/s against the fastest other
mesh) and `goodput:` (the snapshot and checkpoint intervals that maximise it at the failure
rate, and the table with and without spares and in-memory snapshots: trainer/plan/goodput.py).
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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from cluster.compose import check_override_keys, register_schemas, to_job_config
from cluster.config import ConfigError, JobConfig
from cluster.plan_assumptions import (
    Setting,
    batch_note,
    cluster_hardware,
    format_assumptions,
    settings,
)
from trainer.plan import (
    Costs,
    choose,
    format_answer,
    format_nothing_fits,
    format_options,
    options,
    plan,
    strategies,
)
from trainer.plan.choose import best_per_levers
from trainer.plan.context import SEQUENCE_STEP
from trainer.plan.goodput import Recovery, goodput_table
from trainer.plan.hardware import Hardware
from trainer.plan.planner import GiB
from trainer.plan.reasons import format_goodput, format_why
from trainer.plan.report import duration, mem

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
RATES = Costs()
PLAN_KEYS = {
    "device_memory_gb": float,
    "host_memory_gb": float,
    "local_world_size": int,
    "gpus": int,
    "gpu": str,
    "intra": str,
    "network": str,
    "pcie_gbs": float,
    "compute_tflops": float,
    "intra_gbs": float,
    "network_gbs": float,
    "host_bandwidth_gbs": float,
    "failures_per_gpu_hour": float,
}
TABLE_FLAGS = {"--table": True, "table=true": True, "table=false": False}


def split_args(argv: list[str]) -> tuple[dict, list[str], bool]:
    """(the planner's own keys as given, the Hydra overrides, whether the table is asked for)."""
    own, overrides, table = {}, [], False
    argv = _flags(argv)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if arg in TABLE_FLAGS:
            table = TABLE_FLAGS[arg]
        elif key == "table":
            raise ConfigError(f"invalid config: table={value!r}; valid: true or false (--table)")
        elif sep and key in PLAN_KEYS:
            kind = PLAN_KEYS[key]
            own[key] = value if kind is str else _positive(key, value, kind)
        else:
            overrides.append(arg)
    if "gpus" in own:
        overrides.append(f"cluster.num_workers={own['gpus']}")
    return own, overrides, table


def _flags(argv: list[str]) -> list[str]:
    """`--gpus 4096` and `--gpus=4096` as `gpus=4096`."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--gpus":
            if i + 1 == len(argv):
                raise ConfigError("invalid config: --gpus needs a value; valid: --gpus N, N > 0")
            out.append(f"gpus={argv[i + 1]}")
            i += 2
            continue
        out.append(arg[2:] if arg.startswith("--gpus=") else arg)
        i += 1
    return out


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


@dataclass(frozen=True)
class Run:
    """What every world size of one command is planned with."""

    costs: Costs
    hw: Hardware
    recovery: Recovery
    note: Optional[str]
    table: bool


def plan_world(cfg: JobConfig, world: int, s: dict[str, Setting], run: Run) -> bool:
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
        costs=run.costs,
        strategies=strategies(cfg, world, local),
        hw=run.hw,
    )
    best = choose(opts)
    print(p.table())
    print()
    print(format_assumptions(cfg, world, s, run.hw, run.note))
    print()
    if best is not None:
        print(format_answer(best, opts, p))
        print(format_why(best, opts, run.hw))
        print(answer_goodput(cfg, best, run))
    if run.table:
        print()
        rows = best_per_levers(([best] if best else []) + opts)  # the answer's row first
        print(format_options(opts, rows, run.hw))
    print()
    if long_sequences(cfg):
        found = context_lines(cfg, world, device, local, host, run, best)
        best = best or found
    if best is None:
        print(format_nothing_fits(opts), file=sys.stderr)
    return best is not None


def answer_goodput(cfg: JobConfig, best, run: Run) -> str:
    """The goodput lines of the answer: with in-memory snapshots as it runs them (on GPU
    workers unless train.snapshot_every=0 or the answer turns them off)."""
    t = best.time
    rows = goodput_table(
        best.step_s, t.world_size, t.state_bytes, run.hw, run.recovery, best.plan.replicate_size
    )
    snapshots = cfg.train.snapshots_on(True) and not best.snapshots_off
    return format_goodput(rows, t, run.recovery, chosen=0 if snapshots else 2)


LONG_SEQUENCE = 32768
"""From this data.seq_len up (or with train.context_parallel set) the planner also says which
context degree fits and the longest sequence the cluster can train."""


def long_sequences(cfg: JobConfig) -> bool:
    return cfg.data.seq_len >= LONG_SEQUENCE or cfg.train.context_parallel > 1


def context_lines(cfg, world: int, device: int, local: int, host: int, run: Run, best):
    """Print the context-parallel answer (when the configured degree does not fit: the smallest
    that does) and the longest sequence at the largest degree; the answer found, or None."""
    from trainer.plan import longest_sequence, smallest_context  # noqa: PLC0415
    from trainer.plan.context import context_degrees  # noqa: PLC0415

    n = cfg.train.context_parallel
    found = None
    if best is None:
        answer = smallest_context(
            cfg, world, device, local, host_memory_bytes=host, costs=run.costs, hw=run.hw
        )
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
    try:
        hw = cluster_hardware(own, s, costs)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rate = own.get("failures_per_gpu_hour")
    recovery = Recovery(failures_per_gpu_hour=rate) if rate else Recovery()
    run = Run(costs, hw, recovery, batch_note(cfg, overrides), table)
    ok = True
    for world in sorted(set(cfg.cluster.world_sizes)):
        try:
            ok = plan_world(cfg, world, s, run) and ok
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
