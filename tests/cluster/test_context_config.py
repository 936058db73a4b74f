"""train.context_parallel that cannot split the job's world sizes is refused before any worker
starts (issue 37), naming what would be valid: a fixed size the degree does not divide (under
HYBRID_SHARD: its shard group), an elastic range whose ends it does not split (an elastic run
only starts groups at sizes the degree splits, cluster/elastic/cluster_view.py, so such an end is
a size it could never start at). The key composes from the command line."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import ClusterConfig, ConfigError, JobConfig, context_splits
from tests.cluster.conftest import run_cli
from tests.cluster.test_config_errors import assert_failed_before_start
from trainer.config import ShardingConfig, ShardingStrategy


def job(context: int, sharding: ShardingConfig | None = None, **cluster) -> JobConfig:
    cfg = JobConfig(cluster=ClusterConfig(**cluster), sharding=sharding or ShardingConfig())
    cfg.train = dataclasses.replace(cfg.train, context_parallel=context, global_batch_size=12)
    return cfg


def refusal(cfg: JobConfig) -> str:
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    return str(e.value)


def test_a_fixed_size_the_degree_does_not_divide_is_refused_naming_the_valid_degrees():
    assert refusal(job(2, num_workers=3)) == (
        "invalid config: train.context_parallel=2 does not divide the world size 3; valid: 1, 3 "
        "(or a world size that 2 divides)"
    )
    assert "valid: 1, 2, 3, 6" in refusal(job(4, num_workers=6))
    for context, workers in [(2, 2), (2, 4), (3, 6), (4, 4)]:
        job(context, num_workers=workers).validate()


def test_under_hybrid_shard_the_degree_must_divide_the_shard_group_not_only_the_world():
    hybrid = ShardingConfig(strategy=ShardingStrategy.HYBRID_SHARD, hybrid_shard_group_size=3)
    message = refusal(job(2, hybrid, num_workers=6))  # 2 divides 6, not the groups of 3
    assert "train.context_parallel=2 does not divide the HYBRID_SHARD shard group of 3 ranks" in (
        message
    )
    assert "valid: 1, 3" in message
    groups_of_2 = dataclasses.replace(hybrid, hybrid_shard_group_size=2)
    job(2, groups_of_2, num_workers=6).validate()


def test_an_elastic_range_whose_ends_the_degree_does_not_split_is_refused_naming_both_fixes():
    message = refusal(job(2, min_workers=3, max_workers=4))
    assert message == (
        "invalid config: train.context_parallel=2; valid: a degree that splits both ends of "
        "cluster.min_workers..max_workers=3..4 (1), or min_workers and max_workers among the "
        "world sizes 2 splits (2, 4, 6, 8, ...): an elastic run starts its groups only at those"
    )
    assert "max_workers=2..5 (1)" in refusal(job(2, min_workers=2, max_workers=5))
    assert "max_workers=4..6 (1, 2)" in refusal(job(3, min_workers=4, max_workers=6))
    assert "sizes 3 splits (3, 6, 9, 12, ...)" in refusal(job(3, min_workers=4, max_workers=6))


def test_an_elastic_range_with_both_ends_split_is_accepted_and_its_middle_is_skipped():
    cfg = job(2, min_workers=2, max_workers=6).validate()
    assert [n for n in range(2, 7) if cfg.splits_context(n)] == [2, 4, 6]
    job(1, min_workers=3, max_workers=5).validate()  # off: every size
    assert all(context_splits(ShardingConfig(), 1, n) for n in range(1, 9))


def test_the_cli_composes_the_key_and_refuses_a_degree_the_workers_cannot_split(launch_dir):
    result = run_cli(launch_dir, "train.context_parallel=2", "cluster.num_workers=3")
    assert_failed_before_start(
        result,
        launch_dir,
        "error: invalid config: train.context_parallel=2 does not divide the world size 3; "
        "valid: 1, 3",
    )
