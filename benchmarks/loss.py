"""The chunked loss (train.loss_chunk_tokens) against the plain one: memory, step time, and the
vocabulary size from which chunking stops costing time (where `null` turns it on).

    python -m benchmarks.loss                    # vocab 128k, dim 256, 2 x 512 tokens (~8 min)
    python -m benchmarks.loss --quick            # tiny settings (the smoke test's)
    python -m benchmarks.loss --vocab 65536 --crossover 8192,32768 --chunks 256,1024

A full training step (forward, backward, AdamW) of a plain fp32 model on the CPU, stepped by
trainer/step.py's train_step (TorchPeer), with the loss from the whole logits (chunk 0) and
chunked. Each memory contestant runs in its own subprocess, so no contestant inherits another's
heap: glibc's mmap threshold is fixed at 64 KiB there, so every tensor above it is its own
mapping, returned to the OS when freed, and the resident set follows the live tensors (the
method of tests/plan/test_plan.py). Per step: the rise of the resident set from just before the step
to its high-water mark during it (VmHWM, cleared first via /proc/self/clear_refs) after a
warm-up step (AdamW's state exists), and, for one more step, the peak of the bytes torch's ops
allocate as trainer/plan's AllocationTracker counts them (every storage an op creates until it
dies; torch's own CPU allocator keeps no peak statistics). Both are given: RSS is what the
machine pays, the tracker what tensors hold.

The crossover: for each vocabulary of --crossover, the two losses stepped in turn in one
process (paired, so load on a shared machine hits both alike), the median time ratio; the
auto rule (trainer.loss.AUTO_MIN_VOCAB) sits at or above where the ratio reaches 1. The chunk sweep
(--chunks, with the chunk of the memory table) times chunk sizes at --vocab, paired the same
way; the headline time ratio is its row of the memory table's chunk. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import time

import torch

from trainer.config import model_config
from trainer.loss import AUTO_CHUNK_BYTES, AUTO_MIN_VOCAB, auto_chunk_tokens
from trainer.model import build_model
from trainer.plan.activations import AllocationTracker
from trainer.step import TorchPeer, train_step

MiB = 2**20
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


# ------------------------------------------------------------------------------- one contestant


def _resident(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class Stepper:
    """A model, AdamW and a fixed batch; step(chunk) is one train_step."""

    def __init__(self, vocab: int, dim: int, layers: int, rows: int, seq: int, tied: bool):
        heads = max(1, dim // 64)
        cfg = model_config(
            "tiny", vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, ffn_dim=2 * dim,
            max_seq_len=max(seq, 16), tie_embeddings=tied,
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = build_model(cfg, device="cpu", seed=0)
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)
        self.peer, self.opt = TorchPeer(self.model, opt), opt
        toks = torch.randint(0, vocab, (rows, seq + 1))
        self.batch = [(toks[:, :-1], toks[:, 1:], 1.0)]
        self.tokens = rows * seq

    def step(self, chunk: int) -> float:
        t0 = time.perf_counter()
        out = train_step(
            self.peer, self.opt, self.batch, global_tokens=self.tokens, grad_clip=1.0,
            loss_chunk_tokens=chunk,
        )  # fmt: skip
        float(out.loss)
        return time.perf_counter() - t0


def child_memory(args) -> dict:
    """In a fresh process: warm-up, then steps with their resident rise, then one step under the
    allocation tracker. (Times here are not paired: the paired tables give the step times.)"""
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    s = Stepper(args.vocab, args.dim, args.layers, args.rows, args.seq, args.tied)
    s.step(args.chunk)  # AdamW's state, the rotary tables
    times, rises = [], []
    for _ in range(args.steps):
        gc.collect()
        before = _resident("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark restarts from the resident set now
        times.append(s.step(args.chunk))
        rises.append(_resident("VmHWM") - before)
    gc.collect()
    tracker = AllocationTracker()
    with tracker:
        s.step(args.chunk)
    return dict(times=times, rss_rise=max(rises), tracked_peak=tracker.peak)


def child_paired(args) -> dict:
    """In one process: plain and chunked steps in turn (paired), their times."""
    s = Stepper(args.vocab, args.dim, args.layers, args.rows, args.seq, args.tied)
    chunks = [0, *args.chunk_list]
    for c in chunks:
        s.step(c)  # warm-up of each
    times = {c: [] for c in chunks}
    for _ in range(args.steps):
        for c in chunks:
            times[c].append(s.step(c))
    return {str(c): t for c, t in times.items()}


def run_child(args, mode: str, vocab: int, chunks: list[int], steps: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.loss", "--child", mode, "--vocab", str(vocab)]
    cmd += ["--dim", str(args.dim), "--layers", str(args.layers), "--rows", str(args.rows)]
    cmd += ["--seq", str(args.seq), "--steps", str(steps)]
    cmd += ["--child-chunks", ",".join(map(str, chunks))] + (["--tied"] if args.tied else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- the report


def memory_table(args, chunk: int) -> dict:
    logits = args.rows * args.seq * args.vocab * 4
    out = {}
    for name, c in (("plain", 0), (f"chunked {chunk}", chunk)):
        out[name] = run_child(args, "memory", args.vocab, [c], args.steps)
    plain, chunked = out["plain"], out[f"chunked {chunk}"]
    print(
        f"\nmemory and step time: vocab {args.vocab:,}, dim {args.dim}, {args.layers} layers, "
        f"{args.rows} x {args.seq} tokens, fp32 (whole fp32 logits: {logits / MiB:,.0f} MiB)"
    )
    print(f"{'contestant':<16}{'peak RSS rise MiB':>20}{'tracked peak MiB':>19}")
    for name, r in out.items():
        print(f"{name:<16}{r['rss_rise'] / MiB:>20,.0f}{r['tracked_peak'] / MiB:>19,.0f}")
    saved_rss = plain["rss_rise"] - chunked["rss_rise"]
    saved_tracked = plain["tracked_peak"] - chunked["tracked_peak"]
    print(
        f"saved: {saved_rss / MiB:,.0f} MiB resident, {saved_tracked / MiB:,.0f} MiB tracked "
        f"({saved_rss / logits:.2f}x / {saved_tracked / logits:.2f}x the whole logits)"
    )
    return dict(
        vocab=args.vocab, chunk=chunk, logits_mib=logits / MiB,
        plain_rss_mib=plain["rss_rise"] / MiB, chunked_rss_mib=chunked["rss_rise"] / MiB,
        plain_tracked_mib=plain["tracked_peak"] / MiB,
        chunked_tracked_mib=chunked["tracked_peak"] / MiB,
        saved_rss_mib=saved_rss / MiB, saved_tracked_mib=saved_tracked / MiB,
        goal_saves_at_least_the_logits=bool(saved_rss >= logits and saved_tracked >= logits),
    )  # fmt: skip


def paired_table(args, title: str, vocabs_chunks: list[tuple[int, list[int]]]) -> list[dict]:
    print(f"\n{title}: {args.rows} x {args.seq} tokens, dim {args.dim}, paired medians")
    print(f"{'vocab':>9}{'chunk':>8}{'plain s':>10}{'chunked s':>11}{'ratio':>8}")
    rows = []
    for vocab, chunks in vocabs_chunks:
        r = run_child(args, "paired", vocab, chunks, args.paired_steps)
        plain = r["0"]
        for c in chunks:
            ratios = [a / b for a, b in zip(r[str(c)], plain)]
            row = dict(
                vocab=vocab, chunk=c, plain_s=statistics.median(plain),
                chunked_s=statistics.median(r[str(c)]), ratio=statistics.median(ratios),
            )  # fmt: skip
            rows.append(row)
            print(
                f"{vocab:>9,}{c:>8}{row['plain_s']:>10.3f}{row['chunked_s']:>11.3f}"
                f"{row['ratio']:>8.3f}"
            )
    return rows


def crossover(rows: list[dict], tolerance: float) -> int | None:
    """The smallest vocabulary from which every measured one is within `tolerance` of plain."""
    best = None
    for row in sorted(rows, key=lambda r: -r["vocab"]):
        if row["ratio"] > 1 + tolerance:
            break
        best = row["vocab"]
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per memory contestant")
    ap.add_argument("--paired-steps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="default: what auto picks")
    ap.add_argument("--chunks", default="256", help="chunk sweep at --vocab")
    ap.add_argument("--crossover", default="8192,32768,131072")
    ap.add_argument("--tolerance", type=float, default=0.03, help="crossover: ratio <= 1 + this")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny settings (the smoke test)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--child", choices=["memory", "paired"], help=argparse.SUPPRESS)
    ap.add_argument("--child-chunks", default="0", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.chunk_list = [int(c) for c in args.child_chunks.split(",")]
        args.chunk = args.chunk_list[0]
        fn = child_memory if args.child == "memory" else child_paired
        print(json.dumps(fn(args)))
        return
    if args.quick:
        args.vocab, args.dim, args.layers, args.rows, args.seq = 4096, 32, 1, 2, 64
        args.steps, args.paired_steps, args.chunks, args.crossover = 1, 1, "", "4096"
        args.chunk = args.chunk or 32
    chunk = args.chunk or auto_chunk_tokens(args.vocab)
    memory = memory_table(args, chunk)
    sizes = sorted({chunk, *(int(c) for c in args.chunks.split(",") if c)})
    sweep = paired_table(args, f"step time at vocab {args.vocab:,}", [(args.vocab, sizes)])
    at_chunk = next(r for r in sweep if r["chunk"] == chunk)
    memory.update(plain_step_s=at_chunk["plain_s"], chunked_step_s=at_chunk["chunked_s"])
    memory["time_ratio"] = at_chunk["ratio"]
    vocabs = [int(v) for v in args.crossover.split(",")]
    cross = paired_table(args, "crossover", [(v, [auto_chunk_tokens(v)]) for v in vocabs])
    found = crossover(cross, args.tolerance)
    print(
        f"\nchunking costs no more than {args.tolerance:.0%} time from vocab "
        f"{found if found is None else f'{found:,}'} up (of {args.crossover}); auto turns it on "
        f"from {AUTO_MIN_VOCAB:,}, chunks of {AUTO_CHUNK_BYTES // MiB} MiB of fp32 logits"
    )
    print(
        json.dumps(
            dict(
                memory=memory,
                chunk_sweep=sweep,
                crossover=cross,
                crossover_vocab=found,
                auto_min_vocab=AUTO_MIN_VOCAB,
                auto_chunk_mib=AUTO_CHUNK_BYTES // MiB,
            )
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
