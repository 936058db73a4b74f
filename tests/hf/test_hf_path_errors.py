"""model.hf_path that is not a checkpoint: a path that does not exist says so (a typo), a
folder without config.json says that (another kind of folder); both name the path."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, ModelConfig
from trainer.hf import resolve_model


def test_a_missing_hf_path_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "Qwen2.5-0.5B-Instruc"
    with pytest.raises(ConfigError) as e:
        resolve_model(ModelConfig(name="hf", hf_path=str(missing)))
    assert f"model.hf_path='{missing}' does not exist" in str(e.value)


def test_a_folder_without_config_json_says_it_has_none(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        resolve_model(ModelConfig(name="hf", hf_path=str(tmp_path)))
    assert f"model.hf_path='{tmp_path}' has no config.json; valid:" in str(e.value)
    assert "does not exist" not in str(e.value)
