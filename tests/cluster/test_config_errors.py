"""Bad input fails through the real CLI with a message naming the key, the value and what is
valid, before any worker starts: no Ray, no MLflow run, no run folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from cluster.compose import register_schemas
from cluster.config import ConfigError
from cluster.preflight import checked_config
from tests.cluster.conftest import run_cli

NOTHING_STARTED_MARKERS = ("started a local Ray for this job", "mlflow: run")


def assert_failed_before_start(result, launch_dir, *expected: str) -> None:
    assert result.returncode != 0, result.output
    for text in expected:
        assert text in result.output, f"{text!r} not in:\n{result.output}"
    for marker in NOTHING_STARTED_MARKERS:
        assert marker not in result.output
    assert not (launch_dir / "runs").exists()
    assert not (launch_dir / "mlflow.db").exists()


def test_unknown_sharding_option_fails_listing_the_valid_options(launch_dir):
    result = run_cli(launch_dir, "sharding=full_shrad")
    assert_failed_before_start(
        result,
        launch_dir,
        "Could not find 'sharding/full_shrad'",
        "full_shard",
        "shard_grad_op",
        "no_shard",
        "hybrid_shard",
    )


@pytest.mark.parametrize("override", ["train.foo=1", "+train.foo=1"])
def test_unknown_key_fails_naming_the_key(launch_dir, override):
    result = run_cli(launch_dir, override)
    assert_failed_before_start(result, launch_dir, "foo")
    assert "TrainConfig" in result.output or "valid keys of train: steps" in result.output


def test_value_of_wrong_type_fails_naming_the_key(launch_dir):
    result = run_cli(launch_dir, "train.steps=many")
    assert_failed_before_start(result, launch_dir, "'many'", "train.steps")


@pytest.mark.parametrize("steps", ["0", "-5"])
def test_non_positive_steps_fails_naming_the_value(launch_dir, steps):
    result = run_cli(launch_dir, f"train.steps={steps}")
    assert_failed_before_start(result, launch_dir, f"train.steps={steps}", "a positive integer")


def test_global_batch_smaller_than_world_size_fails(launch_dir):
    result = run_cli(launch_dir, "train.global_batch_size=3", "cluster.num_workers=4")
    assert_failed_before_start(
        result, launch_dir, "train.global_batch_size=3", "at least the largest world size (4)"
    )


def test_missing_data_path_fails_naming_the_path(launch_dir):
    missing = launch_dir / "no_such_corpus"
    result = run_cli(launch_dir, f"data.source={missing}")
    assert_failed_before_start(result, launch_dir, f"data.source='{missing}'", "no such file")


def test_a_job_that_cannot_fit_the_device_fails_before_any_worker_starts(tmp_path):
    """The memory planner runs on the driver: 8B on 8 x 16 GiB without sharding cannot fit."""
    register_schemas()
    conf = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        dictcfg = compose(
            "config",
            overrides=[
                "model=8b",
                "sharding=no_shard",
                "cluster.num_workers=8",
                "train.global_batch_size=8",
                "data.seq_len=2048",
                "cluster.device_memory_gb=16",
            ],
        )
    with pytest.raises(
        ConfigError, match="(?s)sharding.strategy=NO_SHARD.*needs .* GiB per worker.*DOES NOT FIT"
    ):
        checked_config(dictcfg, str(tmp_path))


def test_a_module_pattern_that_names_no_unit_fails_naming_the_units(launch_dir):
    """sharding.modules through the real CLI: the map takes keys of the user's choosing, and a
    pattern that names no unit of the model stops the run before anything starts."""
    result = run_cli(launch_dir, "sharding.modules={tok_embeddings:no_shard,layer.*:full_shard}")
    assert_failed_before_start(
        result, launch_dir, "'layer.*' names no unit", "layers.0 .. layers.", "(layers.*)"
    )


def test_a_typo_in_a_key_gets_the_closest_key_at_once_not_hydras_advice_to_add_it(launch_dir):
    for override in ("train.stpes=10", "+train.stpes=10"):
        result = run_cli(launch_dir, override)
        assert_failed_before_start(result, launch_dir, "unknown key train.stpes")
        assert "(did you mean train.steps?)" in result.output
        assert "To append to your config use" not in result.output  # Hydra's advice, not ours
