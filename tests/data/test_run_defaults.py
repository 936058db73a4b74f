"""trainer/data/run_defaults.py: what data.* leaves to the rest of the job. data=chat holds
conversations out only for a run that evaluates (and the holdout names the preparation:
DESIGN.md invariant 2); with model=hf an unset or 'byte' data.tokenizer is the model folder's
own tokenizer.json, said in one line, and where the folder has none the error names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.data.chat_templates import CONVERSATIONS, save_with_transformers, write_tokenizer
from tests.data.hydra_jobs import training_job
from tests.hf.tiny import hf_model
from trainer.config import ConfigError, DataConfig, ModelConfig, TrainConfig, TrainerConfig
from trainer.data import PreparedData, plan_preparation, prepare, with_run_defaults


def job(data: DataConfig, eval_every: int = 0, hf_path=None) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(name="hf" if hf_path else "tiny", hf_path=hf_path and str(hf_path)),
        data=data,
        train=TrainConfig(eval_every=eval_every),
    )


def quiet(cfg: TrainerConfig) -> TrainerConfig:
    return with_run_defaults(cfg, log=lambda *_: None)


def test_a_null_eval_fraction_holds_out_only_for_a_run_that_evaluates():
    auto = DataConfig(eval_fraction=None)
    assert quiet(job(auto, eval_every=0)).data.eval_fraction == 0.0
    assert quiet(job(auto, eval_every=50)).data.eval_fraction == 0.01
    for given in (0.0, 0.05):  # a number is the user's: kept either way
        for every in (0, 50):
            cfg = job(DataConfig(eval_fraction=given), eval_every=every)
            assert quiet(cfg).data.eval_fraction == given


def test_conf_data_chat_holds_out_nothing_by_default_and_one_percent_when_evaluating():
    chat = ["data=chat", "data.source=/sft.jsonl", "data.tokenizer=/tok.json"]
    assert quiet(training_job(*chat)).data.eval_fraction == 0.0
    evaluating = training_job(*chat, "train.eval_every=100")
    assert quiet(evaluating).data.eval_fraction == 0.01


@pytest.fixture
def chat_data(tmp_path) -> DataConfig:
    records = tmp_path / "sft.jsonl"
    numbered = [  # each its own conversation: the holdout is chosen by a hash of its content
        [{"role": "user", "content": f"Question {i}?"}, *c[-1:]]
        for i, c in enumerate(CONVERSATIONS * 200)
    ]
    records.write_text("".join(json.dumps({"messages": c}) + "\n" for c in numbered))
    return DataConfig(
        source=str(records),
        tokenizer=str(write_tokenizer(tmp_path / "tok", "qwen2.5")),
        kind="chat",
        seq_len=128,
        eval_fraction=None,
        prepared_dir=str(tmp_path / "prepared"),
    )


def test_the_holdout_is_part_of_what_names_the_preparation(chat_data):
    off = quiet(job(chat_data, eval_every=0)).data
    on = quiet(job(chat_data, eval_every=10)).data
    assert plan_preparation(chat_data).digest == plan_preparation(off).digest  # null: none
    assert plan_preparation(off).digest != plan_preparation(on).digest
    trained_on_all = PreparedData.open(prepare(off, log=lambda *_: None).uri).manifest
    assert trained_on_all.settings["eval_fraction"] == 0.0
    assert not trained_on_all.sources[0].splits["eval"].shards
    evaluated = PreparedData.open(prepare(on, log=lambda *_: None).uri).manifest
    assert evaluated.settings["eval_fraction"] == 0.01
    assert evaluated.sources[0].splits["eval"].documents > 0


@pytest.fixture
def model_folder(tmp_path) -> Path:
    """A folder as a published model has it: config.json, weights, tokenizer.json (saved by
    transformers, with its chat template in chat_template.jinja)."""
    folder = tmp_path / "Tiny-Instruct"
    hf_model("qwen2_untied", vocab_size=448, max_position_embeddings=256).save_pretrained(folder)
    save_with_transformers(folder, "qwen2.5")
    return folder


@pytest.mark.parametrize("given", ["", "byte"])
def test_model_hf_without_data_tokenizer_takes_the_models_own_and_says_so(tmp_path, given):
    (tmp_path / "tokenizer.json").write_text("{}")
    lines: list[str] = []
    cfg = with_run_defaults(job(DataConfig(tokenizer=given), hf_path=tmp_path), lines.append)
    assert cfg.data.tokenizer == str(tmp_path / "tokenizer.json")
    assert lines == [
        f"data: data.tokenizer={tmp_path}/tokenizer.json (model.hf_path's own tokenizer; "
        "data.tokenizer=<a tokenizer.json> takes another)"
    ]


def test_a_tokenizer_given_is_kept_and_a_model_without_hf_path_changes_nothing(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    mine = DataConfig(tokenizer="/tokenizers/mine.json")
    assert quiet(job(mine, hf_path=tmp_path)).data == mine
    assert quiet(job(DataConfig(tokenizer="byte"))).data.tokenizer == "byte"


def test_a_model_folder_without_a_tokenizer_names_where_data_tokenizer_would_be(tmp_path):
    with pytest.raises(ConfigError) as e:
        quiet(job(DataConfig(tokenizer=""), hf_path=tmp_path))
    assert f"valid: data.tokenizer={tmp_path}/tokenizer.json" in str(e.value)
    assert "'byte'" not in str(e.value)
    byte = job(DataConfig(tokenizer="byte"), hf_path=tmp_path)  # byte data, as asked
    assert quiet(byte).data.tokenizer == "byte"


def test_a_chat_job_on_a_saved_model_needs_neither_tokenizer_nor_template(model_folder, tmp_path):
    """model=hf data=chat with only data.source: the folder's tokenizer.json and its
    chat_template.jinja (transformers 5's layout) make a valid job with a preparation plan."""
    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 4))
    composed = training_job(
        "model=hf", f"model.hf_path={model_folder}", "data=chat", f"data.source={records}",
        "data.seq_len=128",
    )  # fmt: skip
    cfg = quiet(composed).validate()
    assert cfg.data.tokenizer == str(model_folder / "tokenizer.json")
    plan = plan_preparation(cfg.data)
    assert plan.template.origin == str(model_folder / "chat_template.jinja")
