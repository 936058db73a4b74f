"""trainer/data/groups.py: `python -m trainer.data prepare data=chat ...` composes conf/data/ as
training does (DataConfig's defaults, the option's YAML, the data.* arguments), so the data a user
prepares on the command line is the preparation `python -m cluster.train` with the same
arguments finds: the same digest, nothing prepared again."""

from __future__ import annotations

import json

import pytest

from cluster.preflight import checked_config, preflight
from tests.data.chat_templates import CONVERSATIONS, write_tokenizer
from tests.data.hydra_jobs import CONF, hydra_composed, training_job
from trainer.config import ConfigError
from trainer.data import groups
from trainer.data.__main__ import main as data_main


@pytest.mark.parametrize("option", groups.option_names())
def test_every_data_option_composes_as_training_composes_it(option):
    args = [f"data={option}", "data.seq_len=64", "data.eval_sequences=8"]
    # a run that never evaluates (training_job's) reads data=chat's null eval_fraction as 0
    assert groups.compose(args).for_run(evaluating=False) == training_job(*args).data


def test_the_options_are_the_files_of_conf_data():
    assert groups.option_names() == sorted(p.stem for p in (CONF / "data").glob("*.yaml"))
    assert {"chat", "jsonl", "parquet", "stdlib", "text"} <= set(groups.option_names())


def test_data_kind_chat_without_an_option_takes_data_chats_defaults():
    assert groups.compose(["data.kind=chat"]) == groups.compose(["data=chat"])
    assert groups.compose(["data.source=x"]).seq_len == 128  # no option: DataConfig's defaults


@pytest.mark.parametrize(
    "args,words",
    [
        (["data=chatt"], ["data=chatt", "valid: data=<one of chat, jsonl"]),
        (["data=chat", "data=jsonl"], ["data=jsonl", "data=chat is given too"]),
        (["data.seq_lne=64"], ["did you mean data.seq_len?", "data=<option>"]),
        (["data.seq_len=long"], ["data.seq_len='long'", "valid: an integer"]),
    ],
)
def test_a_bad_option_or_key_is_refused_naming_what_is_valid(args, words):
    with pytest.raises(ConfigError) as e:
        groups.compose(args)
    for word in words:
        assert word in str(e.value)


def test_an_options_file_with_a_key_dataconfig_lacks_is_refused(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("source: x\nsequence_length: 64\n")
    monkeypatch.setattr(groups, "CONF_DATA", tmp_path)
    with pytest.raises(ConfigError, match=r"mine\.yaml sets 'sequence_length'.*valid: source"):
        groups.compose(["data=mine"])


@pytest.fixture
def chat_job(tmp_path) -> list[str]:
    """The data.* arguments of a small chat job (JSONL records, a Qwen2.5-style tokenizer)."""
    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 40))
    tokenizer = write_tokenizer(tmp_path / "tok", "qwen2.5")
    return [
        "data=chat",
        f"data.source={records}",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=128",
        f"data.prepared_dir={tmp_path / 'prepared'}",
    ]


def test_data_chat_prepared_on_the_cli_is_the_preparation_training_finds(
    chat_job, tmp_path, capsys
):
    assert data_main(["prepare", *chat_job]) == 0
    printed = capsys.readouterr().out
    assert "(prepared now)" in printed
    uri = printed.split(" in ", 1)[1].split(" (")[0]
    dictcfg = hydra_composed(
        *chat_job, "model.vocab_size=512", f"cluster.storage_path={tmp_path / 'runs'}"
    )
    cfg = checked_config(dictcfg, str(tmp_path), resume=False)
    lines: list[str] = []
    plan = preflight(cfg, log=lines.append)
    assert str(plan.root) == uri
    assert not [line for line in lines if line.startswith("prepare:")], lines  # found, not redone
