"""Print the memory plan and the recommendation for a training config, before renting the GPUs.

    python -m cluster.plan model=8b sharding=full_shard cluster.num_workers=64 \\
        train.global_batch_size=64 device_memory_gb=80
    python -m cluster.plan model=8b cluster=ray train.global_batch_size=512 data.seq_len=4096 \\
        sharding.param_dtype=bfloat16 train.micro_batches=8 local_world_size=8
    python -m cluster.plan model=70b cluster.num_workers=8 device_memory_gb=80 \\
        sharding.param_dtype=bfloat16 data.seq_len=4096 train.global_batch_size=16

The arguments are the training job's Hydra overrides (conf/), plus keys of the planner's own:
  device_memory_gb    GiB per device (default 80)
  host_memory_gb      GiB of host memory per node (default 1024), shared by its workers
  local_world_size    workers per node, the default HYBRID_SHARD group (default 8)
  pcie_gbs, compute_tflops, network_gbs, host_bandwidth_gbs: the rates of the step-time
                      estimate (defaults and their sources: trainer/plan/levers.py)
A plan fits when its peak fits in the device's memory less a GPU worker's headroom (the CUDA
context, NCCL buffers and a fragmentation margin, trainer/plan/headroom.py), each a row of the
table, and the node's workers fit in its host memory. Below the plan: the strategies that fit,
then every combination of the memory levers (optim.state_dtype, sharding.master_dtype,
sharding.offload, activation checkpointing, micro-batches, in-memory snapshots) with device and
host memory per worker and the step-time estimate, and the cheapest that fits
(trainer/plan/choose.py). An elastic job (cluster.min_workers/max_workers) is planned at both
ends. Exit status 0 when the configured job fits at every world size it may have, 1 when not, 2
for an invalid config.

The job is composed exactly as `python -m cluster.train` composes it (cluster/compose.py); the
planner itself is trainer/plan.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from cluster.compose import check_override_keys, register_schemas, to_job_config
from cluster.config import ConfigError, JobConfig
from trainer.plan import Costs, format_options, format_recommendation, options, plan, recommend
from trainer.plan.choose import best_per_levers
from trainer.plan.levers import DEFAULT_HOST_MEMORY_GB
from trainer.plan.planner import GiB

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
RATES = Costs()
PLAN_KEYS = {
    "device_memory_gb": 80.0,
    "host_memory_gb": DEFAULT_HOST_MEMORY_GB,
    "local_world_size": 8,
    "pcie_gbs": RATES.pcie_gbs,
    "compute_tflops": RATES.compute_tflops,
    "network_gbs": RATES.network_gbs,
    "host_bandwidth_gbs": RATES.host_bandwidth_gbs,
}


def split_args(argv: list[str]) -> tuple[dict, list[str]]:
    """(the planner's own keys, the Hydra overrides)."""
    own, overrides = dict(PLAN_KEYS), []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in PLAN_KEYS:
            try:
                own[key] = type(PLAN_KEYS[key])(value)
            except ValueError:
                raise ConfigError(
                    f"invalid config: {key}={value!r}; valid: a positive number"
                ) from None
            if own[key] <= 0:
                raise ConfigError(f"invalid config: {key}={value!r}; valid: a positive number")
        else:
            overrides.append(arg)
    return own, overrides


def compose_job(overrides: list[str]) -> JobConfig:
    """The same typed, validated JobConfig training gets from these overrides (model=hf: the
    shape of model.hf_path's config.json)."""
    from trainer.hf import resolve_model  # noqa: PLC0415 -- torch: after the overrides parse

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dictcfg = compose(config_name="config", overrides=overrides)
    cfg = to_job_config(dictcfg).validate()
    return dataclasses.replace(cfg, model=resolve_model(cfg.model)).validate()


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:
        own, overrides = split_args(argv)
        check_override_keys(overrides)
        cfg = compose_job(overrides)
    except (ConfigError, OmegaConfBaseException, HydraException) as e:
        cause = f": {str(e.__cause__).splitlines()[0]}" if e.__cause__ else ""
        print(f"error: {e}{cause}", file=sys.stderr)
        return 2
    device = int(own["device_memory_gb"] * GiB)
    host = int(own["host_memory_gb"] * GiB)
    local = own["local_world_size"]
    costs = Costs(**{f.name: own[f.name] for f in dataclasses.fields(Costs)})
    ok = True
    for world in sorted(set(cfg.cluster.world_sizes)):
        try:
            p = plan(cfg, world, device, local, host_memory_bytes=host)
            opts = options(cfg, world, device, local, host_memory_bytes=host, costs=costs)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(p.table())
        print()
        print(format_recommendation(recommend(cfg, world, device, local), p))
        print()
        print(format_options(opts, best_per_levers(opts), costs))
        print()
        ok = ok and p.fits_all
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
