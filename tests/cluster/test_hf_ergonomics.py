"""A Hugging Face checkpoint through the real CLIs as a user meets it: import-hf prints the train
command that resumes from the import, the command a user guesses instead is refused naming the
fields and the fix, `--cfg job` shows where model=hf's shape comes from (and --resolve the
shape), data.seq_len beyond max_position_embeddings names both, an export keeps bos 0, and
train-tokenizer makes the folder of --out. Every failure is before Ray starts."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from cluster.preflight import checked_config
from tests.cluster.conftest import REPO, run_cli
from tests.cluster.test_preflight import composed
from trainer.data import train_tokenizer

transformers = pytest.importorskip("transformers")

SRC_CONFIG = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=0,
)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A tiny Llama whose bos and eos are id 0, with a tokenizer.json of its vocabulary."""
    path = tmp_path_factory.mktemp("hf") / "src"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SRC_CONFIG)).save_pretrained(path)
    docs = [f"line {i} of the tokenizer's corpus, with words." for i in range(200)]
    (path / "tokenizer.json").write_text(train_tokenizer(docs, 300).to_str())
    return path


def module_cli(cwd: Path, module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture
def imported(launch_dir, src):
    """`python -m trainer.hf import SRC runs/ft/checkpoints` from the launch dir; its output."""
    done = module_cli(launch_dir, "trainer.hf", "import", str(src), "runs/ft/checkpoints")
    assert done.returncode == 0, done.stderr
    return done.stdout


def assert_one_error_before_ray(result) -> str:
    assert result.returncode == 2, result.output[-4000:]
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output[-4000:]
    assert "started a local Ray for this job" not in result.output
    return errors[0]


def test_import_hf_prints_the_command_that_resumes_from_the_import(
    launch_dir, src, imported, monkeypatch
):
    line = next(x.strip() for x in imported.splitlines() if "python -m cluster.train" in x)
    overrides = shlex.split(line)[3:]
    assert overrides == [
        "model=hf",
        f"model.hf_path={src}",
        "cluster.storage_path=runs",
        "cluster.run_name=ft",
        f"data.tokenizer={src}/tokenizer.json",
        "data.seq_len=64",  # the default data's 128 is beyond the model's context
    ]
    monkeypatch.chdir(launch_dir)  # where the user would run it
    cfg = checked_config(composed(overrides), str(launch_dir))  # the whole driver's check
    assert cfg.checkpoint_root == str(launch_dir / "runs" / "ft" / "checkpoints")
    assert (cfg.model.dim, cfg.model.vocab_size) == (32, 300)


def test_the_command_a_user_guesses_is_refused_naming_the_fields_and_the_fix(
    launch_dir, src, imported
):
    """The old closing line said 'train with the same cluster.run_name': that run is of the
    default model; one error names what differs and the overrides that work, not two dicts."""
    result = run_cli(
        launch_dir,
        "cluster.run_name=ft",
        f"data.tokenizer={src}/tokenizer.json",
        f"tracking.tracking_uri=sqlite:///{launch_dir}/mlflow.db",
    )
    line = assert_one_error_before_ray(result)
    assert "model.dim: 32 there, 256 here" in line and "model.vocab_size: 300 there" in line
    assert f"valid: model=hf model.hf_path={src}" in line
    assert "{'name'" not in line and "vocab_size=256 is smaller" not in line


def test_cfg_job_shows_the_shape_comes_from_config_json_and_resolve_shows_it(launch_dir, src):
    shown = run_cli(launch_dir, "model=hf", f"model.hf_path={src}", "--cfg", "job")
    assert shown.returncode == 0, shown.output
    assert "dim: ${hf_config:dim}" in shown.output and "dim: 256" not in shown.output
    resolved = run_cli(launch_dir, "model=hf", f"model.hf_path={src}", "--cfg", "job", "--resolve")
    assert resolved.returncode == 0, resolved.output
    for text in ("vocab_size: 300", "dim: 32", "max_seq_len: 64", "norm_eps: 1.0e-06"):
        assert f"  {text}\n" in resolved.output, resolved.output[:2000]


def test_seq_len_beyond_max_position_embeddings_names_both(launch_dir, src):
    result = run_cli(
        launch_dir,
        "model=hf",
        f"model.hf_path={src}",
        "data.seq_len=65",
        f"tracking.tracking_uri=sqlite:///{launch_dir}/mlflow.db",
    )
    line = assert_one_error_before_ray(result)
    assert "data.seq_len=65" in line and f"max_position_embeddings=64 in {src}/config.json" in line
    assert "valid: data.seq_len <= 64" in line


def test_an_export_of_a_model_whose_bos_is_0_keeps_0_and_sets_no_max_length(launch_dir, imported):
    step = launch_dir / "runs" / "ft" / "checkpoints" / "step_000000000"
    out = launch_dir / "hf_out"
    done = module_cli(launch_dir, "trainer.hf", "export", str(step), str(out))
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 0)
    assert generation == {"bos_token_id": 0, "eos_token_id": 0}  # no max_length
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = transformers.GenerationConfig.from_pretrained(out)
        loaded.validate()
    assert loaded.bos_token_id == 0


def test_train_tokenizer_creates_the_folder_of_out_or_names_it(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some words to train a tokenizer on, and more words. " * 20)
    out = tmp_path / "new" / "folder" / "tokenizer.json"
    args = ["train-tokenizer", f"data.source={corpus}", "--vocab-size", "280"]
    done = module_cli(tmp_path, "trainer.data", *args, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["model"]["type"] == "BPE"
    (tmp_path / "a_file").write_text("not a folder\n")
    bad = tmp_path / "a_file" / "tokenizer.json"
    done = module_cli(tmp_path, "trainer.data", *args, "--out", str(bad))
    assert done.returncode == 2
    assert f"cannot create its folder {tmp_path / 'a_file'}" in done.stderr
    assert ".tmp-" not in done.stderr
