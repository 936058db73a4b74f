"""An export keeps what serving needs: the chat template the run trained with in
tokenizer_config.json, every end-of-turn id in generation_config.json (a served fine-tune that
does not stop is the best-known complaint of this field) and config.json, a bos id that is not
null, no max_length; transformers' AutoTokenizer renders the template and GenerationConfig reads
the ids. Checkpoints that know less (imported ones, old ones, byte-level runs) export what they
know, falling back on the imported model's own ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.hf.tiny import VOCAB, save
from trainer.checkpoint import CheckpointReader, CheckpointWriter, TensorChunk
from trainer.hf import export_hf, import_hf

transformers = pytest.importorskip("transformers")
QUIET = dict(log=lambda *_: None)

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
SPECIAL += ["<|eot_id|>"]
WORDS = "system user assistant you are kind hi there what is two plus two four".split()
BOS, EOS, EOT = 0, 1, 4

# A Llama 3 style template, written here (nothing is downloaded).
TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|> ' + m['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|> ' }}"
    "{%- endif %}"
)
MESSAGES = [
    {"role": "system", "content": "you are kind"},
    {"role": "user", "content": "what is two plus two"},
]
ORIGINAL_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "model_max_length": 4096,
    "clean_up_tokenization_spaces": False,
    "model_input_names": ["input_ids", "attention_mask"],
}


def write_tokenizer(path: Path) -> Path:
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS + ["[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(path))
    return path


def chat_tokenizer_info(tokenizer_json: Path) -> dict:
    """The "tokenizer" dict of a chat run's trainer state (the data contract's keys)."""
    return {
        "name": str(tokenizer_json),
        "digest": "test",
        "vocab_size": VOCAB,
        "eod_id": EOS,
        "eod_token": "<|end_of_text|>",
        "chat_template": TEMPLATE,
        "tokenizer_config": ORIGINAL_CONFIG,
        "bos_token": "<|begin_of_text|>",
        "bos_id": BOS,
        "eos_token": "<|end_of_text|>",
        "eot_token": "<|eot_id|>",
        "stop_ids": [EOT, EOS],
    }


def with_state(path: str, root: Path, drop: tuple = (), **changes) -> str:
    """A copy of the checkpoint at `path` whose trainer state has `changes` and lacks the keys
    in `drop`: what a run that trained with that state would have saved."""
    reader = CheckpointReader(path)
    state = {k: v for k, v in {**reader.state, **changes}.items() if k not in drop}
    chunks = []
    for key in reader.keys():
        t = reader.read_full(key)
        chunks.append(TensorChunk(key, tuple(t.shape), t.dtype, 0, t.reshape(-1)))
    with CheckpointWriter(str(root), keep=10, async_save=False) as writer:
        writer.save(0, 0, 1, chunks, state, barrier=lambda: None)
        return writer.wait()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (bos 1, eos 2 in its config.json) imported: its step-0 checkpoint."""
    src = save("llama3_rope", tmp_path_factory.mktemp("src"))
    return src, import_hf(str(src), str(tmp_path_factory.mktemp("imported")), **QUIET)


