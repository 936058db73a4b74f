"""Part 5 of `python -m benchmarks.data`: fine-tuning windows, packed against padded, and what
attention that stays inside each document costs against plain causal attention.

    python -m benchmarks.data               # all parts; this one on the tiny and mid models
    python -m benchmarks.data --quick       # the tiny model only, a few steps

A deterministic synthetic chat corpus (--chat-conversations conversations of one or two turns;
user turns of 4-30 words, assistant turns of lognormal length: a dozen words typically, up to
200, as instruction data is: most short, a few long) with a ChatML template and a BPE tokenizer
trained on it, is prepared twice with data.kind=chat: data.pack=true (whole conversations packed
into windows) and data.pack=false (one conversation per window, padded). Both hold the same loss
tokens; packing needs fewer windows. Then one process trains the model (forward, backward,
AdamW; no collectives: the data side of the step is what differs) on the same number of
windows of each, contestants alternating within each repetition:

- packed + document mask: what data=chat trains (positions restart in each document,
  attention stays inside it: a dense mask for SDPA on the CPU);
- packed, plain causal: the same windows without the mask (wrong attention, shown only as the
  cost reference of the mask);
- padded: one conversation per window, plain causal (padding is at the end, so causal is exact).

Useful tokens/s counts loss tokens (the assistant turns trained on), the figure a fine-tuning
user compares: windows per second (the median step time of --reps repetitions) times the
preparation's loss tokens per window over the whole corpus (not only the few windows timed).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import dataclass

import torch
from tokenizers import AddedToken

from trainer.config import DataConfig, model_config
from trainer.data import Batches, PreparedData, prepare, train_tokenizer
from trainer.data.preparation import run_in_process
from trainer.model import build_model, loss_sum

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = [
    "shard", "gather", "reduce", "scatter", "optimizer", "gradient", "layer", "token", "window",
    "batch", "model", "node", "cluster", "checkpoint", "resume", "memory", "device", "stream",
    "the", "a", "of", "and", "to", "in", "is", "with", "for", "on", "at", "by", "from", "it",
]  # fmt: skip


@dataclass(frozen=True)
class PackModel:
    name: str
    overrides: dict
    seq: int
    batch: int
    steps: int


PACK_MODELS = {
    "tiny": PackModel("tiny", {"vocab_size": 2048}, seq=256, batch=4, steps=4),
    "mid": PackModel(
        "mid",
        dict(dim=512, n_layers=8, n_heads=8, ffn_dim=1536, vocab_size=2048),
        seq=256,
        batch=2,
        steps=2,
    ),
}
CONTESTANTS = ("packed_document_mask", "packed_causal", "padded")


def _quiet(*_args, **_kwargs) -> None:
    pass


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def write_chat_corpus(folder: str, conversations: int, seed: int = 0) -> str:
    """conversations.jsonl of `conversations` records; returns its path."""
    rng = random.Random(seed)
    path = os.path.join(folder, "conversations.jsonl")
    with open(path, "w") as f:
        for _ in range(conversations):
            messages = (
                [{"role": "system", "content": "You are terse."}] if rng.random() < 0.3 else []
            )
            for _ in range(rng.randint(1, 2)):
                messages.append({"role": "user", "content": _words(rng, rng.randint(4, 30))})
                length = int(min(200, rng.lognormvariate(2.5, 1.0)))
                messages.append({"role": "assistant", "content": _words(rng, length)})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_chat_tokenizer(folder: str, corpus: str, vocab: int) -> str:
    """tokenizer.json (BPE on the corpus, the ChatML special tokens) and tokenizer_config.json
    with the template; returns the tokenizer.json path."""
    with open(corpus) as f:
        texts = [m["content"] for line in f for m in json.loads(line)["messages"]]
    tok = train_tokenizer(texts, vocab - len(SPECIAL))
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    config = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


def prepare_both(work: str, corpus: str, tokenizer: str, seq: int) -> dict[str, PreparedData]:
    out = {}
    for pack in (True, False):
        cfg = DataConfig(
            source=corpus,
            kind="chat",
            tokenizer=tokenizer,
            seq_len=seq,
            pack=pack,
            prepared_dir=os.path.join(work, f"prepared-{seq}"),
        )
        info = prepare(cfg, runner=lambda p, u: run_in_process(p, u, log=_quiet), log=_quiet)
        out["packed" if pack else "padded"] = PreparedData.open(info.uri)
    return out


def _batches(data: PreparedData, seq: int, batch: int, steps: int, causal: bool) -> list:
    """(inputs, targets, weights, positions or None) of `steps` steps of `batch` windows."""
    b = Batches(data, seq, seed=0, global_batch=batch)
    out = []
    for step in range(steps):
        (mb,) = b.micro_batches(step, 0, 1, 1)
        positions = None if causal else mb.input_positions
        out.append((mb.inputs, mb.targets, mb.loss_weights, positions))
    return out


def _train_steps(model, optimizer, batches: list) -> tuple[float, int]:
    """Seconds and loss tokens of one pass over `batches`."""
    tokens = 0
    start = time.perf_counter()  # tokens: a check that every contestant trains on loss tokens
    for inputs, targets, weights, positions in batches:
        logits = model(inputs) if positions is None else model(inputs, positions)
        s, n = loss_sum(logits, targets, weights)
        (s / max(int(n), 1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int(n)
    return time.perf_counter() - start, tokens


def measure_model(pm: PackModel, data: dict[str, PreparedData], reps: int, corpus: dict) -> dict:
    cfg = model_config("tiny", **pm.overrides, max_seq_len=max(2048, pm.seq))
    model = build_model(cfg, "cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = {
        "packed_document_mask": _batches(data["packed"], pm.seq, pm.batch, pm.steps, False),
        "packed_causal": _batches(data["packed"], pm.seq, pm.batch, pm.steps, True),
        "padded": _batches(data["padded"], pm.seq, pm.batch, pm.steps, True),
    }
    for name in CONTESTANTS:  # warm-up: allocator, kernels, rotary tables
        _train_steps(model, optimizer, inputs[name][:1])
    times: dict[str, list[float]] = {n: [] for n in CONTESTANTS}
    tokens: dict[str, int] = {}
    for rep in range(reps):
        order = CONTESTANTS[rep % 3 :] + CONTESTANTS[: rep % 3]
        for name in order:
            seconds, tokens[name] = _train_steps(model, optimizer, inputs[name])
            times[name].append(seconds / pm.steps)
    rows = {}
    for name in CONTESTANTS:
        step = statistics.median(times[name])
        c = corpus["padded" if name == "padded" else "packed"]
        per_window = c["loss_tokens"] / c["windows"]
        rows[name] = {
            "step_s": step,
            "loss_tokens_per_window": per_window,
            "useful_tokens_per_s": per_window * pm.batch / step,
        }
    return rows


def corpus_figures(data: dict[str, PreparedData], seq: int) -> dict:
    """Windows and loss tokens of each preparation: one 'step' that takes every window once."""
    out = {}
    for name, d in data.items():
        windows = Batches(d, seq, seed=0, global_batch=1).num_samples[0]
        loss = Batches(d, seq, seed=0, global_batch=windows).loss_tokens(0)
        out[name] = {"windows": windows, "loss_tokens": int(loss)}
    return out


def part_packing(args, work: str) -> dict:
    corpus = write_chat_corpus(work, args.chat_conversations)
    tokenizer = write_chat_tokenizer(work, corpus, 2048)
    models = ["tiny"] if args.quick else ["tiny", "mid"]
    result = {"models": {}, "corpus": {}}
    for name in models:
        pm = PACK_MODELS[name]
        if args.quick:
            pm = PackModel(pm.name, pm.overrides, seq=128, batch=2, steps=2)
        data = prepare_both(work, corpus, tokenizer, pm.seq)
        result["corpus"][pm.seq] = figures = corpus_figures(data, pm.seq)
        result["models"][name] = measure_model(pm, data, 2 if args.quick else args.reps, figures)
        result["models"][name]["seq"] = pm.seq
        result["models"][name]["batch"] = pm.batch
    return result


def table_packing(r: dict, args) -> str:
    lines = [
        f"5. fine-tuning windows: packed vs padded, document mask vs causal "
        f"({args.chat_conversations} synthetic conversations, ChatML, one process, AdamW)"
    ]
    for seq, c in r["corpus"].items():
        p, q = c["packed"], c["padded"]
        lines.append(
            f"  seq_len {seq}: packed {p['windows']:,} windows, padded {q['windows']:,} windows "
            f"({q['windows'] / max(p['windows'], 1):.2f}x), "
            f"{p['loss_tokens']:,} loss tokens in each"
        )
    lines.append(
        f"  {'model':<6} {'contestant':<22} {'step s':>8} {'loss tok/window':>16} "
        f"{'useful tok/s':>13}"
    )
    for name, rows in r["models"].items():
        for c in CONTESTANTS:
            row = rows[c]
            lines.append(
                f"  {name:<6} {c:<22} {row['step_s']:>8.3f} {row['loss_tokens_per_window']:>16.1f} "
                f"{row['useful_tokens_per_s']:>13.0f}"
            )
        lines.append(
            f"  {name:<6} packed/padded useful tokens/s {packed_vs_padded(rows):.2f}x; "
            f"document mask / causal step time {mask_cost(rows):.2f}x"
        )
    return "\n".join(lines)


def packed_vs_padded(rows: dict) -> float:
    return (
        rows["packed_document_mask"]["useful_tokens_per_s"] / rows["padded"]["useful_tokens_per_s"]
    )


def mask_cost(rows: dict) -> float:
    return rows["packed_document_mask"]["step_s"] / rows["packed_causal"]["step_s"]


def packing_headline(r: dict) -> dict:
    out = {}
    for name, rows in r["models"].items():
        out[f"packed_vs_padded_useful_{name}"] = round(packed_vs_padded(rows), 3)
        out[f"document_mask_vs_causal_{name}"] = round(mask_cost(rows), 3)
        out[f"packed_useful_tokens_per_s_{name}"] = round(
            rows["packed_document_mask"]["useful_tokens_per_s"], 1
        )
    for seq, c in r["corpus"].items():
        out[f"padded_vs_packed_windows_{seq}"] = round(
            c["padded"]["windows"] / max(c["packed"]["windows"], 1), 3
        )
    return out
