"""Checkpoint save/load throughput against the raw speed of the same disk, and async blocking.

    python -m benchmarks.checkpoint                 # ~2 GB checkpoint in a temp dir under ./runs
    python -m benchmarks.checkpoint --quick         # 256 MB
    python -m benchmarks.checkpoint --size-gb 8 --dir /mnt/nvme/tmp

Measured in one run, on one disk, one rank (the per-rank path; N ranks write N such files):
- raw write: the same bytes written sequentially in 4 MiB writes + fsync (what `dd` would do);
- save (sync): CheckpointWriter(async_save=False).save() end to end: host copy, crc32 per
  block, write, fsync, commit (chunk table + manifest) and retention; the first save of a
  writer also allocates (page-faults) its staging buffer, later ones reuse it;
- save (async): the time save() blocks the loop (the host copy only), first and steady state,
  and the total until wait() returns. Headline ratios use the steady state (second save).
- raw read vs load: read_full() of every tensor (all checksums verified), and a reshard load
  that reads the ranges 3 ranks would need, via ranged reads. The raw read is given twice: into
  one reused buffer (the disk/page-cache speed) and into new tensors (what any loader pays, as
  fresh memory must be faulted in).
Every measurement is repeated (--rounds) with the raw baseline interleaved, and the best time
counts: the disk of a shared machine drifts by 3x between identical writes.
The page cache cannot be dropped without root, so reads may be served from memory for the raw
read and the load alike; the read ratio compares like with like, the absolute read figures may
flatter the disk. The last line is one JSON object of the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

from trainer.checkpoint import CheckpointReader, CheckpointWriter, TensorChunk

IO_BLOCK = 4 * 2**20


def make_tensors(size_bytes: int) -> dict[str, torch.Tensor]:
    """A model-like mix: large fp32 matrices (64 MiB) plus many small bf16 vectors."""
    g = torch.Generator().manual_seed(0)
    out, total, i = {}, 0, 0
    while total < size_bytes:
        n = min(16 * 2**20, (size_bytes - total) // 4) or 1
        out[f"model/layers.{i}.weight"] = torch.rand(n, generator=g)
        out[f"model/layers.{i}.norm"] = torch.rand(4096, generator=g).to(torch.bfloat16)
        total += n * 4 + 4096 * 2
        i += 1
    return out


def chunks_of(tensors: dict[str, torch.Tensor], rank: int = 0, world: int = 1) -> list[TensorChunk]:
    out = []
    for k, t in tensors.items():
        lo, hi = rank * t.numel() // world, (rank + 1) * t.numel() // world
        out.append(TensorChunk(k, tuple(t.shape), t.dtype, lo, t.reshape(-1)[lo:hi]))
    return out


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def raw_write(path: str, tensors: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in tensors.values():
            mv = memoryview(t.view(torch.uint8).numpy())
            for i in range(0, len(mv), IO_BLOCK):
                f.write(mv[i : i + IO_BLOCK])
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: str) -> None:
    buf = bytearray(IO_BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def raw_read_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """What any loader pays at least: the bytes land in freshly allocated tensors."""
    with open(path, "rb", buffering=0) as f:
        for t in tensors.values():
            out = torch.empty_like(t)
            f.readinto(memoryview(out.view(torch.uint8).numpy()))


def load_all(path: str, tensors) -> None:
    reader = CheckpointReader(path)
    for k in tensors:
        reader.read_full(k)


def load_resharded(path: str, tensors, world: int) -> None:
    reader = CheckpointReader(path)
    for rank in range(world):
        for c in chunks_of(tensors, rank, world):
            reader.read(c.key, c.start, c.numel)


ROWS = [
    ("raw", "raw sequential write + fsync"),
    ("raw_read", "raw sequential read (one 4 MiB buffer)"),
    ("raw_tensors", "raw sequential read into new tensors"),
    ("sync", "save, sync (the loop is blocked throughout)"),
    ("blocked", "save, async: the loop is blocked"),
    ("async", "save, async: until committed (wait)"),
    ("load", "load, read_full of every tensor"),
    ("reshard", "load, resharded to 3 ranks (ranged reads)"),
]


def one_round(
    step: int, tensors, workdir: str, sync: CheckpointWriter, background: CheckpointWriter
) -> dict[str, float]:
    """Each measurement once; the raw baseline is interleaved so disk drift hits all alike."""
    t = {}
    raw = os.path.join(workdir, "raw.bin")
    t["raw"], _ = timed(lambda: raw_write(raw, tensors))
    t["raw_read"], _ = timed(lambda: raw_read(raw))
    t["raw_tensors"], _ = timed(lambda: raw_read_tensors(raw, tensors))
    os.remove(raw)
    t["sync"], _ = timed(lambda: sync.save(step, 0, 1, chunks_of(tensors), {}))
    t0 = time.perf_counter()
    background.save(step, 0, 1, chunks_of(tensors), {})
    t["blocked"] = time.perf_counter() - t0
    path = background.wait()
    t["async"] = time.perf_counter() - t0
    t["load"], _ = timed(lambda: load_all(path, tensors))
    t["reshard"], _ = timed(lambda: load_resharded(path, tensors, 3))
    return t


def run(size_gb: float, workdir: str, rounds: int) -> dict:
    tensors = make_tensors(int(size_gb * 2**30))
    gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30
    sync = CheckpointWriter(os.path.join(workdir, "sync"), keep=1, async_save=False)
    background = CheckpointWriter(os.path.join(workdir, "async"), keep=1, async_save=True)
    results = [one_round(r + 1, tensors, workdir, sync, background) for r in range(rounds)]
    sync.close()
    background.close()
    best = {k: min(r[k] for r in results) for k, _ in ROWS}
    # Round 1's blocked time includes allocating the staging buffer; later rounds reuse it.
    steady_blocked = min(r["blocked"] for r in results[1:]) if rounds > 1 else results[0]["blocked"]

    print(
        f"checkpoint benchmark: {gb:.2f} GiB in {len(tensors)} tensors, one rank, {rounds} "
        f"rounds, dir {workdir}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'what':<44}"
        + "".join(f" {'round ' + str(i + 1) + ' s':>10}" for i in range(rounds))
        + f" {'best GiB/s':>11}"
    )
    for k, what in ROWS:
        print(
            f"{what:<44}" + "".join(f" {r[k]:>10.3f}" for r in results) + f" {gb / best[k]:>11.2f}"
        )
    print(
        "round 1 includes each writer's first save (staging buffer allocated); later rounds "
        "reuse it. Reads may hit the page cache (it cannot be dropped here), raw and load alike."
    )
    return dict(
        size_gib=round(gb, 3),
        save_vs_raw_write=round(best["raw"] / best["sync"], 3),
        async_save_vs_raw_write=round(best["raw"] / best["async"], 3),
        load_vs_raw_read=round(best["raw_read"] / best["load"], 3),
        reshard_load_vs_raw_read=round(best["raw_read"] / best["reshard"], 3),
        load_vs_raw_read_into_tensors=round(best["raw_tensors"] / best["load"], 3),
        async_blocked_vs_sync=round(steady_blocked / best["sync"], 3),
        first_async_blocked_vs_sync=round(results[0]["blocked"] / results[0]["sync"], 3),
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (default 2)")
    ap.add_argument("--quick", action="store_true", help="256 MB instead")
    ap.add_argument("--rounds", type=int, default=3, help="repetitions; best time counts (3)")
    ap.add_argument("--dir", default="runs", help="parent of the temp dir (the disk measured)")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir)
    try:
        ratios = run(0.25 if args.quick else args.size_gb, workdir, args.rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
