"""Every bad input stops at the driver: the real CLI exits 2 with one `error:` line naming the
value and what is valid, in seconds, before Ray starts and before an MLflow run exists.

Before the preflight these were found inside the Ray workers, retried cluster.max_failures + 1
times with pages of tracebacks (1.5-2.5 minutes each). Each test records how long the CLI took to
the error (printed; run pytest with -s to see the times).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from cluster.compose import register_schemas
from cluster.config import ConfigError
from cluster.preflight import checked_config
from tests.cluster.conftest import REPO, run_cli

SECONDS_TO_ERROR = 30.0
"""The driver's checks import torch and list the data: a few seconds, never a worker's minute."""

CORPUS_TEXT = "the quick brown fox jumps over the lazy dog. " * 400


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A small text corpus: three documents of ~18 KB, prepared in well under a second."""
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(3):
        (d / f"doc{i}.txt").write_text(f"document {i}: {CORPUS_TEXT}")
    return d


def base_overrides(launch_dir: Path, corpus: Path) -> list[str]:
    return [
        "data=text",
        f"data.source={corpus}",
        "data.seq_len=32",
        "model.dim=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.ffn_dim=64",
        "train.steps=2",
        "train.global_batch_size=4",
        "train.checkpoint_every=1",
        f"tracking.tracking_uri=sqlite:///{launch_dir}/mlflow.db",
    ]


