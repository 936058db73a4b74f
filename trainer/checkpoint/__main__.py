"""Command line: look into, check and export checkpoints.

    python -m trainer.checkpoint inspect runs/checkpoints                 # every step, valid or not
    python -m trainer.checkpoint inspect runs/checkpoints/step_000000060  # one checkpoint
    python -m trainer.checkpoint verify  s3://bucket/run/step_000000060   # + NaN/Inf; rc 1 if bad
    python -m trainer.checkpoint verify  --allow-nonfinite PATH           # checksums only
    python -m trainer.checkpoint export  runs/checkpoints/step_000000060 out/ [--dtype bfloat16]
    python -m trainer.checkpoint export  runs/checkpoints/step_000000060 hf/ --format hf
    python -m trainer.checkpoint import-hf /models/Llama-3.2-1B/ runs/my-run/checkpoints/

Exit codes: 0 fine, 1 invalid/corrupt checkpoint, 2 usage or I/O error. Errors caused by the
input are one line, `error: ...`, on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import sys

from trainer import storage
from trainer.checkpoint.catalog import check, list_checkpoints
from trainer.checkpoint.export import export
from trainer.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    dtype_from_name,
    numel_of,
    parse_step_dir,
)
from trainer.checkpoint.keys import param_name
from trainer.checkpoint.reader import CheckpointReader
from trainer.checkpoint.verify import verify
from trainer.config import ConfigError
from trainer.hf import export_hf, import_hf


def _is_step_dir(path: str) -> bool:
    loc = storage.resolve(path)
    return parse_step_dir(loc.name) is not None or storage.exists(loc.child(MANIFEST))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _summary(path: str) -> dict:
    with CheckpointReader(path) as r:
        keys = r.keys()
        params = sum(numel_of(r.shape(k)) for k in keys if param_name(k) is not None)
        return dict(
            step=r.step,
            world_size=r.world_size,
            strategy=r.state.get("strategy", "?"),
            parameters=params,
            tensors=len(keys),
            bytes=sum(f["size"] for f in r.manifest["files"]),
            files=len(r.manifest["files"]),
        )


def cmd_inspect(path: str) -> int:
    if not _is_step_dir(path):
        found = list_checkpoints(path)
        if not found:
            print(f"{path}: no step_* checkpoints")
            return 1
        print(
            f"{'step':>10}  {'world':>5}  {'strategy':<14} {'parameters':>14}  {'bytes':>10}  valid"
        )
        for c in found:
            problem = c.problem
            if not problem:
                try:  # it changed since the listing, or cannot be read after all
                    s = _summary(c.path)
                except (CheckpointError, OSError) as e:
                    problem = str(e)
            if problem:
                print(f"{c.step:>10}  {'-':>5}  {'-':<14} {'-':>14}  {'-':>10}  NO: {problem}")
                continue
            print(
                f"{c.step:>10}  {s['world_size']:>5}  {s['strategy']:<14} {s['parameters']:>14,}"
                f"  {_fmt_bytes(s['bytes']):>10}  yes"
            )
        return 0
    problem = check(storage.resolve(path))
    print(f"path:        {path}")
    if problem:
        print(f"valid:       NO: {problem}")
        return 1
    s = _summary(path)
    print(f"step:        {s['step']}\nworld size:  {s['world_size']}\nstrategy:    {s['strategy']}")
    print(f"parameters:  {s['parameters']:,} (model/* tensors; {s['tensors']} tensors in all)")
    print(f"bytes:       {_fmt_bytes(s['bytes'])} in {s['files']} shard files")
    print(
        "valid:       yes (committed, every shard present with its recorded size; "
        "`verify` reads all checksums)"
    )
    return 0


def cmd_verify(path: str, allow_nonfinite: bool = False) -> int:
    problems = verify(path, check_finite=not allow_nonfinite)
    if problems:
        print(f"{path}: {len(problems)} problem(s):")
        for p in problems:
            print(f"  - {p}")
        return 1
    finite = "" if allow_nonfinite else ", no NaN/Inf"
    print(f"{path}: OK (every block checksum matches, every tensor fully covered{finite})")
    return 0


def cmd_export(path: str, out: str, dtype, fmt: str, max_shard_gb: float) -> int:
    if fmt == "hf":
        torch_dtype = dtype_from_name(dtype, "--dtype") if dtype else None
        export_hf(path, out, torch_dtype, int(max_shard_gb * 2**30))
        return 0
    s = export(path, out, dtype)
    print(
        f"exported step {s['step']}: {s['tensors']} tensors, {s['parameters']:,} parameters "
        f"-> {out}/model.safetensors + config.json"
    )
    return 0


def cmd_import_hf(src: str, dest: str) -> int:
    path = import_hf(src, dest)
    print(
        f"imported {src} -> {path} (step 0; train with the same cluster.run_name to start from it)"
    )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect", help="a checkpoint, or every checkpoint under a root").add_argument(
        "path"
    )
    ve = sub.add_parser("verify", help="read and check every block checksum, and for NaN/Inf")
    ve.add_argument("path")
    ve.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="do not report NaN/Inf in floating tensors (checksums and coverage only)",
    )
    ex = sub.add_parser("export", help="consolidated model weights as safetensors + config.json")
    ex.add_argument("path")
    ex.add_argument("out", help="local output directory")
    ex.add_argument(
        "--dtype", default=None, help="cast weights, e.g. bfloat16 (default: as stored, fp32)"
    )
    ex.add_argument(
        "--format",
        default="native",
        choices=["native", "hf"],
        help="hf: transformers' Llama layout (config.json, model*.safetensors, index, "
        "tokenizer files), loadable by transformers and vLLM",
    )
    ex.add_argument(
        "--max-shard-gb",
        type=float,
        default=5.0,
        help="--format hf: safetensors files of at most this many GiB",
    )
    im = sub.add_parser("import-hf", help="a step-0 checkpoint of a Hugging Face Llama model")
    im.add_argument("src", help="folder or URI with config.json and model*.safetensors")
    im.add_argument("dest", help="a run's checkpoints folder, e.g. runs/my-run/checkpoints")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "inspect":
            return cmd_inspect(args.path)
        if args.cmd == "verify":
            return cmd_verify(args.path, args.allow_nonfinite)
        if args.cmd == "import-hf":
            return cmd_import_hf(args.src, args.dest)
        return cmd_export(args.path, args.out, args.dtype, args.format, args.max_shard_gb)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # StorageError is an OSError; a bad URI a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
