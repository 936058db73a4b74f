"""trainer.generate against transformers: a tiny random Llama built here (nothing downloaded),
saved as a Hugging Face folder and imported as one of our checkpoints. Our greedy ids equal
transformers' generate from both (library call and CLI), stop where its eos stops it, the KV
cache equals recomputing, sampling is seeded, and the sharded engine at world size 2 (two rank
threads of torch's threaded process group, tests/gpu/threaded_ranks.py: milliseconds to start,
where gloo processes cost seconds) generates the same ids on both ranks as one process does."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.gpu.threaded_ranks import run_threaded
from trainer.checkpoint import CheckpointReader, CheckpointWriter, TensorChunk
from trainer.checkpoint.keys import param_key
from trainer.config import ConfigError, ShardingConfig, model_config
from trainer.fsdp import build_mesh, parallelize
from trainer.generate import batch_prompts, eval_prompt, eval_prompts, generate_ids, sample_text
from trainer.generate.__main__ import main as generate_main
from trainer.generate.weights import open_source
from trainer.hf import HFWeights, config_from_hf, import_hf, read_hf_config
from trainer.model import build_model, initializer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128
NEW = 16
PROMPT = [5, 17, 42, 99, 3, 64]
WORDS = [f"w{i}" for i in range(VOCAB - 4)]
SPECIALS = ["<s>", "</s>", "<|start|>", "<|end|>"]  # ids 124..127
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }} {{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def hf_llama(eos: int) -> "transformers.LlamaForCausalLM":
    """Large init (std 0.5): the greedy path varies token to token instead of repeating one."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=VOCAB - 4,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer (w0..w123, then the specials) and a tokenizer_config with a chat
    template, as a Hugging Face folder holds them."""
    vocab = {w: i for i, w in enumerate(WORDS + SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|end|>",
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A model whose eos (id 0) it never emits in 16 greedy tokens from PROMPT."""
    path = tmp_path_factory.mktemp("hf")
    hf_llama(eos=0).save_pretrained(path)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference(hf_dir) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return hf_generate(model, PROMPT)


def hf_generate(model, prompt: list[int], **kw) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, pad_token_id=0, **kw
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def checkpoint(hf_dir, tmp_path_factory) -> str:
    return import_hf(str(hf_dir), str(tmp_path_factory.mktemp("ckpt")), log=lambda *_: None)


