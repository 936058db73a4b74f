"""The data pipeline: preparation in one process against Ray Data, the loader against raw reads of
the same bytes, the time to the first batch, and a worker's memory at two dataset sizes.

    python -m benchmarks.data                    # 16 x 6 MiB of JSONL, BPE vocab 8192, ~2-3 min
    python -m benchmarks.data --quick --no-ray   # tiny sizes, no Ray: a few seconds
    python -m benchmarks.data --files 16 --file-mib 16 --dir /mnt/nvme/tmp

Measured in one run, on one machine, in a temporary folder removed at the end:
1. Preparation. A deterministic synthetic corpus (--files JSONL files; documents of lognormal
   length made of sentences of Zipf-distributed words from a seeded word list, with punctuation)
   and a byte-level BPE tokenizer trained on its first --tokenizer-sample-mib. It is prepared on
   Ray Data on a local Ray this benchmark starts with --ray-cpus CPUs
   (cluster.prepare.ray_data_runner), and in this process (trainer.data.prepare) before and
   after that, each into its own folder; the ratios use the mean of the two in-process runs, so
   that load drift on a shared machine does not decide them. All *.bin shards must be bitwise
   equal. With --no-ray, Ray Data's UDF (cluster.prepare.TokenizeUnits) takes Ray's place, run
   in this process on JSON round-tripped units in reverse order. Ray's start-up is shown, not
   hidden: ray.init on its own row, the time to the first unit's commit, and a "steady" rate
   that leaves out each worker's first unit (from the mtimes of the units' commit records).
   The corpus is prepared once more with tokenizer=byte: the large dataset of part 4.
2. Loader against raw reads, one rank of world 1: tokens/s of Loader.next over --steps steps
   (background thread; batches in the stored dtype, widened to int64 where they are used, on
   the device) against os.preadv of exactly the same
   sample byte ranges into one preallocated buffer (the sample ranges are computed beforehand,
   outside the timing). Diagnostic rows: the same ranges read with pyarrow read_at (what
   TokenStream calls), Batches.step_ids alone (the sample order), and Batches.micro_batches in
   this thread (no loader thread). Contestants alternate within each of --reps repetitions (the
   first rotates); medians of the repetitions. Every shard is read once beforehand, so the page
   cache is warm for all contestants.
3. Time to the first batch: PreparedData.open + Batches + Loader + the first next(start), at a
   start step far into the run (nothing is scanned to get there); median of --first-batch-tries.
4. Worker memory: in a fresh process per dataset (peak RSS only grows), Loader streams
   --memory-steps steps; reported is the peak RSS (VmHWM, reset through /proc/self/clear_refs
   where the kernel allows) minus the RSS before the data is opened. The small dataset holds
   --small-windows loader windows (window = depth x global_batch x (seq_len + 1) tokens), the
   large one is the whole corpus tokenized by bytes (hundreds of windows): the two peaks should
   be about equal, as a worker holds its window, never the dataset.
5. Fine-tuning windows (benchmarks/packing.py): a synthetic chat corpus prepared packed and
   padded; useful (loss) tokens/s of training on each, and the step-time cost of the document
   mask against plain causal attention, on the tiny and mid models (--no-packing skips it).
The last line of output is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import filecmp
import functools
import glob
import io
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs

from benchmarks.packing import packing_headline, part_packing, table_packing
from cluster.prepare import TokenizeUnits, ray_data_runner
from trainer.config import DataConfig
from trainer.data import (
    Batches,
    Loader,
    PreparedData,
    plan_preparation,
    prepare,
    train_tokenizer,
)

SYLLABLES = (
    "ka to ri en sa mo lu an be de fi go ha ji ne po qu st ve wy ex or th ch sh il un ma co re "
    "al in er es ti ou ar ol"
).split()
WORDS = 6000
PUNCTUATION = (".", ".", ".", ".", "?", "!", ";")
EVAL_FRACTION = 0.01
FAR_STEP = 10_000
"""Part 3 starts the loader here: the order is computed pointwise, nothing before it is read."""


def quiet(*_args, **_kwargs) -> None:
    """prepare()'s progress lines would interleave with the tables."""


