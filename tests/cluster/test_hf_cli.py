"""model=hf through the real CLI: a Hugging Face checkpoint the model cannot represent, or whose
tensors do not fit its config, stops before anything starts, naming the field or the tensor."""

from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import run_cli
from tests.cluster.test_config_errors import assert_failed_before_start

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_model_hf_without_a_path_names_the_key(launch_dir):
    result = run_cli(launch_dir, "model=hf")
    assert_failed_before_start(result, launch_dir, "model.hf_path=''", "Hugging Face")


def test_an_unsupported_config_field_is_named_before_anything_starts(launch_dir, hf_dir, tmp_path):
    bad = tmp_path / "gelu"
    bad.mkdir()
    for f in hf_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    result = run_cli(launch_dir, "model=hf", f"model.hf_path={bad}")
    assert_failed_before_start(result, launch_dir, "hidden_act='gelu'", "valid: silu")


def test_tensors_that_do_not_fit_the_config_are_named_before_anything_starts(
    launch_dir, hf_dir, tmp_path
):
    bad = tmp_path / "shape"
    bad.mkdir()
    for f in hf_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    result = run_cli(launch_dir, "model=hf", f"model.hf_path={bad}", "data.seq_len=32")
    assert_failed_before_start(
        result, launch_dir, "down_proj.weight' has shape [32, 64]", "the config says [32, 48]"
    )