def cli(*args) -> dict:
    """The command in a fresh interpreter, as a user runs it; its --json line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "trainer.generate", *map(str, args), "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def command(capsys, *args, as_json: bool = True):
    """The command's main() in this process (seconds cheaper than a fresh interpreter)."""
    capsys.readouterr()
    rc = generate_main([*map(str, args), *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out) if as_json else out


def load(path) -> tuple:
    source = open_source(str(path), log=lambda *_: None)
    return source, source.load("cpu", torch.float32)


def test_the_reference_greedy_path_is_not_trivial(reference):
    assert len(reference) == NEW and len(set(reference)) >= 6, reference


def test_greedy_ids_from_an_hf_folder_equal_transformers_generate(hf_dir, reference):
    source, model = load(hf_dir)
    assert generate_ids(model, PROMPT, NEW, source.text.stop_ids) == reference
    assert (
        cli(hf_dir, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", NEW)["ids"]
        == reference
    )


def test_greedy_ids_from_our_imported_checkpoint_equal_transformers_generate(
    checkpoint, reference, capsys
):
    source, model = load(checkpoint)
    assert source.kind == "checkpoint"
    assert generate_ids(model, PROMPT, NEW, source.text.stop_ids) == reference
    ids = ",".join(map(str, PROMPT))
    out = command(capsys, checkpoint, "--prompt-ids", ids, "--max-new-tokens", NEW)
    assert out["ids"] == reference
    # The import names no tokenizer: the folder it was imported from supplies it.
    words = " ".join((WORDS + SPECIALS)[i] for i in reference)
    assert out["text"] == words
    assert command(capsys, checkpoint, "--prompt-ids", ids, "--max-new-tokens", NEW,
                   as_json=False) == words + "\n"  # fmt: skip


def test_generation_stops_where_transformers_stops_on_its_eos(tmp_path, reference):
    k = 5
    eos = reference[k]
    assert eos not in reference[:k]
    hf_llama(eos=eos).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    theirs = hf_generate(model, PROMPT)
    assert theirs == reference[: k + 1]
    source, ours = load(tmp_path)
    assert eos in source.text.stop_ids
    assert generate_ids(ours, PROMPT, NEW, source.text.stop_ids) == theirs


def test_any_stop_id_stops(hf_dir, reference):
    _, model = load(hf_dir)
    assert generate_ids(model, PROMPT, NEW, [999, reference[3], reference[7]]) == reference[:4]


def test_the_kv_cache_path_equals_recomputing_the_whole_sequence(hf_dir, reference):
    _, model = load(hf_dir)
    cached = generate_ids(model, PROMPT, NEW, [])
    recomputed = generate_ids(model, PROMPT, NEW, [], use_cache=False)
    assert cached == recomputed == reference


def test_sampling_with_a_seed_is_reproducible_and_tiny_top_p_is_greedy(hf_dir, reference):
    _, model = load(hf_dir)

    def sampled(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return generate_ids(model, PROMPT, NEW, [], temperature=1.0, generator=g, **kw)

    assert sampled(1) == sampled(1)
    assert sampled(1) != sampled(2) or sampled(1) != sampled(3)
    assert sampled(1) != reference  # temperature 1 on a random model is far from greedy
    assert sampled(1, top_p=1e-6) == reference


def test_text_prompts_and_chat_prompts_are_encoded_as_transformers_does(hf_dir, capsys):
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w1 w2 w3"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat  # transformers 5: a BatchEncoding
    out = command(
        capsys, hf_dir, "--chat", "w1 w2 w3", "--system", "w7 w8", "--max-new-tokens", NEW
    )
    theirs = hf_generate(model, list(chat))
    assert out["ids"] == theirs
    text = command(capsys, hf_dir, "--prompt", "w5 w17 w42", "--max-new-tokens", NEW)
    assert text["ids"] == hf_generate(model, [5, 17, 42])
    assert text["text"] == tok.decode(text["ids"])


def test_chat_without_a_template_names_where_it_looked(tmp_path, capsys):
    hf_llama(eos=0).save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert generate_main([str(tmp_path), "--chat", "w1"]) == 2
    err = capsys.readouterr().err
    assert "--chat needs a chat template" in err and "tokenizer_config.json" in err


@pytest.mark.parametrize(
    "args, match",
    [
        (["--prompt-ids", "1,x"], "--prompt-ids"),
        (["--prompt-ids", "1,500"], r"\[0, 128\)"),
        (["--prompt-ids", ",".join(["1"] * 64)], "max_seq_len=64"),
        (["--prompt-ids", "1", "--top-p", "0"], "--top-p"),
        (["--prompt-ids", "1", "--system", "s"], "only with --chat"),
    ],
)
def test_bad_arguments_are_one_line_errors(hf_dir, capsys, args, match):
    assert generate_main([str(hf_dir), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert re.search(match, err), err


def test_a_path_that_is_neither_is_refused_with_what_would_be_valid(tmp_path, capsys):
    assert generate_main([str(tmp_path), "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert "neither a checkpoint" in err and "config.json" in err
    with pytest.raises(ConfigError, match="neither a checkpoint"):
        open_source(str(tmp_path / "missing"))


def test_a_folder_of_checkpoints_means_its_newest(checkpoint, reference):
    source, model = load(Path(checkpoint).parent)
    assert source.path == checkpoint
    assert generate_ids(model, PROMPT, NEW, source.text.stop_ids) == reference


# ----------------------------------------------------------------------------- eval samples

SEED = 7


def tiny():
    return model_config("tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                        vocab_size=VOCAB, max_seq_len=64, init_std=0.5)  # fmt: skip


def _engine_ids(rank: int, world: int, prompts: list[list[int]]):
    sharding = ShardingConfig()
    fsdp = parallelize(
        build_model(tiny()),
        sharding,
        build_mesh(sharding, rank, world, world),
        "cpu",
        init_fn=initializer(SEED),
    )
    ids = [generate_ids(fsdp, p, NEW, [], world=world) for p in prompts]
    # Each rank's generator differs: only rank 0's draws count (broadcast), so all agree.
    g = torch.Generator().manual_seed(rank)
    sampled = generate_ids(fsdp, PROMPT, NEW, [], world=world, temperature=1.0, generator=g)
    text = sample_text(fsdp, BYTES, prompts, NEW, world=world, step=3)
    return ids, sampled, text


BYTES = {"name": "byte", "eod_id": 0}


def test_the_sharded_engine_generates_the_single_process_ids_on_both_ranks():
    prompts = [PROMPT, [9, 8]]
    single = build_model(tiny(), "cpu", seed=SEED)
    expected = [generate_ids(single, p, NEW, []) for p in prompts]
    assert len(set(expected[0])) >= 6, expected
    g = torch.Generator().manual_seed(0)
    sampled = generate_ids(single, PROMPT, NEW, [], temperature=1.0, generator=g)
    assert sampled != expected[0]
    (ids0, sampled0, text0), (ids1, sampled1, text1) = run_threaded(_engine_ids, 2, prompts)
    assert ids0 == ids1 == expected
    assert sampled0 == sampled1 == sampled
    assert text0 == text1 == sample_text(single, BYTES, prompts, NEW, step=3)


def test_sample_text_shows_each_prompt_and_its_generation(hf_dir, reference):
    source, model = load(hf_dir)
    text = sample_text(model, source.text, [PROMPT], NEW, step=10, stop_ids=[reference[2]])
    words = WORDS + SPECIALS
    assert text.startswith("# step 10: 1 prompts")
    assert " ".join(words[i] for i in PROMPT) in text
    assert (
        "### generated (3 tokens, ended its turn)\n" + " ".join(words[i] for i in reference[:2])
        in text
    )


def test_an_eval_prompt_is_the_first_conversation_up_to_its_first_loss_token():
    tokens = torch.arange(10, 20)
    mask = torch.tensor([0, 0, 0, 1, 1, 0, 0, 1, 1, 0], dtype=torch.uint8)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4], dtype=torch.int16)
    assert eval_prompt(tokens, mask, positions) == [10, 11, 12]
    # A first document without a loss token, or no mask: its first max_prompt tokens.
    assert eval_prompt(tokens, torch.zeros(10), positions, max_prompt=3) == [10, 11, 12]
    assert eval_prompt(tokens, None, positions) == [10, 11, 12, 13, 14]
    assert eval_prompt(tokens, None, None, max_prompt=4) == [10, 11, 12, 13]


def test_eval_prompts_are_the_same_windows_on_every_rank_read_from_micro_batches():
    """A MicroBatch as the loader makes it (ids stored as int16, read as unsigned): rows' first
    conversation prompts; eval_prompts asks for the first windows as a world of one."""
    from trainer.data.loader import MicroBatch

    stored = torch.tensor([[40000, 2, 3, 4], [7, 8, 9, 10]], dtype=torch.int32).to(torch.int16)
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.uint8)
    positions = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 0]], dtype=torch.int16)
    mb = MicroBatch(stored, 1.0, torch.arange(2).numpy(), torch.zeros(2).numpy(), mask, positions)
    asked = []

    class Batches:
        def fixed_micro_batches(self, count, rank, world, rows):
            asked.append((count, rank, world, rows))
            return [mb]

    assert eval_prompts(Batches(), 2) == [[40000, 2], [7]] == batch_prompts(mb, 5)
    assert asked == [(2, 0, 1, 2)] and eval_prompts(Batches(), 0) == []


def _run_checkpoint(hf_dir: Path, imported: str, root: Path, tokenizer, **extra) -> str:
    """A checkpoint as a run writes it: the model's tensors and a state naming the run's
    tokenizer dict (PreparedData.tokenizer_info()), not an HF folder to fall back on; `extra`
    state keys replace the imported ones."""
    cfg = config_from_hf(read_hf_config(str(hf_dir)))
    weights = HFWeights(str(hf_dir), cfg)
    with CheckpointReader(imported) as reader:
        state = {
            **reader.state,
            "tokenizer": tokenizer,
            "imported_from": None,
            "global_batch_size": 4,
            **extra,
        }
    chunks = [
        TensorChunk(param_key(f), s, torch.float32, 0, weights.read(f, 0, math.prod(s)))
        for f, s in weights.expected.items()
    ]
    with CheckpointWriter(str(root), keep=10, async_save=False) as writer:
        writer.save(0, 0, 1, chunks, state, barrier=lambda: None)
        return writer.wait()


def test_a_run_checkpoint_generates_with_its_tokenizer_template_and_stop_ids(
    hf_dir, checkpoint, tmp_path, capsys
):
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "w1 w2 w3"}]
    chat = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    full = hf_generate(model, chat)
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    info = {
        "name": str(hf_dir / "tokenizer.json"),
        "eod_id": 125,
        "eod_token": "</s>",
        "chat_template": TEMPLATE,
        "tokenizer_config": config,
        "bos_token": "<s>",
        "eos_token": "<|end|>",
        "stop_ids": [127, full[4]],  # the eot first, then another id that ends a turn
    }
    path = _run_checkpoint(hf_dir, checkpoint, tmp_path / "ckpt", info)
    out = command(capsys, path, "--chat", "w1 w2 w3", "--max-new-tokens", NEW)
    stop = next(i for i, t in enumerate(full) if t in info["stop_ids"])
    assert out["ids"] == full[: stop + 1]
    assert out["text"] == hf_tok.decode(full[:stop])
    no_template = {k: v for k, v in info.items() if k not in ("chat_template", "tokenizer_config")}
    path = _run_checkpoint(hf_dir, checkpoint, tmp_path / "bare", no_template)
    assert generate_main([path, "--chat", "w1"]) == 2
    err = capsys.readouterr().err
    assert "--chat needs a chat template" in err and f"the tokenizer of {path}" in err


def test_without_a_readable_tokenizer_ids_still_work_and_tokenizer_overrides(
    hf_dir, checkpoint, reference, tmp_path, capsys
):
    """An imported checkpoint whose source folder is gone: its recorded eos ids still stop it,
    --prompt-ids prints ids, --prompt asks for --tokenizer, which then supplies the text."""
    special = {"eos_token_id": [reference[6]]}
    path = _run_checkpoint(
        hf_dir, checkpoint, tmp_path, None, imported_from="/gone", hf_special_ids=special
    )
    ids = ",".join(map(str, PROMPT))
    out = command(capsys, path, "--prompt-ids", ids, as_json=False)
    assert out == " ".join(map(str, reference[:7])) + "\n"
    assert generate_main([path, "--prompt", "w5"]) == 2
    assert "--tokenizer PATH" in capsys.readouterr().err
    out = command(capsys, path, "--prompt", "w5 w17", "--tokenizer", hf_dir)
    _, model = load(hf_dir)
    assert out["ids"] == generate_ids(model, [5, 17], 64, [reference[6]])
