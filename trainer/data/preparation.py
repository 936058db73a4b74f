"""Preparation: sources -> token shards + manifest, once, in independent work units.

    info = prepare(cfg.data)                      # in this process
    info = prepare(cfg.data, runner=ray_runner)   # the same units as Ray Data tasks (cluster/)

1. `plan_preparation` (planning.py) lists every source's files, loads the tokenizer and cuts
   the files into work units; the digest of the listing, the tokenizer and the settings names
   the preparation's folder, `<prepared_dir>/<digest[:16]>/` (DESIGN.md inv. 2).
2. Each unit is tokenized by `process_unit` (units.py) into its own shard per split, then a
   small record file that commits the unit; a unit whose record exists is skipped, so a
   preparation that died resumes where it stopped.
3. The manifest, assembled from the unit records in unit order, is written last: the commit
   (here).

checks.py holds what a driver checks of a plan before any worker starts (`plan_and_check`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from trainer import storage
from trainer.config import ConfigError, DataConfig

from . import chat as chatlib
from .chat_images import IMAGE_TOKENS
from .checks import check_vocab as check_vocab  # re-exported: trainer/data/splits.py
from .dataset import (
    MANIFEST,
    SPLITS,
    STREAM,
    Manifest,
    ShardInfo,
    SourceIndex,
    SplitIndex,
    positions_dtype,
    unit_record_name,
)
from .planning import UNIT_BYTES as UNIT_BYTES  # re-exported: tests/data/test_chat_prepare.py
from .planning import Plan, WorkUnit, plan_preparation
from .planning import on_ray_data as on_ray_data  # re-exported: cluster/
from .sources import Counts
from .units import _held_out as _held_out  # re-exported: tests/trainer/test_loop.py
from .units import process_unit


@dataclass
class PreparedInfo:
    """What `prepare` produced (or found). `uri` is absolute: pass it to workers."""

    uri: str
    digest: str
    num_tokens: int
    num_documents: int
    num_files: int
    num_shards: int
    created: bool
    """True if this call wrote the manifest; False if the preparation was complete already."""
    skipped: dict = field(default_factory=dict)


IMAGE_TOKEN_KEYS = ("image_token", "vision_start", "vision_end")
"""The manifest's tokenizer names the image tokens' ids image_token_id, vision_start_id and
vision_end_id (as Qwen2-VL's config.json does) when the preparation has an image processor."""

Runner = Callable[[Plan, list[WorkUnit]], list[dict]]
"""runner(plan, units) -> the units' records, in any order (cluster/ has one on Ray Data)."""


def run_in_process(plan: Plan, units: list[WorkUnit], log=print) -> list[dict]:
    """The units one after another in this process, with a progress line every few seconds."""
    args, records, start, shown = plan.unit_args(), [], time.monotonic(), 0.0
    total = sum(u.input_bytes for u in units)
    done_bytes = 0
    for i, unit in enumerate(units):
        records.append(process_unit(unit, args, plan.tokenizer))
        done_bytes += unit.input_bytes
        now = time.monotonic()
        if now - shown > 5 or i == len(units) - 1:
            shown = now
            rate = done_bytes / max(now - start, 1e-9)
            log(
                f"prepare: {i + 1}/{len(units)} units, {size_text(done_bytes)} of "
                f"{size_text(total)} of input ({size_text(rate)}/s)"
            )
    return records


def size_text(nbytes: float) -> str:
    """A size as people read it: '10.3 KiB', '2.0 GiB' (a chat corpus of a few hundred
    conversations is well under the 0.05 MiB that a fixed MiB figure shows as 0.0)."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:,.0f} bytes" if unit == "bytes" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    return ""  # not reached


def find_prepared(plan: Plan) -> Optional[Manifest]:
    """The committed manifest of this plan's digest, if complete (every shard of its size)."""
    try:
        manifest = Manifest.from_json(storage.read_bytes(plan.root.child(MANIFEST)), str(plan.root))
    except FileNotFoundError:
        return None
    listing = storage.list_dir(plan.root)
    for source in manifest.sources:
        for split in source.splits.values():
            for shard in split.shards:
                for f in [shard] + [shard.extra(k) for k in shard.files]:
                    info = listing.get(f.name)
                    if info is None or info.size != f.nbytes:
                        return None
    return manifest


def prepare(
    cfg: DataConfig, runner: Optional[Runner] = None, log=print, plan: Optional[Plan] = None
) -> PreparedInfo:
    """Prepare `cfg`'s sources once: nothing is done when the same preparation is complete."""
    plan = plan or plan_preparation(cfg)
    if plan.prepared is not None:
        return plan.prepared
    if plan.template is not None and plan.template.note:
        log(f"prepare: {plan.template.note}")
    manifest = find_prepared(plan)
    created = manifest is None
    if manifest is None:
        records = _run_units(plan, runner, log)
        manifest = assemble(plan, _all_records(plan, records))
        storage.write_atomic(plan.root.child(MANIFEST), manifest.to_json())
    info = _info(plan, manifest, created)
    if info.skipped:
        log(
            "prepare: records skipped: "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(info.skipped.items()))
        )
    plan.prepared = info
    return info


