"""conf/ composes into cluster.config.JobConfig, and the driver-side transforms of it are exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from cluster.compose import register_schemas, to_job_config
from cluster.config import JobConfig, job_from_dict, job_to_dict
from cluster.launch import build_trainer, local_num_cpus
from cluster.preflight import with_absolute_paths
from cluster.run.layout import checkpoint_root
from trainer.config import PRESETS, ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUP_OPTIONS = {
    "model": sorted(PRESETS),  # the presets are Python, registered with Hydra
    **{
        group: sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        for group in ("sharding", "optim", "data", "cluster", "tracking")
    },
}


def composed(*overrides: str) -> JobConfig:
    register_schemas()
    with initialize_config_dir(str(CONF), version_base=None):
        return to_job_config(compose("config", overrides=list(overrides)))


def test_each_group_has_the_options_the_issues_name():
    assert GROUP_OPTIONS["sharding"] == ["full_shard", "hybrid_shard", "no_shard", "shard_grad_op"]
    assert GROUP_OPTIONS["cluster"] == ["local", "ray"]
    assert GROUP_OPTIONS["tracking"] == ["local", "server"]
    assert {"adamw"} <= set(GROUP_OPTIONS["optim"]) and {"stdlib"} <= set(GROUP_OPTIONS["data"])


@pytest.mark.parametrize(
    "group,option", [(g, o) for g, opts in GROUP_OPTIONS.items() for o in opts]
)
def test_every_group_option_composes_into_a_valid_job_config(group, option, tmp_path):
    required = REQUIRED.get(option, ())
    if option == "hf":  # composing model=hf reads the shape from the checkpoint's config.json
        (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
        required = (f"model.hf_path={tmp_path}",)
    cfg = composed(f"{group}={option}", "train.global_batch_size=16", *required)
    assert isinstance(cfg, JobConfig) and cfg.validate() is cfg


TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
}  # fmt: skip


# The options that describe a user's own data or model leave where it is to the user.
REQUIRED = {
    "jsonl": ("data.source=/corpus", "data.tokenizer=/tok.json"),
    "parquet": ("data.source=s3://b/*.parquet", "data.tokenizer=s3://b/tok.json"),
    "text": ("data.source=/corpus",),
    "chat": ("data.source=/sft.jsonl", "data.tokenizer=/tok.json"),
    "hf": ("model.hf_path=/models/llama",),
}
REQUIRED_KEY = {
    "jsonl": "data=jsonl",
    "parquet": "data=parquet",
    "text": "data=text",
    "chat": "data=chat",
    "hf": "model=hf",
}


@pytest.mark.parametrize("option", sorted(REQUIRED))
def test_an_option_without_its_location_is_refused_naming_the_key(option):
    key = REQUIRED[option][0].split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}=''"):
        composed(REQUIRED_KEY[option]).validate()


@pytest.mark.parametrize(
    "option,strategy",
    [
        ("full_shard", "FULL_SHARD"),
        ("no_shard", "NO_SHARD"),
        ("shard_grad_op", "SHARD_GRAD_OP"),
        ("hybrid_shard", "HYBRID_SHARD"),
    ],
)
def test_sharding_option_selects_its_strategy(option, strategy):
    assert composed(f"sharding={option}").sharding.strategy == strategy


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_option_composes_to_exactly_its_preset(name):
    """`model=<name>` on the command line is trainer.config.PRESETS[name], field for field: the
    presets have one home, and Hydra reads them from there."""
    assert composed(f"model={name}").model == PRESETS[name]


def test_default_job_is_tiny_full_shard_on_two_local_cpu_workers():
    cfg = composed()
    assert (cfg.model.name, cfg.sharding.strategy) == ("tiny", "FULL_SHARD")
    assert (cfg.cluster.address, cfg.cluster.num_workers, cfg.cluster.use_gpu) == (None, 2, False)
    assert cfg.tracking.tracking_uri == "sqlite:///mlflow.db" and cfg.data.source == "stdlib"


def test_job_config_survives_the_trip_to_the_workers_as_a_plain_dict():
    cfg = composed("sharding=no_shard", "cluster.min_workers=1", "cluster.max_workers=3")
    assert job_from_dict(job_to_dict(cfg)) == cfg
    with pytest.raises(TypeError, match="unknown JobConfig sections"):
        job_from_dict({**job_to_dict(cfg), "extra": {}})


def test_relative_paths_become_absolute_against_the_launch_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = with_absolute_paths(composed("cluster.run_name=r1"), str(tmp_path))
    assert cfg.data.prepared_dir == str(tmp_path / "data" / "prepared")
    assert cfg.cluster.storage_path == str(tmp_path / "runs")
    assert cfg.checkpoint_root == f"{tmp_path}/runs/r1/checkpoints"
    assert cfg.tracking.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"


def test_uris_are_left_as_they_are(tmp_path):
    cfg = composed("cluster.storage_path=s3://bucket/runs", "data.prepared_dir=s3://bucket/data")
    cfg = with_absolute_paths(cfg, str(tmp_path))
    assert (cfg.cluster.storage_path, cfg.data.prepared_dir) == (
        "s3://bucket/runs",
        "s3://bucket/data",
    )
    assert cfg.checkpoint_root == "s3://bucket/runs/elastic-fsdp/checkpoints"
    assert checkpoint_root("s3://b/runs/", "x") == "s3://b/runs/x/checkpoints"
    assert (
        checkpoint_root("s3://b/runs?endpoint_override=h:9000&scheme=http", "x")
        == "s3://b/runs/x/checkpoints?endpoint_override=h:9000&scheme=http"
    )


def test_local_ray_gets_just_enough_cpus_for_the_largest_worker_group():
    cfg = composed("cluster.num_workers=2", "cluster.cpus_per_worker=1.5")
    assert local_num_cpus(cfg.cluster) == 4  # ceil(2 * 1.5) + 1
    cfg = composed("cluster.min_workers=1", "cluster.max_workers=3")
    assert local_num_cpus(cfg.cluster) == 4


def test_trainer_is_built_from_the_cluster_config():
    cfg = composed(
        "cluster.min_workers=1",
        "cluster.max_workers=3",
        "cluster.max_failures=5",
        "cluster.pg_timeout_s=42.5",
        "cluster.storage_path=/tmp/store",
        "cluster.run_name=r2",
        "train.keep_checkpoints=2",
    )
    trainer = build_trainer(cfg, {"job": job_to_dict(cfg)})
    assert trainer.scaling_config.num_workers == (1, 3)
    assert trainer.scaling_config.resources_per_worker == {"CPU": 1.0}
    assert not trainer.scaling_config.use_gpu
    assert (trainer.run_config.name, trainer.run_config.storage_path) == ("r2", "/tmp/store")
    assert trainer.run_config.failure_config.max_failures == 5
    assert trainer.run_config.checkpoint_config.num_to_keep == 2
    assert (trainer.backend_config.backend, trainer.backend_config.timeout_s) == ("gloo", 43)
    fixed = build_trainer(composed("cluster.num_workers=4", "train.global_batch_size=8"), {})
    assert fixed.scaling_config.num_workers == 4


def test_gpu_cluster_asks_one_gpu_per_worker_and_nccl():
    trainer = build_trainer(composed("cluster=ray"), {})
    assert trainer.scaling_config.resources_per_worker == {"CPU": 4.0, "GPU": 1}
    assert trainer.backend_config.backend == "nccl"
