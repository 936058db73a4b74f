"""Command line: look into, check and export checkpoints.

    python -m trainer.checkpoint inspect runs/checkpoints                 # every step, valid or not
    python -m trainer.checkpoint inspect runs/checkpoints/step_000000060  # one checkpoint
    python -m trainer.checkpoint verify  s3://bucket/run/step_000000060   # + NaN/Inf; rc 1 if bad
    python -m trainer.checkpoint verify  --allow-nonfinite PATH           # checksums only
    python -m trainer.checkpoint export  runs/checkpoints/step_000000060 out/ [--dtype bfloat16]

Hugging Face checkpoints in and out are `python -m trainer.hf import|export` (trainer/hf/
__main__.py): this package never imports trainer/hf/. The old spellings here (`import-hf`,
`export --format hf`) fail with one line naming the new command.

Exit codes: 0 fine, 1 invalid/corrupt checkpoint, 2 usage or I/O error. Errors caused by the
input are one line, `error: ...`, on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from datetime import datetime
from typing import Optional

import pyarrow.fs as pafs

from trainer import storage
from trainer.checkpoint.catalog import check, list_checkpoints
from trainer.checkpoint.export import export
from trainer.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    dtype_name,
    numel_of,
    parse_step_dir,
)
from trainer.checkpoint.keys import param_name
from trainer.checkpoint.reader import CheckpointReader
from trainer.checkpoint.verify import verify
from trainer.config import ConfigError
from trainer.shell import python_m

ONE_CHECKPOINT = "a checkpoint directory (step_NNNNNNNNN)"
CHECKPOINT_OR_ROOT = f"{ONE_CHECKPOINT} or a folder holding them"


def require_dir(path: str, valid: str) -> None:
    """StorageError (exit 2, one line) unless `path` is an existing directory."""
    loc = storage.resolve(path)
    kind = loc.fs.get_file_info(loc.path).type
    if kind == pafs.FileType.NotFound:
        raise storage.StorageError(f"{path}: no such file or directory; valid: {valid}")
    if kind != pafs.FileType.Directory:
        raise storage.StorageError(f"{path}: a file, not a directory; valid: {valid}")


def _is_step_dir(path: str) -> bool:
    loc = storage.resolve(path)
    return parse_step_dir(loc.name) is not None or storage.exists(loc.child(MANIFEST))


# ----------------------------------------------------------------------------- what to show


def _model(config: dict) -> str:
    """The state's model_config as 'tiny (dim 256 x 4 layers)'."""
    if not config:
        return "- (no model_config in the state)"
    name = str(config.get("name", "?"))
    dim, layers = config.get("dim"), config.get("n_layers")
    return f"{name} (dim {dim} x {layers} layers)" if dim and layers else name


def _tokens_seen(state: dict) -> Optional[int]:
    """As recorded; for older states step x global batch x data.seq_len; else None."""
    if state.get("tokens_seen") is not None:
        return state["tokens_seen"]
    seq_len = (state.get("data") or {}).get("seq_len")
    factors = (state.get("step"), state.get("global_batch_size"), seq_len)
    if all(isinstance(f, int) and not isinstance(f, bool) for f in factors):
        return factors[0] * factors[1] * factors[2]
    return None


def _summary(path: str) -> dict:
    with CheckpointReader(path) as r:
        keys = r.keys()
        params = [k for k in keys if param_name(k) is not None]
        # The param dtype if the state records one, else what the model/* tensors are stored as.
        dtype = r.state.get("param_dtype") or "+".join(
            sorted({dtype_name(r.dtype(k), k) for k in params})
        )
        return dict(
            step=r.step,
            world_size=r.world_size,
            strategy=r.state.get("strategy", "?"),
            model_config=r.state.get("model_config") or {},
            parameters=sum(numel_of(r.shape(k)) for k in params),
            dtype=dtype or None,
            tokens_seen=_tokens_seen(r.state),
            loss=r.state.get("loss"),
            written=r.manifest["created_unix"],
            tensors=len(keys),
            bytes=sum(f["size"] for f in r.manifest["files"]),
            files=len(r.manifest["files"]),
        )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt_count(n: Optional[int]) -> str:
    """12,345,678 -> '12.3M' (a table cell); None -> '-'."""
    if n is None:
        return "-"
    if n < 1000:
        return str(n)
    x = float(n)
    for unit in ("K", "M", "B"):
        x /= 1000
        if round(x, 1) < 1000:  # 999,999 is '1.0M', not '1000.0K'
            return f"{x:.1f}{unit}"
    return f"{x / 1000:.1f}T"


def _fmt_loss(loss: Optional[float]) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def _fmt_written(unix: float, now: Optional[float] = None) -> str:
    """Local time to the minute, and how long ago: '2025-01-02 13:45 (3 min ago)'."""
    ago = (time.time() if now is None else now) - unix
    when = datetime.fromtimestamp(unix).isoformat(" ", "minutes")
    if ago < -60:
        return f"{when} (in the future: clocks differ)"
    if ago < 60:
        return f"{when} (just now)"
    if ago < 3600:
        return f"{when} ({int(ago // 60)} min ago)"
    if ago < 2 * 86400:
        return f"{when} ({int(ago // 3600)} h ago)"
    return f"{when} ({int(ago // 86400)} days ago)"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Columns two spaces apart, each as wide as its widest cell; `right`: right-aligned ones."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    ]