def read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def test_a_chat_runs_export_carries_its_template_and_every_end_of_turn_id(llama, tmp_path):
    tok = chat_tokenizer_info(write_tokenizer(tmp_path / "tokenizer.json"))
    path = with_state(llama[1], tmp_path / "ckpt", tokenizer=tok)
    out = tmp_path / "out"
    export_hf(path, str(out), torch.float32, **QUIET)

    config = read(out, "tokenizer_config.json")
    assert config["chat_template"] == TEMPLATE
    assert (config["bos_token"], config["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert config["model_max_length"] == 4096 and "model_input_names" in config  # the original's
    generation = read(out, "generation_config.json")
    assert generation == {"bos_token_id": BOS, "eos_token_id": [EOT, EOS]}  # no max_length
    model_config = read(out, "config.json")
    assert (model_config["eos_token_id"], model_config["bos_token_id"]) == ([EOT, EOS], BOS)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|> you are kind<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|> what is two plus two<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|> "
    )
    ids = hf_tok.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ids[0] == BOS and ids.count(EOT) == 2
    assert hf_tok.bos_token_id == BOS and hf_tok.eos_token_id == EOS
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [EOT, EOS]
    assert transformers.GenerationConfig.from_pretrained(out).bos_token_id == BOS

    # and the model loads beside them, stopping at the end of turn in generate
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.generation_config.eos_token_id == [EOT, EOS]


def test_a_template_without_a_known_tokenizer_config_gets_a_minimal_one(llama, tmp_path):
    tok = chat_tokenizer_info(write_tokenizer(tmp_path / "tokenizer.json"))
    tok.update(tokenizer_config=None, stop_ids=[EOT])
    path = with_state(llama[1], tmp_path / "ckpt", tokenizer=tok)
    out = tmp_path / "out"
    export_hf(path, str(out), **QUIET)
    config = read(out, "tokenizer_config.json")
    assert config["chat_template"] == TEMPLATE and config["tokenizer_class"]
    assert read(out, "generation_config.json")["eos_token_id"] == EOT  # one id: an int
    assert (
        transformers.AutoTokenizer.from_pretrained(out)
        .apply_chat_template(MESSAGES, tokenize=False)
        .startswith("<|begin_of_text|><|start_header_id|>system")
    )


def test_an_imported_checkpoint_exports_the_sources_ids(llama, tmp_path):
    src, path = llama
    (src / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7]})
    )
    try:
        imported = import_hf(str(src), str(tmp_path / "imported"), **QUIET)
    finally:
        (src / "generation_config.json").unlink()
    assert CheckpointReader(imported).state["hf_special_ids"] == {
        "bos_token_id": 1,
        "eos_token_id": [2, 7],
    }
    out = tmp_path / "out"
    export_hf(imported, str(out), **QUIET)
    assert read(out, "generation_config.json") == {"bos_token_id": 1, "eos_token_id": [2, 7]}
    assert (read(out, "config.json")["bos_token_id"], read(out, "config.json")["eos_token_id"]) == (
        1,
        [2, 7],
    )
    assert not (out / "tokenizer_config.json").exists()  # no tokenizer known: none written


def test_an_imported_checkpoint_exports_its_source_folders_tokenizer_and_template(tmp_path):
    """A step-0 import (its state names no tokenizer) exported straight back, e.g. to check the
    conversion: the source's tokenizer files come along as they were, and transformers renders
    the same chat template from the export as from the source."""
    src = save("llama3_rope", tmp_path / "src")
    write_tokenizer(src / "tokenizer.json")
    config = {**ORIGINAL_CONFIG, "chat_template": TEMPLATE}
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    imported = import_hf(str(src), str(tmp_path / "imported"), **QUIET)
    assert not CheckpointReader(imported).state.get("tokenizer")
    out = tmp_path / "out"
    said = []
    result = export_hf(imported, str(out), log=said.append)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(result["files"]), said
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    want = transformers.AutoTokenizer.from_pretrained(src)
    got = transformers.AutoTokenizer.from_pretrained(out)
    for prompt in (False, True):
        kw = dict(tokenize=False, add_generation_prompt=prompt)
        assert got.apply_chat_template(MESSAGES, **kw) == want.apply_chat_template(MESSAGES, **kw)


def test_a_run_from_model_hf_falls_back_on_the_sources_config_when_its_state_has_no_ids(
    llama, tmp_path
):
    """A checkpoint trained from model=hf keeps model_config.hf_path: a tokenizer without bos
    (Qwen's tokenizer_config has bos_token null) still exports the model's bos id."""
    tok = chat_tokenizer_info(write_tokenizer(tmp_path / "tokenizer.json"))
    tok.update(bos_token=None, bos_id=None)
    path = with_state(llama[1], tmp_path / "ckpt", tokenizer=tok, drop=("hf_special_ids",))
    assert "hf_special_ids" not in CheckpointReader(path).state
    out = tmp_path / "out"
    export_hf(path, str(out), **QUIET)
    assert read(out, "generation_config.json") == {"bos_token_id": 1, "eos_token_id": [EOT, EOS]}


def test_an_old_checkpoint_or_a_byte_run_exports_what_it_knows(llama, tmp_path):
    old = {"name": "byte", "vocab_size": 256, "eod_id": 3, "eod_token": None}
    path = with_state(llama[1], tmp_path / "ckpt", tokenizer=old, drop=("hf_special_ids",))
    out = tmp_path / "out"
    export_hf(path, str(out), **QUIET)
    assert read(out, "generation_config.json") == {"bos_token_id": 1, "eos_token_id": 3}
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
    }
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 3