def silent_prepare(cfg: DataConfig, runner=None):
    """prepare(), its progress lines dropped (its in-process runner prints to stdout)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return prepare(cfg, runner=runner, log=quiet)


# ----------------------------------------------------------------------------- corpus


class TextGenerator:
    """Documents of sentences of Zipf-distributed words from a seeded word list."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        words: set[str] = set()
        while len(words) < WORDS:
            k = int(self.rng.integers(1, 5))
            words.add("".join(SYLLABLES[i] for i in self.rng.integers(0, len(SYLLABLES), k)))
        self.words = np.array(self.rng.permutation(sorted(words)), dtype=object)
        p = 1.0 / np.arange(1, WORDS + 1) ** 1.1
        self.p = p / p.sum()

    def document(self) -> str:
        rng = self.rng
        n = int(np.clip(rng.lognormal(5.3, 0.9), 8, 6000))  # words; median ~200
        words = self.words[rng.choice(WORDS, n, p=self.p)]
        lengths = rng.integers(4, 22, n // 4 + 2)
        ends = rng.choice(PUNCTUATION, len(lengths))
        commas = rng.random(n) < 0.06
        sentences, i = [], 0
        for length, end in zip(lengths, ends):
            if i >= n:
                break
            s = [w + "," if c else w for w, c in zip(words[i : i + length], commas[i : i + length])]
            s[0] = s[0].capitalize()
            s[-1] = s[-1].rstrip(",") + end
            sentences.append(" ".join(s))
            i += length
        return " ".join(sentences)


def write_corpus(folder: str, files: int, file_bytes: int, seed: int) -> tuple[int, int]:
    """`files` JSONL files of about `file_bytes` each; returns (bytes, documents)."""
    os.makedirs(folder)
    gen = TextGenerator(seed)
    total = docs = 0
    for f in range(files):
        with open(os.path.join(folder, f"part-{f:05d}.jsonl"), "w") as out:
            size = 0
            while size < file_bytes:
                line = json.dumps({"id": docs, "text": gen.document()}) + "\n"
                out.write(line)
                size += len(line)
                docs += 1
            total += size
    return total, docs


def read_texts(folder: str, max_bytes: int) -> list[str]:
    """The first documents of the corpus, in file order, up to about max_bytes of text."""
    out, size = [], 0
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        with open(path) as f:
            for line in f:
                if size >= max_bytes:
                    return out
                out.append(json.loads(line)["text"])
                size += len(out[-1])
    return out


def write_small_corpus(folder: str, texts: list[str], min_bytes: int) -> None:
    """One JSONL file of the first documents whose text adds up to at least min_bytes."""
    os.makedirs(folder)
    size = 0
    with open(os.path.join(folder, "part-00000.jsonl"), "w") as out:
        for i, text in enumerate(texts):
            if size >= min_bytes:
                break
            out.write(json.dumps({"id": i, "text": text}) + "\n")
            size += len(text) + 1  # + the end-of-document token
    if size < min_bytes:
        raise ValueError(f"the corpus holds {size} bytes of text, {min_bytes} needed")


def data_config(source: str, tokenizer: str, prepared_dir: str) -> DataConfig:
    cfg = DataConfig(
        source=source,
        format="jsonl",
        text_column="text",
        tokenizer=tokenizer,
        prepared_dir=prepared_dir,
        eval_fraction=EVAL_FRACTION,
    )
    cfg.validate()
    return cfg


# ----------------------------------------------------------------------------- 1. preparation


@dataclass
class PrepareRun:
    label: str
    uri: str
    tokens: int
    shards: int
    seconds: float
    commits: list[float]
    """Seconds from the call to each unit's commit record, in order (planning included)."""
    steady_tokens_per_s: float
    """Tokens of the units after each worker's first, over the time from the last of those first
    commits to the last commit: the rate with start-up left out (nan with a single round)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def unit_commits(uri: str) -> list[tuple[float, int]]:
    """(commit time, tokens) of every unit, by commit time: a unit's record is written after its
    shards (storage.write_atomic), so the record's mtime is when the unit finished."""
    out = []
    for path in glob.glob(os.path.join(uri, "*.done.json")):
        with open(path) as f:
            record = json.load(f)
        tokens = sum(s["tokens"] for s in record["shards"].values())
        out.append((os.stat(path).st_mtime, tokens))
    return sorted(out)


def timed_prepare(label: str, cfg: DataConfig, runner=None, workers: int = 1) -> PrepareRun:
    wall0, t0 = time.time(), time.perf_counter()
    info = silent_prepare(cfg, runner)
    seconds = time.perf_counter() - t0
    assert info.created, f"{info.uri} was prepared already: the benchmark needs a fresh folder"
    commits = unit_commits(info.uri)
    k = min(workers, len(commits))
    later = commits[k:]
    span = commits[-1][0] - commits[k - 1][0]
    steady = sum(t for _, t in later) / span if later and span > 0 else math.nan
    return PrepareRun(
        label,
        info.uri,
        info.num_tokens,
        info.num_shards,
        seconds,
        [c - wall0 for c, _ in commits],
        steady,
    )


def mean_run(label: str, a: PrepareRun, b: PrepareRun) -> PrepareRun:
    """Two runs of the same preparation as one: mean seconds and mean steady rate."""
    return PrepareRun(
        label,
        a.uri,
        a.tokens,
        a.shards,
        (a.seconds + b.seconds) / 2,
        [(x + y) / 2 for x, y in zip(a.commits, b.commits)],
        (a.steady_tokens_per_s + b.steady_tokens_per_s) / 2,
    )


def shards_equal(uri_a: str, uri_b: str) -> bool:
    """The same *.bin names in both folders, and every one bitwise equal."""
    names_a = sorted(os.path.basename(p) for p in glob.glob(os.path.join(uri_a, "*.bin")))
    names_b = sorted(os.path.basename(p) for p in glob.glob(os.path.join(uri_b, "*.bin")))
    return (
        bool(names_a)
        and names_a == names_b
        and all(
            filecmp.cmp(os.path.join(uri_a, n), os.path.join(uri_b, n), shallow=False)
            for n in names_a
        )
    )


def udf_runner(plan, units, log=quiet) -> list[dict]:
    """Ray Data's UDF without Ray: units JSON round-tripped, in reverse order, a fresh
    tokenizer loaded from its file as each Ray actor does."""
    udf = TokenizeUnits(json.loads(json.dumps(plan.unit_args())))
    batch = {"unit": [json.dumps(u.to_json()) for u in reversed(units)]}
    return [json.loads(r) for r in udf(batch)["record"]]


def run_ray(cfg: DataConfig, cpus: int, units: int) -> tuple[PrepareRun, float]:
    """Prepare on Ray Data on a local Ray of `cpus` CPUs started (and stopped) here; returns the
    run and ray.init's seconds."""
    import ray  # noqa: PLC0415 -- ray (and ray.data) cost seconds to import; not with --no-ray

    ray_tmp = tempfile.mkdtemp(prefix="bd-ray-", dir="/tmp")  # short: Ray's sockets live here
    try:
        t0 = time.perf_counter()
        ray.init(
            address="local",  # always a new local instance, never a RAY_ADDRESS cluster
            num_cpus=cpus,
            include_dashboard=False,
            _temp_dir=ray_tmp,
            log_to_driver=False,
        )
        init_s = time.perf_counter() - t0
        try:
            ray.data.DataContext.get_current().enable_progress_bars = False
            runner = functools.partial(ray_data_runner, log=quiet)
            run = timed_prepare(f"Ray Data, {cpus} CPUs", cfg, runner, min(cpus, units))
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return run, init_s


def part_prepare(args, work: str) -> dict:
    load0 = os.getloadavg()[0]
    corpus = os.path.join(work, "corpus")
    t0 = time.perf_counter()
    corpus_bytes, documents = write_corpus(
        corpus, args.files, int(args.file_mib * 2**20), args.seed
    )
    gen_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    sample = read_texts(corpus, int(args.tokenizer_sample_mib * 2**20))
    tok = train_tokenizer(sample, args.vocab)
    tok_path = os.path.join(work, "tokenizer.json")
    with open(tok_path, "w") as f:
        f.write(tok.to_str())
    tok_s = time.perf_counter() - t0

    cfg = lambda name, tokenizer=tok_path: data_config(corpus, tokenizer, os.path.join(work, name))
    units = len(plan_preparation(cfg("before")).units)
    # This process runs before and after the other runner, and the two are averaged, so that
    # drift of a shared machine's load does not decide the ratio.
    before = timed_prepare("this process, before", cfg("before"))
    ray_init_s = None
    if args.no_ray:
        other = timed_prepare("Ray Data's UDF, this process", cfg("udf"), udf_runner)
        compared = "udf_in_process"
    else:
        other, ray_init_s = run_ray(cfg("ray"), args.ray_cpus, units)
        compared = "ray_data"
    after = timed_prepare("this process, after", cfg("after"))
    byte = timed_prepare("tokenizer=byte, this process", cfg("byte", "byte"))
    return dict(
        corpus=corpus,
        corpus_bytes=corpus_bytes,
        documents=documents,
        units=units,
        gen_s=gen_s,
        tokenizer_s=tok_s,
        tokenizer_sample_bytes=sum(len(t) for t in sample),
        runs=[before, other, after, byte],
        process=mean_run("this process (mean of both)", before, after),
        other=other,
        byte=byte,
        ray=not args.no_ray,
        ray_init_s=ray_init_s,
        compared=compared,
        equal=shards_equal(before.uri, other.uri) and shards_equal(before.uri, after.uri),
        load=(load0, os.getloadavg()[0]),
    )


def table_prepare(r: dict, args) -> str:
    mib = r["corpus_bytes"] / 2**20
    head = (
        f"{'1. preparation':34} {'MiB in':>7} {'tokens':>11} {'shards':>6} {'seconds':>8} "
        f"{'tok/s':>10} {'1st unit s':>10} {'steady tok/s':>12}"
    )
    lines = [head, "-" * len(head)]
    for run in r["runs"][:3] + [r["process"], r["byte"]]:
        lines.append(
            f"{run.label:34} {mib:7.1f} {run.tokens:11,} {run.shards:6} {run.seconds:8.2f} "
            f"{run.tokens_per_s:10,.0f} {run.commits[0]:10.2f} {run.steady_tokens_per_s:12,.0f}"
        )
    if r["ray_init_s"] is not None:
        lines.append(
            f"{'ray.init (not in the Ray row)':34} {'':7} {'':11} {'':6} {r['ray_init_s']:8.2f}"
        )
    p, o = r["process"], r["other"]
    lines += [
        "",
        f"{o.label} / this process: {o.tokens_per_s / p.tokens_per_s:.3f}x tokens/s end to end, "
        f"{o.steady_tokens_per_s / p.steady_tokens_per_s:.3f}x steady. *.bin shards bitwise "
        f"equal (all three runs): {r['equal']}.",
        "unit commits, s from the call: "
        + "; ".join(
            f"{run.label}: " + " ".join(f"{c:.1f}" for c in run.commits) for run in r["runs"][:3]
        ),
        f"corpus: {args.files} JSONL files, {mib:.1f} MiB, {r['documents']:,} documents "
        f"(generated in {r['gen_s']:.1f} s, seed {args.seed}), {r['units']} work units (one per "
        f"file), eval_fraction {EVAL_FRACTION}; BPE vocab {args.vocab} trained on "
        f"{r['tokenizer_sample_bytes'] / 2**20:.1f} MiB in {r['tokenizer_s']:.1f} s.",
        "seconds: the prepare() call (planning, tokenizing, fsync'd shards, records, manifest). "
        "1st unit s: from the call to the first unit's commit (Ray: Ray Data's start-up and the "
        "actors' start are in it). steady: tokens after each worker's first unit over the time "
        "from then to the last commit (start-up left out). This process runs before and after "
        "the other runner; the ratios use their mean.",
        f"This process tokenizes with the tokenizers library's threads on all {os.cpu_count()} "
        + (
            f"cores; Ray Data runs min(CPUs, units) = {min(args.ray_cpus, r['units'])} actors "
            "of 1 CPU each."
            if r["ray"]
            else "cores, and so does the UDF row (--no-ray: Ray was not started)."
        )
        + f" 1-min load average {r['load'][0]:.1f} before, {r['load'][1]:.1f} after.",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- 2. loader vs raw


def sample_ranges(batches: Batches, steps: int) -> list[list[tuple[str, int, int]]]:
    """Per step, the (shard path, byte offset, bytes) reads of its samples, as TokenStream does
    them: a sample is tokens [i*T, i*T + T + 1) of its source's stream (two reads across a shard
    boundary)."""
    out = []
    count = batches.seq_len + 1
    for step in range(steps):
        sources, ids = batches.step_ids(step, 0, 1)
        reads = []
        for src, sample in zip(sources.tolist(), ids.tolist()):
            stream = batches.streams[src]
            size = stream.dtype.itemsize
            pos, left = sample * batches.seq_len, count
            i = bisect.bisect_right(stream.starts, pos) - 1
            while left:
                shard = stream.shards[i]
                lo = pos - stream.starts[i]
                n = min(left, shard.tokens - lo)
                reads.append((stream.root.child(shard.name).path, lo * size, n * size))
                pos, left, i = pos + n, left - n, i + 1
        out.append(reads)
    return out


def warm_page_cache(paths) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(8 * 2**20):
                pass


class RawPread:
    """os.preadv of every sample's bytes into one preallocated buffer: no index, no tensors."""

    name = "raw os.preadv, one buffer"

    def __init__(self, plan: list, bytes_per_step: int):
        paths = sorted({p for reads in plan for p, _, _ in reads})
        self.fds = {p: os.open(p, os.O_RDONLY) for p in paths}
        self.buf = memoryview(bytearray(bytes_per_step))
        self.plan = [[(self.fds[p], off, n) for p, off, n in reads] for reads in plan]

    def __call__(self) -> None:
        buf = self.buf
        for reads in self.plan:
            at = 0
            for fd, off, n in reads:
                if os.preadv(fd, [buf[at : at + n]], off) != n:
                    raise OSError(f"short read of fd {fd} at {off}")
                at += n

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


class RawReadAt:
    """pyarrow RandomAccessFile.read_at of the same ranges (what TokenStream calls per read)."""

    name = "raw pyarrow read_at (diagnostic)"

    def __init__(self, plan: list):
        fs = pafs.LocalFileSystem()
        paths = sorted({p for reads in plan for p, _, _ in reads})
        self.files = {p: fs.open_input_file(p) for p in paths}
        self.plan = [[(self.files[p], off, n) for p, off, n in reads] for reads in plan]

    def __call__(self) -> None:
        for reads in self.plan:
            for f, off, n in reads:
                f.read_at(n, off)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def run_direct(batches: Batches, steps: int) -> None:
    for step in range(steps):
        batches.micro_batches(step, 0, 1, 1)


def run_step_ids(batches: Batches, steps: int) -> None:
    for step in range(steps):
        batches.step_ids(step, 0, 1)


def run_loader(batches: Batches, steps: int, depth: int) -> None:
    loader = Loader(batches, 0, 1, micro_batches=1, start=0, stop=steps, depth=depth)
    try:
        for step in range(steps):
            loader.next(step)
    finally:
        loader.close()


COMPUTE_MS = 1.0
"""Simulated training compute per step (GIL released, as torch kernels release it)."""


def blocked_beside_compute(batches: Batches, steps: int, depth: int) -> float:
    """Median ms per step the training thread waits in Loader.next when every step also computes
    COMPUTE_MS with the GIL released: what a training step pays for its data."""
    loader = Loader(batches, 0, 1, micro_batches=1, start=0, stop=steps, depth=depth)
    waits = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            loader.next(step)
            waits.append(time.perf_counter() - t0)
            time.sleep(COMPUTE_MS / 1e3)  # sleeps release the GIL, as compute kernels do
    finally:
        loader.close()
    return statistics.median(waits[depth:]) * 1e3


def part_loader(args, uri: str) -> dict:
    load0 = os.getloadavg()[0]
    data = PreparedData.open(uri)
    batches = Batches(data, args.seq_len, args.seed, args.global_batch)
    plan = sample_ranges(batches, args.steps)
    stream = batches.streams[0]
    warm_page_cache(stream.root.child(s.name).path for s in stream.shards)
    bytes_per_step = args.global_batch * (args.seq_len + 1) * stream.dtype.itemsize
    raw, read_at = RawPread(plan, bytes_per_step), RawReadAt(plan)
    contestants = [
        (raw.name, raw),
        (read_at.name, read_at),
        ("Batches.step_ids only: the order (diag.)", lambda: run_step_ids(batches, args.steps)),
        ("Batches.micro_batches, this thread (diag.)", lambda: run_direct(batches, args.steps)),
        (
            "Loader.next (thread; int64 on the device)",
            lambda: run_loader(batches, args.steps, args.depth),
        ),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in contestants}
    try:
        for rep in range(args.reps + 1):  # repetition 0 warms up and is not counted
            k = rep % len(contestants)
            for name, fn in contestants[k:] + contestants[:k]:
                t0 = time.perf_counter()
                fn()
                if rep:
                    times[name].append(time.perf_counter() - t0)
    finally:
        raw.close()
        read_at.close()
    tokens = args.steps * args.global_batch * args.seq_len
    blocked = blocked_beside_compute(batches, min(args.steps, 300), args.depth)
    return dict(
        blocked_ms=blocked,
        names=[n for n, _ in contestants],
        raw=raw.name,
        loader=contestants[-1][0],
        times=times,
        tokens=tokens,
        stream_tokens=len(stream),
        shards=len(stream.shards),
        dtype=stream.dtype.name,
        reads=sum(len(r) for r in plan),
        load=(load0, os.getloadavg()[0]),
    )


def loader_figures(r: dict) -> dict:
    med = {n: statistics.median(t) for n, t in r["times"].items()}
    paired = statistics.median(a / b for a, b in zip(r["times"][r["raw"]], r["times"][r["loader"]]))
    return dict(
        tokens_per_s={n: r["tokens"] / m for n, m in med.items()},
        ms={n: m * 1e3 for n, m in med.items()},
        min_ms={n: min(t) * 1e3 for n, t in r["times"].items()},
        vs_raw={n: med[r["raw"]] / m for n, m in med.items()},
        loader_vs_raw_paired=paired,
    )


def table_loader(r: dict, args) -> str:
    f = loader_figures(r)
    head = f"{'2. loader vs raw':42} {'median ms':>9} {'min ms':>8} {'tokens/s':>12} {'vs raw':>7}"
    lines = [head, "-" * len(head)]
    for n in r["names"]:
        lines.append(
            f"{n:42} {f['ms'][n]:9.1f} {f['min_ms'][n]:8.1f} {f['tokens_per_s'][n]:12,.0f} "
            f"{f['vs_raw'][n]:7.3f}"
        )
    window = args.depth * args.global_batch * (args.seq_len + 1)
    lines += [
        "",
        f"loader / raw: {f['vs_raw'][r['loader']]:.3f}x (median of repetitions), "
        f"{f['loader_vs_raw_paired']:.3f}x (median of same-repetition ratios); goal >= 0.8x.",
        f"beside {COMPUTE_MS:.0f} ms of compute per step (GIL released), the training thread "
        f"waits {r['blocked_ms'] * 1e3:.0f} us per step in Loader.next (median): the reads "
        "hide behind the step.",
        f"one rank of world 1, global_batch {args.global_batch}, seq_len {args.seq_len}, depth "
        f"{args.depth} (window {window:,} tokens), {args.steps} steps = {r['reads']:,} reads per "
        f"contestant per repetition, {args.reps} repetitions (+1 warm-up), contestants "
        "alternating; the BPE dataset of part 1 "
        f"({r['stream_tokens']:,} train tokens, {r['shards']} shards, {r['dtype']}).",
        "tokens/s: steps x global_batch x seq_len / time. The page cache is warm for all (every "
        "shard read once before; it cannot be dropped without root). 1-min load average "
        f"{r['load'][0]:.1f} before, {r['load'][1]:.1f} after, on {os.cpu_count()} cores.",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- 3. first batch


def part_first_batch(args, uri: str) -> dict:
    start = FAR_STEP
    times = []
    for _ in range(args.first_batch_tries):
        t0 = time.perf_counter()
        data = PreparedData.open(uri)
        batches = Batches(data, args.seq_len, args.seed, args.global_batch)
        loader = Loader(batches, 0, 1, 1, start, start + args.depth + 1, args.depth)
        mbs = loader.next(start)
        times.append(time.perf_counter() - t0)
        loader.close()
        assert mbs[0].inputs.shape == (args.global_batch, args.seq_len)
    return dict(times=times, start=start)


def table_first_batch(r: dict, args) -> str:
    ms = [t * 1e3 for t in r["times"]]
    head = f"{'3. time to first batch':42} {'median ms':>9} {'min ms':>8} {'max ms':>8}"
    return "\n".join(
        [
            head,
            "-" * len(head),
            f"{'open + Batches + Loader + next(start)':42} {statistics.median(ms):9.1f} "
            f"{min(ms):8.1f} {max(ms):8.1f}",
            "",
            f"{len(ms)} tries, each from PreparedData.open of the part 1 BPE dataset (manifest "
            f"read) to the first micro-batches of step {r['start']:,} (global_batch "
            f"{args.global_batch}, seq_len {args.seq_len}); page cache warm.",
        ]
    )


# ----------------------------------------------------------------------------- 4. memory


def proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


def reset_peak_rss() -> bool:
    """Set VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_worker(uri: str, seq_len: int, global_batch: int, depth: int, steps: int, queue) -> None:
    """In a fresh process: stream `steps` steps from `uri`; peak RSS over RSS before opening."""
    try:
        reset = reset_peak_rss()
        before = proc_status_kib("VmRSS")
        data = PreparedData.open(uri)
        batches = Batches(data, seq_len, 0, global_batch)
        loader = Loader(batches, 0, 1, 1, 0, steps, depth)
        for step in range(steps):
            loader.next(step)
        loader.close()
        peak = proc_status_kib("VmHWM")
        queue.put(
            (
                "ok",
                dict(before_kib=before, peak_kib=peak, reset=reset, tokens=len(batches.streams[0])),
            )
        )
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def peak_rss(uri: str, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(
        target=rss_worker,
        args=(uri, args.seq_len, args.global_batch, args.depth, args.memory_steps, queue),
    )
    proc.start()
    try:
        status, value = queue.get(timeout=600)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if status == "error":
        raise RuntimeError(f"memory worker failed:\n{value}")
    return value


def part_memory(args, work: str, corpus: str, large_uri: str) -> dict:
    load0 = os.getloadavg()[0]
    window = args.depth * args.global_batch * (args.seq_len + 1)
    small_corpus = os.path.join(work, "small-corpus")
    write_small_corpus(
        small_corpus,
        read_texts(corpus, 2 * args.small_windows * window),
        args.small_windows * window,
    )
    small = silent_prepare(data_config(small_corpus, "byte", os.path.join(work, "small")))
    return dict(
        window=window,
        small=peak_rss(small.uri, args),
        large=peak_rss(large_uri, args),
        load=(load0, os.getloadavg()[0]),
    )


def table_memory(r: dict, args) -> str:
    head = (
        f"{'4. worker memory':22} {'train tokens':>12} {'windows':>8} {'RSS before MiB':>14} "
        f"{'peak MiB':>9} {'peak - before MiB':>17}"
    )
    lines = [head, "-" * len(head)]
    for name in ("small", "large"):
        m = r[name]
        lines.append(
            f"{name + ' dataset':22} {m['tokens']:12,} {m['tokens'] / r['window']:8.1f} "
            f"{m['before_kib'] / 1024:14.1f} {m['peak_kib'] / 1024:9.1f} "
            f"{(m['peak_kib'] - m['before_kib']) / 1024:17.1f}"
        )
    reset = r["small"]["reset"] and r["large"]["reset"]
    lines += [
        "",
        f"a fresh process per dataset streams {args.memory_steps} steps through Loader (one rank "
        f"of world 1, global_batch {args.global_batch}, seq_len {args.seq_len}, depth "
        f"{args.depth}: window {r['window']:,} tokens); both datasets tokenized by bytes (uint16).",
        "peak: VmHWM at the end, "
        + (
            "reset to the RSS just before opening (clear_refs 5)"
            if reset
            else "NOT reset (clear_refs refused): it includes the imports' transient peak"
        )
        + "; before: VmRSS after imports, before PreparedData.open. 1-min load average "
        f"{r['load'][0]:.1f} before, {r['load'][1]:.1f} after.",
    ]
    if r["large"]["tokens"] < 20 * r["window"]:
        lines.append("WARNING: the large dataset holds fewer than 20 windows: raise --files.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- headline


def headline(prep: dict, loader: dict, first: dict, mem: dict, args) -> dict:
    f = loader_figures(loader)
    p, o = prep["process"], prep["other"]
    ray = prep["ray"]
    rss = lambda m: round((m["peak_kib"] - m["before_kib"]) / 1024, 2)
    vs_raw = f["vs_raw"][loader["loader"]]
    return dict(
        prepare_input_mib=round(prep["corpus_bytes"] / 2**20, 2),
        prepare_tokens=p.tokens,
        prepare_process_s=round(p.seconds, 3),
        prepare_process_tokens_per_s=round(p.tokens_per_s, 1),
        prepare_process_steady_tokens_per_s=round(p.steady_tokens_per_s, 1),
        prepare_ray_s=round(o.seconds, 3) if ray else None,
        prepare_ray_tokens_per_s=round(o.tokens_per_s, 1) if ray else None,
        prepare_ray_steady_tokens_per_s=round(o.steady_tokens_per_s, 1) if ray else None,
        prepare_ray_first_unit_s=round(o.commits[0], 3) if ray else None,
        prepare_ray_init_s=round(prep["ray_init_s"], 3) if ray else None,
        prepare_ray_vs_process=round(o.tokens_per_s / p.tokens_per_s, 4) if ray else None,
        prepare_ray_vs_process_steady=(
            round(o.steady_tokens_per_s / p.steady_tokens_per_s, 4) if ray else None
        ),
        prepare_shards_bitwise_equal=prep["equal"],
        prepare_compared_with=prep["compared"],
        loader_tokens_per_s=round(f["tokens_per_s"][loader["loader"]], 1),
        raw_tokens_per_s=round(f["tokens_per_s"][loader["raw"]], 1),
        loader_vs_raw=round(vs_raw, 4),
        loader_vs_raw_paired=round(f["loader_vs_raw_paired"], 4),
        loader_blocked_us_beside_1ms_compute=round(loader["blocked_ms"] * 1e3, 1),
        goal_loader_ge_0_8_raw=vs_raw >= 0.8,
        first_batch_ms=round(statistics.median(first["times"]) * 1e3, 2),
        peak_rss_small_mib=rss(mem["small"]),
        peak_rss_large_mib=rss(mem["large"]),
        dataset_small_tokens=mem["small"]["tokens"],
        dataset_large_tokens=mem["large"]["tokens"],
        window_tokens=mem["window"],
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        steps=args.steps,
        reps=args.reps,
        cpus=os.cpu_count(),
    )


# ----------------------------------------------------------------------------- main

QUICK = dict(
    files=4,
    file_mib=0.25,
    vocab=512,
    tokenizer_sample_mib=0.25,
    seq_len=64,
    global_batch=8,
    steps=50,
    reps=3,
    first_batch_tries=3,
    memory_steps=20,
    chat_conversations=120,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--files", type=int, default=16, help="JSONL files = work units (16)")
    p.add_argument("--file-mib", type=float, default=6.0, help="MiB per JSONL file (6)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size (8192)")
    p.add_argument(
        "--tokenizer-sample-mib", type=float, default=2.0, help="text the BPE is trained on (2)"
    )
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sample (512)")
    p.add_argument("--global-batch", type=int, default=32, help="samples per step (32)")
    p.add_argument("--depth", type=int, default=2, help="loader steps read ahead (2)")
    p.add_argument("--steps", type=int, default=1000, help="loader steps per repetition (1000)")
    p.add_argument("--reps", type=int, default=7, help="loader repetitions, medians (7)")
    p.add_argument("--first-batch-tries", type=int, default=7, help="time-to-first-batch tries")
    p.add_argument("--memory-steps", type=int, default=300, help="steps per memory worker (300)")
    p.add_argument(
        "--small-windows", type=int, default=4, help="small dataset size in loader windows (4)"
    )
    p.add_argument("--ray-cpus", type=int, default=2, help="CPUs of the local Ray (2)")
    p.add_argument("--no-ray", action="store_true", help="skip Ray (compare with its UDF)")
    p.add_argument("--seed", type=int, default=0, help="corpus and sample order seed")
    p.add_argument(
        "--chat-conversations", type=int, default=600, help="part 5's chat corpus size (600)"
    )
    p.add_argument("--no-packing", action="store_true", help="skip part 5 (fine-tuning windows)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a few seconds")
    p.add_argument("--dir", default=None, help="parent of the temporary folder (system temp)")
    args = p.parse_args(argv)
    if args.quick:  # quick sizes, except where a flag was given
        for key, value in QUICK.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    positive = (
        "files",
        "vocab",
        "seq_len",
        "global_batch",
        "depth",
        "steps",
        "reps",
        "first_batch_tries",
        "memory_steps",
        "small_windows",
        "ray_cpus",
        "chat_conversations",
    )
    for key in positive:
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)}: valid: an integer >= 1")
    for key in ("file_mib", "tokenizer_sample_mib"):
        if not getattr(args, key) > 0:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)}: valid: a number > 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-data-", dir=args.dir)
    try:
        prep = part_prepare(args, work)
        print(table_prepare(prep, args), end="\n\n", flush=True)
        loader = part_loader(args, prep["process"].uri)
        print(table_loader(loader, args), end="\n\n", flush=True)
        first = part_first_batch(args, prep["process"].uri)
        print(table_first_batch(first, args), end="\n\n", flush=True)
        mem = part_memory(args, work, prep["corpus"], prep["byte"].uri)
        print(table_memory(mem, args), end="\n\n", flush=True)
        packing = {} if args.no_packing else part_packing(args, work)
        if packing:
            print(table_packing(packing, args), end="\n\n", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"work folder {work} (removed); {os.cpu_count()} CPUs")
    head = headline(prep, loader, first, mem, args)
    head.update(packing_headline(packing) if packing else {})
    print(json.dumps(head), flush=True)


if __name__ == "__main__":
    main()