# ----------------------------------------------------------------------------- commands


def cmd_inspect(path: str) -> int:
    require_dir(path, CHECKPOINT_OR_ROOT)
    if not _is_step_dir(path):
        return _inspect_root(path)
    problem = check(storage.resolve(path))
    print(f"path:        {path}")
    if problem:
        print(f"valid:       NO: {problem}")
        return 1
    s = _summary(path)
    print(f"step:        {s['step']}\nworld size:  {s['world_size']}\nstrategy:    {s['strategy']}")
    print(f"model:       {_model(s['model_config'])}")
    print(f"parameters:  {s['parameters']:,} (model/* tensors; {s['tensors']} tensors in all)")
    print(f"dtype:       {s['dtype'] or '-'}")
    tokens = s["tokens_seen"]
    print(f"tokens seen: {'-' if tokens is None else f'{tokens:,}'}")
    print(f"loss:        {_fmt_loss(s['loss'])}")
    print(f"written:     {_fmt_written(s['written'])}")
    print(f"bytes:       {_fmt_bytes(s['bytes'])} in {s['files']} shard files")
    print(
        "valid:       yes (committed, every shard present with its recorded size; "
        "`verify` reads all checksums)"
    )
    return 0


def _inspect_root(path: str) -> int:
    """One line per step_* checkpoint under `path`, newest first."""
    found = list_checkpoints(path)
    if not found:
        print(f"{path}: no step_* checkpoints; valid: {CHECKPOINT_OR_ROOT}")
        return 1
    header = ["step", "world", "strategy", "model", "dtype", "tokens", "loss", "written", "valid"]
    rows = [header]
    for c in found:
        problem = c.problem
        if not problem:
            try:  # it changed since the listing, or cannot be read after all
                s = _summary(c.path)
            except (CheckpointError, OSError) as e:
                problem = str(e)
        if problem:  # its path is the row's step: say it once
            why = problem.replace(f"{c.path}: ", "").replace(f"{c.path}/", "")
            rows.append([str(c.step), *["-"] * (len(header) - 2), f"NO: {why}"])
            continue
        name = s["model_config"].get("name")
        rows.append(
            [
                str(s["step"]),
                str(s["world_size"]),
                str(s["strategy"]),
                f"{name} {_fmt_count(s['parameters'])}" if name else _fmt_count(s["parameters"]),
                s["dtype"] or "-",
                _fmt_count(s["tokens_seen"]),
                _fmt_loss(s["loss"]),
                _fmt_written(s["written"]),
                "yes",
            ]
        )
    for line in _table(rows, right={0, 1, 5, 6}):
        print(line)
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


def cmd_export(path: str, out: str, dtype) -> int:
    s = export(path, out, dtype)
    print(
        f"exported step {s['step']}: {s['tensors']} tensors, {s['parameters']:,} parameters "
        f"-> {out}/model.safetensors + config.json"
    )
    return 0


def _moved(old: str, new: list[str]) -> int:
    """The Hugging Face commands moved to `python -m trainer.hf` (this package never imports
    trainer/hf/): one line naming the command to run instead, exit 2 (a usage error)."""
    print(
        f"error: `python -m trainer.checkpoint {old}` moved; run: "
        f"{python_m('trainer.hf')} {shlex.join(new)}",
        file=sys.stderr,
    )
    return 2


def _moved_export(args) -> list[str]:
    """`export --format hf`'s arguments as `python -m trainer.hf export` takes them."""
    new = ["export", args.path, args.out]
    if args.dtype:
        new += ["--dtype", args.dtype]
    if args.max_shard_gb is not None:
        new += ["--max-shard-gb", str(args.max_shard_gb)]
    return new


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
        help="hf: moved to `python -m trainer.hf export`",
    )
    ex.add_argument(
        "--max-shard-gb", type=float, default=None, help="moved to `python -m trainer.hf export`"
    )
    im = sub.add_parser("import-hf", help="moved to `python -m trainer.hf import`")
    im.add_argument("src")
    im.add_argument("dest")
    args = ap.parse_args(argv)
    if args.cmd == "import-hf":
        return _moved("import-hf", ["import", args.src, args.dest])
    if args.cmd == "export" and args.format == "hf":
        return _moved("export --format hf", _moved_export(args))
    try:
        if args.cmd == "inspect":
            return cmd_inspect(args.path)
        if args.cmd in ("verify", "export"):
            require_dir(args.path, ONE_CHECKPOINT)
        if args.cmd == "verify":
            return cmd_verify(args.path, args.allow_nonfinite)
        return cmd_export(args.path, args.out, args.dtype)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # StorageError is an OSError; a bad URI a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