def run_preflight(launch_dir: Path, corpus: Path, *overrides: str):
    """The CLI with the base job plus `overrides`. A Ray it started would put its session folder
    in `result.ray_tmp` (short: Ray's socket paths must fit in 107 bytes)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp")) / "ray"
    start = time.monotonic()
    try:
        result = run_cli(
            launch_dir,
            *base_overrides(launch_dir, corpus),
            *overrides,
            timeout=150.0,
            env={"RAY_TMPDIR": str(ray_tmp)},
        )
        result.seconds = time.monotonic() - start
        result.ray_started = ray_tmp.exists()
    finally:
        shutil.rmtree(ray_tmp.parent, ignore_errors=True)
    print(f"\n[{' '.join(overrides)}] -> rc {result.returncode} in {result.seconds:.1f} s")
    return result


def assert_stopped_at_driver(result, launch_dir: Path, *expected: str) -> str:
    """rc 2, exactly one `error:` line holding every `expected` text, no traceback, in seconds,
    no Ray started and no MLflow run created. Returns the error line."""
    out = result.output
    assert result.returncode == 2, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-4000:]
    for text in expected:
        assert text in errors[0], f"{text!r} not in:\n{errors[0]}"
    assert "Traceback" not in out, out[-4000:]
    assert result.seconds < SECONDS_TO_ERROR, f"{result.seconds:.1f} s"
    assert "started a local Ray for this job" not in out
    assert not result.ray_started
    assert "mlflow: run" not in out
    assert not (launch_dir / "mlflow.db").exists()
    return errors[0]


# ---- cluster.run_name -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../escaped", "team/run", "..", ".hidden", "a\\\\b"])
def test_run_name_that_is_not_one_safe_path_component_is_refused(launch_dir, corpus, name):
    result = run_preflight(launch_dir, corpus, f"cluster.run_name='{name}'")
    assert_stopped_at_driver(result, launch_dir, "cluster.run_name=", "one path component")
    assert not (launch_dir / "runs").exists()
    assert not (launch_dir / "escaped").exists()


def test_empty_run_name_is_refused(launch_dir, corpus):
    result = run_preflight(launch_dir, corpus, "cluster.run_name=''")
    assert_stopped_at_driver(result, launch_dir, "cluster.run_name=''", "one path component")


@pytest.mark.parametrize("name", ["a\tb", "a\nb", "run\x00", "a\x7fb"])
def test_run_name_with_a_control_character_is_refused(tmp_path, name):
    dictcfg = composed(["data=text", f"data.source={tmp_path}"])
    dictcfg.cluster.run_name = name
    with pytest.raises(ConfigError, match="cluster.run_name=.*one path component"):
        checked_config(dictcfg, str(tmp_path))


# ---- cluster values: finite and in range -----------------------------------------------------


@pytest.mark.parametrize(
    "override, valid",
    [
        ("cluster.cpus_per_worker=nan", "a positive number"),
        ("cluster.cpus_per_worker=inf", "a positive number"),
        ("cluster.cpus_per_worker=0", "a positive number"),
        ("cluster.pg_timeout_s=0", "a positive number of seconds"),
        ("cluster.pg_timeout_s=-5", "a positive number of seconds"),
        ("cluster.pg_timeout_s=nan", "a positive number of seconds"),
        ("cluster.pg_timeout_s=inf", "a positive number of seconds"),
        ("cluster.device_memory_gb=nan", "null or a positive number of GiB"),
        ("cluster.elastic_resize_monitor_interval_s=0", "a positive number of seconds"),
        ("cluster.elastic_resize_monitor_interval_s=nan", "a positive number of seconds"),
    ],
)
def test_cluster_value_that_is_not_finite_and_in_range_is_refused(
    launch_dir, corpus, override, valid
):
    result = run_preflight(launch_dir, corpus, override)
    assert_stopped_at_driver(result, launch_dir, override, valid)


def test_elastic_bounds_out_of_order_are_refused(launch_dir, corpus):
    result = run_preflight(launch_dir, corpus, "cluster.min_workers=3", "cluster.max_workers=2")
    assert_stopped_at_driver(result, launch_dir, "cluster.min_workers=3", "min_workers <=")


# ---- storage ---------------------------------------------------------------------------------


def test_unwritable_storage_path_is_refused_naming_the_path_and_the_os_error(launch_dir, corpus):
    blocker = launch_dir / "not_a_dir"
    blocker.write_text("a file where the storage folder should be\n")
    result = run_preflight(launch_dir, corpus, f"cluster.storage_path={blocker}/runs")
    line = assert_stopped_at_driver(
        result, launch_dir, "cluster.storage_path=", f"{blocker}/runs/elastic-fsdp/checkpoints"
    )
    assert "not writable" in line and "a writable" in line


def test_writable_storage_keeps_no_probe_file(tmp_path):
    from cluster.preflight import check_storage_writable

    root = tmp_path / "runs" / "r" / "checkpoints"
    check_storage_writable(str(root))
    assert root.is_dir() and list(root.iterdir()) == []


# ---- the checkpoint a resume would pick -------------------------------------------------------


def composed(overrides: list[str]):
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("config", overrides=overrides)


def _train_one_rank(rank, world, cfg, root):
    from trainer.loop import WorkerContext, run_training

    return run_training(cfg, WorkerContext(rank=rank, world_size=world, checkpoint_root=root))


@pytest.fixture
def trained_run(launch_dir, corpus):
    """A real checkpoint of the base job (one gloo rank, two steps) where the CLI's run finds it."""
    from tests.dist_utils import run_distributed
    from trainer.data import prepare

    cfg = checked_config(composed(base_overrides(launch_dir, corpus)), str(launch_dir))
    prepare(cfg.data, log=lambda *_: None)
    result = run_distributed(_train_one_rank, 1, cfg, cfg.checkpoint_root)[0]
    assert result.last_checkpoint
    return cfg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.dim=64", ["(model.dim: 32 there, 64 here)", "model=tiny", "new cluster.run_name"]),
        ("train.global_batch_size=8", ["train.global_batch_size=8", "trained with 4"]),
    ],
)
def test_checkpoint_of_another_model_or_batch_is_refused(
    launch_dir, corpus, trained_run, override, expected
):
    result = run_preflight(launch_dir, corpus, override)
    assert_stopped_at_driver(result, launch_dir, trained_run.checkpoint_root, *expected)


# ---- prepared data -------------------------------------------------------------------------


@pytest.fixture
def prepared(launch_dir, corpus):
    """The base job's data, prepared; returns (the preparation's folder, its train shards)."""
    from trainer.data import prepare

    cfg = checked_config(composed(base_overrides(launch_dir, corpus)), str(launch_dir))
    info = prepare(cfg.data, log=lambda *_: None)
    shards = sorted(Path(info.uri).glob("*-train.bin"))
    assert shards
    return Path(info.uri), shards


def test_prepared_shard_with_a_flipped_byte_is_refused_naming_the_file(
    launch_dir, corpus, prepared
):
    _, shards = prepared
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(data))
    result = run_preflight(launch_dir, corpus)
    assert_stopped_at_driver(result, launch_dir, str(shards[0]), "crc32", "delete")


def test_truncated_prepared_shard_is_refused_naming_the_file(launch_dir, corpus, prepared):
    _, shards = prepared
    shards[0].write_bytes(shards[0].read_bytes()[:-10])
    result = run_preflight(launch_dir, corpus)
    assert_stopped_at_driver(result, launch_dir, str(shards[0]), "bytes", "delete")
