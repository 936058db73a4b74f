"""The driver's checks before Ray: what the workers would otherwise find, minutes later.

    cfg = checked_config(dictcfg, launch_dir)    # values, paths, sources, the checkpoint to resume
    plan = preflight(cfg)                        # the prepared data intact, the storage writable
    connect_largest([cfg]); prepare_data(cfg, plan); ...

A problem found in a worker costs a Ray start and cluster.max_failures + 1 tries of the worker
group, each with its tracebacks; found here it is one `error:` line (a ConfigError) in seconds,
before Ray starts and before the MLflow run exists. `checked_config` makes the job the one the
workers will run (typed, validated, its paths absolute) and refuses a resumable checkpoint of
another model, global batch or data (trainer.checkpoint.resume.preflight_resume); `preflight`
adds what needs the storage itself:

- the prepared data, when a preparation of this job exists: its manifest reads, every shard is
  there with the size it records (one LIST), and, up to CHECKSUM_MAX_BYTES in all, every shard's
  crc32 is as recorded (a flipped byte would otherwise surface as a bad token id in a worker);
- the prepared data holds what the run reads (trainer/data/splits.py): a sample of
  data.seq_len + 1 tokens in the train split (and the eval split with train.eval_every), the
  windows of this data.seq_len (chat), token ids the model has rows for. Data small enough to
  prepare in this process (trainer.data.preparation.on_ray_data is False) is prepared here
  first, so these are answered from its manifest before Ray starts; data prepared on Ray Data
  is checked by the workers (the same messages);
- the run's checkpoint folder takes a write: a small uniquely named probe file, removed again.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from cluster.compose import to_job_config
from cluster.config import ConfigError, JobConfig
from cluster.tracking.runs import resolve_tracking_uri
from trainer import storage
from trainer.data import MANIFEST, DataError, PreparedData, plan_and_check, prepare
from trainer.data.preparation import Plan, on_ray_data, plan_preparation
from trainer.data.splits import check_prepared
from trainer.shell import python_m
from trainer.storage import Location

# ---- the job as the workers will run it --------------------------------------------------------


def checked_config(
    dictcfg: DictConfig, launch_dir: str, run_name: Optional[str] = None, resume: bool = True
) -> JobConfig:
    """The job as the workers will run it: typed, validated, its paths absolute, and under
    `run_name` when given (a sweep's job). Raises ConfigError (or OmegaConf's error) naming the
    key and the value: call it before anything starts.

    Besides the values themselves: a Hugging Face model (model.hf_path) gives the shape from its
    config.json and holds exactly that shape's tensors, the data sources list files, the
    tokenizer loads and fits the model's vocabulary, each source's first JSONL/Parquet file has
    the text column, and the run's newest checkpoint (if any) was trained on this model, global
    batch and data order (unless `resume` is False: a command that does not train)."""
    from trainer.checkpoint.resume import (  # noqa: PLC0415 -- torch: after the values
        data_identity,
        preflight_resume,
    )
    from trainer.hf import HFWeights, resolve_model  # noqa: PLC0415 -- torch: after the values

    cfg = to_job_config(dictcfg)  # model=hf: config.json's shape already (cluster/compose.py)
    if cfg.model.hf_path:
        check_context(cfg)
    cfg.validate()
    if run_name is not None:
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, run_name=run_name))
    cfg = with_absolute_paths(cfg, launch_dir)
    if cfg.model.hf_path:  # the shape is the checkpoint's; its tensors must be that shape's
        cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model))
        check_context(cfg)
        cfg.validate()
        HFWeights(cfg.model.hf_path, cfg.model)
    if resume:  # before the data's checks: another model's vocabulary is no news then
        check_resume_model(cfg)
    if cfg.sharding.modules:  # a pattern that names no unit: before any worker starts
        from trainer.build import check_module_strategies  # noqa: PLC0415 -- torch: when asked

        check_module_strategies(cfg)
    if cfg.train.freeze:  # a pattern naming no parameter, or freezing all: before any worker
        from trainer.build import check_freeze  # noqa: PLC0415 -- torch: when asked

        check_freeze(cfg)
    if cfg.train.float8:  # torchao missing or a bad recipe: before any worker starts
        from trainer.speed import check_float8  # noqa: PLC0415 -- torch: only when asked for

        check_float8(cfg.train)
    plan = plan_and_check(cfg)
    if resume:
        preflight_resume(cfg.checkpoint_root, cfg, data_identity(cfg, plan.digest))
    if cfg.cluster.device_memory_gb:  # a job that cannot fit fails here, with the breakdown
        from trainer.plan import check_fits  # noqa: PLC0415 -- torch: only when asked for
        from trainer.plan.levers import DEFAULT_HOST_MEMORY_GB  # noqa: PLC0415 -- the same

        memory = int(cfg.cluster.device_memory_gb * 2**30)
        host = int((cfg.cluster.host_memory_gb or DEFAULT_HOST_MEMORY_GB) * 2**30)
        check_fits(
            cfg,
            cfg.cluster.world_sizes[0],
            memory,
            headroom=cfg.cluster.use_gpu,
            host_memory_bytes=host if cfg.cluster.use_gpu else None,  # CPU: the device is host
        )
    return cfg


def check_context(cfg: JobConfig) -> None:
    """model=hf: data.seq_len within the checkpoint's context (its max_position_embeddings),
    named as the user knows it, not as model.max_seq_len (which config.json sets)."""
    context = cfg.model.max_seq_len
    if cfg.data.seq_len > context:
        raise ConfigError(
            f"invalid config: data.seq_len={cfg.data.seq_len} is longer than the model's "
            f"context, max_position_embeddings={context} in {cfg.model.hf_path}/config.json; "
            f"valid: data.seq_len <= {context}"
        )


def check_resume_model(cfg: JobConfig) -> None:
    """The newest checkpoint of the run (if any) is of this model shape; otherwise a ConfigError
    naming the fields that differ and, for a checkpoint imported from Hugging Face
    (import-hf), the overrides that train it (`model=hf model.hf_path=<its source>`)."""
    from trainer.checkpoint import (  # noqa: PLC0415 -- torch: after the values
        CheckpointError,
        CheckpointReader,
        list_checkpoints,
    )
    from trainer.checkpoint.resume import check_model  # noqa: PLC0415 -- torch

    for info in list_checkpoints(cfg.checkpoint_root):
        if info.problem:
            continue
        try:
            state = CheckpointReader(info.path).state
        except CheckpointError:
            continue  # the resume falls back past it
        if state.get("model_config"):
            check_model(state, cfg.model, info.path)
        return


def already_complete(cfg: JobConfig) -> Optional[str]:
    """What to say, before anything starts, when the run's newest committed checkpoint has
    trained every step asked for (a second `make run`): it is complete, and what to change to
    train more (more steps: it resumes there) or afresh (a new run name). None otherwise."""
    from trainer.checkpoint import list_checkpoints  # noqa: PLC0415 -- torch: after the values

    newest = next((i for i in list_checkpoints(cfg.checkpoint_root) if not i.problem), None)
    if newest is None or newest.step < cfg.train.steps:
        return None
    name = cfg.cluster.run_name
    return (
        f"run '{name}' is complete: its checkpoint of step {newest.step} ({newest.path}) has "
        f"trained train.steps={cfg.train.steps}; nothing was started. To train on from it, "
        f"raise train.steps (e.g. train.steps={newest.step + cfg.train.steps}); to start over, "
        f"give a new run name (e.g. cluster.run_name={name}-2)."
    )


def is_uri(path: str) -> bool:
    """True for pyarrow.fs URIs (s3://, gs://, file://...), which are left as they are."""
    return "://" in path


def absolute(path: str, base_dir: str) -> str:
    if is_uri(path) or Path(path).is_absolute():
        return path
    return str((Path(base_dir) / path).resolve())


def with_absolute_paths(cfg: JobConfig, base_dir: str) -> JobConfig:
    """A copy of cfg with the data, tokenizer, storage and tracking locations absolute: Ray
    workers and Ray Data tasks run in other folders, on other machines."""
    d = cfg.data
    data = dataclasses.replace(
        d,
        source=_data_path(d.source, base_dir),
        mix=[dataclasses.replace(m, path=_data_path(m.path, base_dir)) for m in d.mix],
        tokenizer=d.tokenizer if d.tokenizer == "byte" else absolute(d.tokenizer, base_dir),
        prepared_dir=absolute(d.prepared_dir, base_dir),
    )
    hf = cfg.model.hf_path
    model = dataclasses.replace(cfg.model, hf_path=absolute(hf, base_dir) if hf else hf)
    return dataclasses.replace(
        cfg,
        model=model,
        data=data,
        cluster=dataclasses.replace(
            cfg.cluster, storage_path=absolute(cfg.cluster.storage_path, base_dir)
        ),
        tracking=dataclasses.replace(
            cfg.tracking, tracking_uri=resolve_tracking_uri(cfg.tracking.tracking_uri, base_dir)
        ),
    )


def _data_path(path: str, base_dir: str) -> str:
    if path == "stdlib" or not path:
        return path
    return absolute(str(Path(path).expanduser()) if not is_uri(path) else path, base_dir)


# ---- what needs the storage ----------------------------------------------------------------------

CHECKSUM_MAX_BYTES = 2 * 2**30
"""A preparation up to this size has every shard's crc32 checked (zlib reads a few GB/s locally);
a larger one only its shard sizes, and a line says how to verify it in full."""


def preflight(cfg: JobConfig, log=print) -> Plan:
    """ConfigError when the prepared data is damaged or the storage cannot be written; the
    data's preparation plan otherwise (prepare_data takes it: the sources are listed once)."""
    plan = plan_preparation(cfg.data)
    check_prepared_data(plan.root, log)
    if not on_ray_data(cfg.data, plan):  # seconds here; the workers would find it minutes later
        prepare(cfg.data, log=log, plan=plan)
    if storage.exists(plan.root.child(MANIFEST)):
        check_prepared(cfg, PreparedData.open(str(plan.root)))
    check_storage_writable(cfg.checkpoint_root, cfg.cluster.storage_path)
    return plan


def check_prepared_data(root: Location, log=print) -> None:
    """A preparation at `root` (if any) is whole: the manifest, each shard's size, and its crc32
    when the whole preparation is at most CHECKSUM_MAX_BYTES."""
    try:
        data = PreparedData.open(str(root))
    except (DataError, OSError) as e:
        if not storage.exists(root.child(MANIFEST)):
            return None  # not prepared yet (or not finished): prepare_data will do it
        raise ConfigError(_damaged(root, str(e))) from None
    listing = storage.list_dir(root)  # one LIST: every shard's size
    shards = [sh for s in data.manifest.sources for sp in s.splits.values() for sh in sp.shards]
    for shard in shards:
        info = listing.get(shard.name)
        if info is None or info.size != shard.nbytes:
            found = "missing" if info is None else f"{info.size} bytes"
            raise ConfigError(
                _damaged(root, f"{root}/{shard.name}: {found}, the manifest records {shard.nbytes}")
            )
    total = sum(sh.nbytes for sh in shards)
    if total > CHECKSUM_MAX_BYTES:
        log(
            f"data: {total / 2**30:.1f} GiB prepared in {root}: shard sizes checked, checksums "
            f"not read ({python_m('trainer.data')} inspect {root} --verify reads them all)"
        )
        return None
    start = time.monotonic()
    problems = data.verify()
    if problems:
        raise ConfigError(_damaged(root, "; ".join(problems)))
    log(
        f"data: {len(shards)} shards ({total / 2**20:.1f} MiB) verified in "
        f"{time.monotonic() - start:.2f} s"
    )
    return None


def _damaged(root: Location, problem: str) -> str:
    return (
        f"invalid prepared data: {problem}; valid: an intact preparation: delete {root} and run "
        "again to prepare it anew (python -m cluster.prepare, or any training run)"
    )


def check_storage_writable(root: str, storage_path: Optional[str] = None) -> None:
    """Create `root` (the run's checkpoint folder) and write, then delete, a small uniquely named
    probe file in it; ConfigError naming the folder and the OS error when that fails."""
    probe_name = f".preflight-{uuid.uuid4().hex}"
    try:
        loc = storage.resolve(root)
        loc.fs.create_dir(loc.path, recursive=True)
        probe = loc.child(probe_name)
        storage.write_bytes(probe, b"elastic-fsdp preflight: this folder takes writes\n")
        storage.delete_file(probe)
    except OSError as e:
        key = f"cluster.storage_path={storage_path!r}: " if storage_path is not None else ""
        raise ConfigError(
            f"invalid config: {key}the run's checkpoint folder {root} is not writable "
            f"({type(e).__name__}: {e}); valid: a writable local path or pyarrow.fs URI "
            "(s3://, gs://) with write access"
        ) from None
