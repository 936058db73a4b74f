"""Tokenize the training data on the cluster, once: a Ray Data pipeline over the preparation's
work units, on the cluster's CPUs (a laptop's local Ray runs the same code).

    python -m cluster.prepare data=parquet data.source=s3://bucket/corpus/*.parquet \\
        data.tokenizer=s3://bucket/tokenizers/llama3/tokenizer.json data.prepared_dir=s3://bucket/prepared
    python -m cluster.train ...same data.*...    # finds the preparation and trains on it

The pipeline reads the units (trainer.data.preparation: one JSONL or Parquet file, or a group of
text files), tokenizes each in a Ray Data task that loads the tokenizer once per actor, writes the
unit's token shards straight to data.prepared_dir and returns its small record; the driver then
commits the manifest. Each unit is a pure function of its inputs, so the shards are the same
bytes as a one-process preparation. A preparation that died (or was interrupted) resumes: units
whose record exists are not sent again.

Training runs prepare too, before their workers start: on Ray Data when data.prepare_with=ray,
or auto with more than AUTO_RAY_BYTES (trainer/data/preparation.py) of sources; otherwise in the
driver's process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from cluster.compose import overrides_or_exit, register_schemas
from cluster.config import ConfigError, JobConfig
from cluster.launch import connect_largest
from cluster.preflight import checked_config
from trainer.data import (
    PreparedData,
    PreparedInfo,
    WorkUnit,
    plan_and_check,
    prepare,
    process_unit,
)
from trainer.data.preparation import Plan, on_ray_data
from trainer.data.splits import check_prepared
from trainer.data.tokenizer import load_tokenizer
from trainer.shell import python_m

register_schemas()


REFUSED = "refused"
"""A unit record's key for the refusal of its input (TokenizeUnits.one)."""


class TokenizeUnits:
    """Ray Data UDF (one per actor): the tokenizer is loaded once, then each unit is processed."""

    def __init__(self, args: dict):
        self.args = args
        self.tokenizer = load_tokenizer(args["tokenizer"], args["eod_token"])

    def __call__(self, batch: dict) -> dict:
        return {"record": [json.dumps(self.one(json.loads(u))) for u in batch["unit"]]}

    def one(self, unit: dict) -> dict:
        """The unit's record, or {"refused": message} when its input is refused (a missing
        image, say): the driver raises it as the ConfigError it is, rather than Ray's wrapped
        task error, so the preparation's folder is removed and the user reads one line."""
        try:
            return process_unit(WorkUnit.from_json(unit), self.args, self.tokenizer)
        except ConfigError as e:
            return {REFUSED: str(e)}


def ray_data_runner(plan: Plan, units: list[WorkUnit], log=print) -> list[dict]:
    """The units as Ray Data tasks, as many at a time as the cluster has CPUs (one each)."""
    import ray  # noqa: PLC0415 -- ray: seconds to import, and only when preparing on it

    if not units:
        return []
    cpus = int(ray.available_resources().get("CPU", 1)) or 1
    actors = max(1, min(cpus, len(units)))
    log(f"prepare: {len(units)} units on Ray Data, {actors} tokenizer actor(s) of 1 CPU")
    ds = ray.data.from_items(
        [{"unit": json.dumps(u.to_json())} for u in units], override_num_blocks=len(units)
    )
    out = ds.map_batches(
        TokenizeUnits,
        fn_constructor_kwargs={"args": plan.unit_args()},
        batch_size=1,
        num_cpus=1,
        compute=ray.data.ActorPoolStrategy(size=actors),
    )
    return records_or_refusal([json.loads(row["record"]) for row in out.take_all()])


def records_or_refusal(records: list[dict]) -> list[dict]:
    """The units' records; the first refusal among them raised as the ConfigError it was."""
    refused = [r[REFUSED] for r in records if REFUSED in r]
    if refused:
        raise ConfigError(refused[0])
    return records


def prepare_data(cfg: JobConfig, plan: Optional[Plan] = None) -> PreparedInfo:
    """Prepare cfg's data (nothing to do when it is prepared already); Ray must be connected
    when it runs on Ray Data. Prints one line saying what the workers will read. Data prepared
    on Ray Data is checked against the run here, before the workers start (the preflight checked
    what the driver prepared itself): ConfigError naming what to change."""
    plan = plan or plan_and_check(cfg)
    on_ray = on_ray_data(cfg.data, plan)
    info = prepare(cfg.data, runner=ray_data_runner if on_ray else None, plan=plan)
    if on_ray:
        check_prepared(cfg, PreparedData.open(info.uri))
    state = "prepared now" if info.created else "already prepared"
    print(
        f"data: {info.num_tokens:,} tokens from {info.num_files} files in {info.uri} ({state})",
        flush=True,
    )
    return info


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def hydra_main(dictcfg: DictConfig) -> None:
    try:
        cfg = checked_config(dictcfg, os.getcwd(), resume=False)
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg.data.prepare_with == "auto":  # this command is for preparing on the cluster
        cfg.data.prepare_with = "ray"
    connect_largest([cfg])
    info = prepare_data(cfg)
    print(
        f"{info.num_documents:,} documents in {info.num_shards} shards "
        f"(digest {info.digest[:16]}); "
        f"{python_m('trainer.data')} inspect {info.uri}"
    )


if __name__ == "__main__":
    overrides_or_exit(sys.argv[1:])
    hydra_main()