def _run_units(plan: Plan, runner: Optional[Runner], log) -> list[dict]:
    """The records of the units not done yet, done now. When the input is refused (a
    ConfigError from a unit: a missing image, say) the folder this call created is removed, so
    nothing of a refused preparation remains."""
    fresh = not storage.exists(plan.root)
    plan.root.fs.create_dir(plan.root.path, recursive=True)
    listing = storage.list_dir(plan.root)
    done = {n for n in listing if n.endswith(".done.json")}
    todo = [u for u in plan.units if unit_record_name(plan.digest, u.source, u.index) not in done]
    if len(todo) < len(plan.units):
        log(
            f"prepare: resuming {plan.root}: {len(plan.units) - len(todo)} of "
            f"{len(plan.units)} units are done already"
        )
    try:
        return runner(plan, todo) if runner else run_in_process(plan, todo, log)
    except ConfigError:
        if fresh:
            storage.delete_dir(plan.root)
        raise


def _all_records(plan: Plan, fresh: list[dict]) -> list[dict]:
    """Every unit's record: the fresh ones, and those a previous run committed."""
    by_key = {(r["source"], r["unit"]): r for r in fresh}
    out = []
    for u in plan.units:
        r = by_key.get((u.source, u.index))
        if r is None:
            loc = plan.root.child(unit_record_name(plan.digest, u.source, u.index))
            r = json.loads(storage.read_bytes(loc))
        out.append(r)
    return out


def assemble(plan: Plan, records: list[dict]) -> Manifest:
    """The manifest of the unit records, in unit order; an empty source is a ConfigError."""
    sources = []
    for i, spec in enumerate(plan.cfg.sources()):
        mine = [r for r in records if r["source"] == i]
        splits = {
            s: SplitIndex([ShardInfo(**r["shards"][s]) for r in mine if s in r["shards"]])
            for s in SPLITS
        }
        counts = Counts()
        for r in mine:
            for k, v in r["counts"].items():
                counts.add(k, v)
        documents = counts.pop("documents", 0)
        if splits["train"].tokens < 2:
            key = f"data.mix[{i}].path" if plan.cfg.mix else "data.source"
            raise ConfigError(
                f"invalid config: {key}={spec.path!r} holds no usable document "
                f"({documents} read, skipped: {dict(counts) or 'none'}); valid: a "
                "source with text"
            )
        sources.append(
            SourceIndex(
                spec.path,
                spec.format,
                plan.cfg.messages_column if plan.is_chat else spec.text_column,
                files=sum(r["files"] for r in mine),
                input_bytes=sum(r["input_bytes"] for r in mine),
                splits=splits,
                skipped=dict(counts),
            )
        )
    tok = plan.tokenizer
    layout = dict(STREAM)
    if plan.is_chat:
        width = plan.cfg.seq_len + 1
        layout = {"kind": "windows", "width": width, "positions_dtype": positions_dtype(width).name}
    manifest = Manifest(
        plan.digest, tokenizer_info(plan), tok.dtype.name, sources, plan.settings, time.time()
    )
    manifest.layout = layout
    return manifest


def tokenizer_info(plan: Plan) -> dict:
    """The manifest's tokenizer: name, digest, vocab_size, eod_id, eod_token; and, when a
    tokenizer_config.json or a chat template is known, what generation and the export need."""
    tok = plan.tokenizer
    info = {
        "name": tok.name,
        "digest": tok.digest,
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
        "eod_token": getattr(tok, "eod_token", None),
    }
    if plan.tokenizer_config is None and plan.template is None:
        return info
    config = plan.tokenizer_config or {}
    named = chatlib.special_tokens(config)

    def id_of(token: Optional[str]) -> Optional[int]:
        return tok.model.token_to_id(token) if token is not None else None

    eos, eot = named.get("eos_token"), plan.eot_token
    stop_ids = []
    for i in (id_of(eot), id_of(eos), tok.eod_id):
        if i is not None and i not in stop_ids:
            stop_ids.append(i)
    if plan.images is not None:  # what the model and generation need to place images
        info.update({f"{k}_id": id_of(t) for k, t in zip(IMAGE_TOKEN_KEYS, IMAGE_TOKENS)})
    info.update(
        chat_template=plan.template.text if plan.template else None,
        tokenizer_config=plan.tokenizer_config,
        bos_token=named.get("bos_token"),
        bos_id=id_of(named.get("bos_token")),
        eos_token=eos,
        eot_token=eot,
        stop_ids=stop_ids,
    )
    return info


def _info(plan: Plan, manifest: Manifest, created: bool) -> PreparedInfo:
    skipped = Counts()
    for s in manifest.sources:
        for k, v in s.skipped.items():
            skipped.add(k, v)
    return PreparedInfo(
        uri=str(plan.root),
        digest=plan.digest,
        num_tokens=sum(sp.tokens for s in manifest.sources for sp in s.splits.values()),
        num_documents=sum(sp.documents for s in manifest.sources for sp in s.splits.values()),
        num_files=sum(s.files for s in manifest.sources),
        num_shards=sum(len(sp.shards) for s in manifest.sources for sp in s.splits.values()),
        created=created,
        skipped=dict(skipped),
    )
