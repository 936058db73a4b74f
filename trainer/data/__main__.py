"""Command line: look into a prepared dataset, train a tokenizer, prepare in this process.

    python -m trainer.data inspect data/prepared                 # every preparation under it
    python -m trainer.data inspect data/prepared/3f2a... --verify   # and check every shard's crc32
    (chat data: a decoded window with its loss tokens in [[...]], and the packing efficiency;
    with images, how many and their stored bytes)
    python -m trainer.data train-tokenizer data.source=corpus/ data.format=jsonl \\
        --vocab-size 32000 --out tokenizer.json
    python -m trainer.data prepare data.source=corpus/ data.tokenizer=tokenizer.json
    python -m trainer.data prepare data=chat data.source=sft.jsonl \\
        data.tokenizer=/models/Qwen2.5-0.5B-Instruct/tokenizer.json    # what data=chat trains on

`data=<option>` (chat, jsonl, parquet, text, stdlib: conf/data/) and `data.<key>=<value>`
arguments compose the fields of trainer.config.DataConfig as the training command line does
(groups.py), so a preparation made here is the one `python -m cluster.train` with the same
arguments finds. Exit codes: 0 fine, 1 a problem found (inspect --verify), 2 usage or input
error.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from trainer import storage
from trainer.config import ConfigError, DataConfig

from .chat_images import IMAGE_PAD
from .dataset import MANIFEST, DataError, PreparedData
from .groups import data_config
from .packing import efficiency
from .preparation import plan_preparation, prepare, size_text
from .sources import Counts, read_documents
from .tokenizer import load_tokenizer, train_tokenizer
from .window_images import has_images

PAD_RUN = re.compile(f"(?:{re.escape(IMAGE_PAD)}){{2,}}")
"""A run of image placeholders, shown by inspect as one with its count."""


def cmd_inspect(path: str, verify: bool) -> int:
    root = storage.resolve(path)
    if storage.exists(root.child(MANIFEST)):
        return _inspect_one(path, verify)
    found = sorted(
        n
        for n, i in storage.list_dir(root).items()
        if storage.exists(root.child(n).child(MANIFEST))
    )
    if not found:
        print(f"{path}: no prepared data (no {MANIFEST} in it or in a folder below it)")
        return 2
    rc = 0
    for name in found:
        rc = max(rc, _inspect_one(str(root.child(name)), verify))
        print()
    return rc


def _inspect_one(path: str, verify: bool) -> int:
    data = PreparedData.open(path)
    m = data.manifest
    tok = m.tokenizer
    print(f"prepared:   {path}\ndigest:     {m.digest}")
    print(
        f"tokenizer:  {tok['name']} (vocabulary {tok['vocab_size']:,}, end of document "
        f"{tok['eod_id']}, "
        f"tokens stored as {m.dtype})"
    )
    print(f"settings:   {m.settings}")
    for i, s in enumerate(m.sources):
        print(
            f"source {i}:   {s.name} ({s.format}, {s.files:,} files, {size_text(s.input_bytes)} in)"
        )
        for split, index in s.splits.items():
            if index.shards:
                print(
                    f"  {split:5}     {index.documents:>12,} documents {index.tokens:>14,} tokens "
                    f"in {len(index.shards)} shards"
                )
        if s.skipped:
            print(f"  skipped   {', '.join(f'{k} {v:,}' for k, v in sorted(s.skipped.items()))}")
    if data.width is None:
        _print_sample(data)
    else:
        _print_window(data)
    if verify:
        problems = data.verify()
        for p in problems:
            print(f"  PROBLEM: {p}")
        print(
            "verify:     "
            + (f"{len(problems)} problem(s)" if problems else "every shard's crc32 matches")
        )
        return 1 if problems else 0
    return 0


def _print_sample(data: PreparedData, tokens: int = 64) -> None:
    stream = data.stream(0, "train")
    ids = stream.read(0, min(tokens, len(stream)))
    try:
        tok = load_tokenizer(data.manifest.tokenizer["name"])
        text = tok.decode(ids)
    except ConfigError as e:
        text = f"(tokenizer not readable here: {e})"
    print(
        f"sample:     first {len(ids)} tokens of source 0: {ids[:16].tolist()}...\n"
        f"            decoded: {text!r}"
    )


def _print_window(data: PreparedData, chars: int = 2000) -> None:
    """Chat: window 0 decoded with its loss tokens in [[...]], and real tokens per slot."""
    shards = [sh for s in data.manifest.sources for sp in s.splits.values() for sh in sp.shards]
    slots = sum(sh.tokens for sh in shards)
    real = sum(sh.real_tokens for sh in shards)
    windows = sum(sh.windows for sh in shards)
    print(
        f"layout:     {windows:,} windows of {data.width} tokens, packing efficiency "
        f"{efficiency(real, slots):.1%} ({real:,} real tokens in {slots:,} slots)"
    )
    if has_images(data):
        files = [sh.files for sh in shards if "pixels" in sh.files]
        images = sum(f["images"]["n"] // 4 for f in files)
        stored = sum(f["pixels"]["nbytes"] for f in files)
        print(
            f"images:     {images:,} in the windows of {len(files)} shard(s), "
            f"{size_text(stored)} stored (resized RGB, 3 bytes a pixel)"
        )
    ids = data.stream(0, "train").read(0, data.width)
    mask = data.extra_stream("mask", 0, "train").read(0, data.width)
    try:
        tok = load_tokenizer(data.manifest.tokenizer["name"], data.manifest.tokenizer["eod_token"])
    except ConfigError as e:
        print(f"sample:     (tokenizer not readable here: {e})")
        return
    pieces, start = [], 0
    for end in range(1, len(ids) + 1):  # runs of equal mask, decoded together
        if end == len(ids) or mask[end] != mask[start]:
            text = tok.decode(ids[start:end])
            pieces.append(f"[[{text}]]" if mask[start] else text)
            start = end
    text = PAD_RUN.sub(_pad_run, "".join(pieces))
    more = f"... ({len(text) - chars:,} more characters)" if len(text) > chars else ""
    print(f"sample:     window 0 of source 0, loss tokens in [[...]]:\n{text[:chars]}{more}")


def _pad_run(match: re.Match) -> str:
    return f"{IMAGE_PAD} x {len(match.group()) // len(IMAGE_PAD)}"


def cmd_train_tokenizer(cfg: DataConfig, vocab_size: int, out: str, max_docs: int) -> int:
    out_loc = output_location(out)  # before the training: a bad --out fails in a second
    plan = plan_preparation(dataclasses.replace(cfg, tokenizer="byte"))
    counts = Counts()

    def documents():
        n = 0
        for source_files, spec in zip(plan.files, cfg.sources()):
            for f in source_files:
                for doc in read_documents(f, spec.text_column, counts):
                    yield doc
                    n += 1
                    if max_docs and n >= max_docs:
                        return

    model = train_tokenizer(documents(), vocab_size)
    storage.write_atomic(out_loc, model.to_str().encode())
    print(
        f"tokenizer: {model.get_vocab_size():,} tokens (asked {vocab_size:,}) from "
        f"{counts.get('documents', 0):,} documents -> {out}"
    )
    return 0


def output_location(out: str) -> storage.Location:
    """--out resolved, its folder created (local: every missing parent); an OSError naming the
    folder and what is valid when it cannot be."""
    loc = storage.resolve(out)
    folder = loc.path.rpartition("/")[0]
    if not folder:
        return loc
    try:
        loc.fs.create_dir(folder, recursive=True)
    except OSError as e:
        raise OSError(
            f"--out={out}: cannot create its folder {folder} ({e}); valid: a path or URI "
            "whose folder exists or can be created"
        ) from None
    return loc


def cmd_prepare(cfg: DataConfig) -> int:
    info = prepare(cfg)
    state = "prepared now" if info.created else "already prepared"
    print(
        f"data: {info.num_tokens:,} tokens, {info.num_documents:,} documents from "
        f"{info.num_files:,} files in {info.uri} ({state})"
    )
    if cfg.eval_fraction is None:  # data=chat's: what a run that never evaluates reads
        print(
            "data: nothing held out for evaluation (data.eval_fraction=null holds out 0.01 only "
            "for a run with train.eval_every > 0; add data.eval_fraction=0.01 to prepare that "
            "run's data)"
        )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="documents, tokens, shards, vocabulary, a decoded sample")
    ins.add_argument("path")
    ins.add_argument("--verify", action="store_true", help="read every shard and check its crc32")
    tt = sub.add_parser("train-tokenizer", help="a byte-level BPE tokenizer.json from a source")
    tt.add_argument("data", nargs="+", help="data=<option>, data.source=..., other data.*")
    tt.add_argument("--vocab-size", type=int, required=True)
    tt.add_argument("--out", required=True, help="where to write tokenizer.json (path or URI)")
    tt.add_argument("--max-documents", type=int, default=0, help="train on the first N (0 = all)")
    pr = sub.add_parser("prepare", help="tokenize into data.prepared_dir, in this process")
    pr.add_argument("data", nargs="+", help="data=<option>, data.source=..., other data.*")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "inspect":
            return cmd_inspect(args.path, args.verify)
        if args.cmd == "train-tokenizer":
            return cmd_train_tokenizer(
                data_config(args.data), args.vocab_size, args.out, args.max_documents
            )
        return cmd_prepare(data_config(args.data))
    except (ConfigError, DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
