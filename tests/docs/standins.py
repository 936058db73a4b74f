"""Tiny stand-ins for the paths the docs' commands name, built in a sandbox when a command first
names one (and only if the docs' own earlier commands did not make it):

    models/Qwen2.5-0.5B-Instruct, models/Qwen2.5-7B-Instruct   (the docs' /models/...)
        a tiny Qwen2 and a Qwen2.5 chat tokenizer, both saved by transformers itself
    models/Qwen2-VL-2B-Instruct   a tiny random Qwen2-VL folder with its tokenizer, template and
                              preprocessor_config.json (tests/cluster/vision_task.py)
    sft.jsonl                 chat records ({"messages": [...]}) for data=chat
    docs/                     "your documents": a few small JSONL files
    path/to/texts/            (the docs' /path/to/texts) a few small text files
    corpus/*.parquet, tok.json   Parquet documents and a BPE tokenizer trained on them
    runs/elastic-fsdp/checkpoints   a run's checkpoints: a step-0 checkpoint of the tiny Qwen2,
                              written by `trainer.hf import` (the format of every checkpoint, in
                              2 s; a smoke-sized training run takes 15 s)

The docs' absolute paths land under the sandbox (rewrite.py), so `/models/X` is
`<sandbox>/models/X` here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from tests.cluster.vision_task import write_vlm_folder
from tests.data.chat_templates import CONVERSATIONS, save_with_transformers
from tests.hf.tiny import hf_model
from trainer.data import train_tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu the of and".split()
CHAT_MODEL_VOCAB = 448  # the chat tokenizer's 400 BPE tokens and its special tokens fit


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160)))
        for i in range(n)
    ]


def chat_model(path: Path, _run) -> None:
    """A tiny Qwen2 and the Qwen2.5 chat template's tokenizer in one folder (tokenizer.json,
    chat_template.jinja), as a published model folder has them."""
    hf_model("qwen2_untied", vocab_size=CHAT_MODEL_VOCAB).save_pretrained(path)
    save_with_transformers(path, "qwen2.5")


def vision_model(path: Path, _run) -> None:
    """A tiny random Qwen2-VL folder, as a published one holds it."""
    write_vlm_folder(path)


def chat_records(path: Path, _run) -> None:
    """60 conversations: the chat tests' three, each asked again with a number."""
    with open(path, "w") as f:
        for i in range(60):
            messages = [dict(m) for m in CONVERSATIONS[i % len(CONVERSATIONS)]]
            messages[-2]["content"] += f" (#{i})"
            f.write(json.dumps({"messages": messages}) + "\n")


def jsonl_documents(path: Path, _run) -> None:
    path.mkdir(parents=True)
    for k in range(3):
        with open(path / f"part-{k}.jsonl", "w") as f:
            for doc in documents(40, seed=k):
                f.write(json.dumps({"text": doc}) + "\n")


def text_files(path: Path, _run) -> None:
    path.mkdir(parents=True)
    for i, doc in enumerate(documents(30, seed=7)):
        (path / f"doc-{i:02d}.txt").write_text(doc + "\n")


def parquet_documents(path: Path, _run) -> None:
    path.mkdir(parents=True)
    for k in range(2):
        docs = documents(60, seed=10 + k)
        table = pa.table({"id": list(range(len(docs))), "text": docs})
        pq.write_table(table, path / f"{k}.parquet")


def corpus_tokenizer(path: Path, _run) -> None:
    """A BPE of vocabulary 512 trained on corpus/'s documents (the same seeds)."""
    docs = [d for k in range(2) for d in documents(60, seed=10 + k)]
    path.write_text(train_tokenizer(docs, 512).to_str())


def imported_checkpoints(path: Path, run: Callable[[list[str]], None]) -> None:
    """`trainer.hf import` of the tiny Qwen2 into `path` (step 0)."""
    model = path.parents[2] / "models" / "imported"  # <sandbox>/runs/elastic-fsdp/checkpoints
    chat_model(model, run)
    run(["-m", "trainer.hf", "import", str(model), str(path)])


STAND_INS: dict[str, Callable] = {
    "models/Qwen2.5-0.5B-Instruct": chat_model,
    "models/Qwen2.5-7B-Instruct": chat_model,
    "models/Qwen2-VL-2B-Instruct": vision_model,
    "sft.jsonl": chat_records,
    "docs": jsonl_documents,
    "path/to/texts": text_files,
    "corpus": parquet_documents,
    "tok.json": corpus_tokenizer,
    "runs/elastic-fsdp/checkpoints": imported_checkpoints,
}


def named_in(argv: list[str], sandbox: Path) -> list[str]:
    """The stand-ins an argument names: a value (after `=`) or an argument that is the path, a
    path inside it or a glob in it."""
    found = []
    for arg in argv:
        value = arg.split("=", 1)[1] if "=" in arg and not arg.startswith("-") else arg
        rel = value.removeprefix(f"{sandbox}/").rstrip("/")
        found += [k for k in STAND_INS if rel == k or rel.startswith(f"{k}/")]
    return found


def provide(argv: list[str], sandbox: Path, run: Callable[[list[str]], None]) -> None:
    """Build every stand-in `argv` names that the sandbox does not hold yet; `run(args)` runs
    the venv's python with `args` in the sandbox."""
    for key in named_in(argv, sandbox):
        path = sandbox / key
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            STAND_INS[key](path, run)
