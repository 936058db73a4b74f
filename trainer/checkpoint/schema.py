"""The manifest's schema: every field a reader trusts, with its JSON type and its bounds.

A manifest that passes its own crc32 can still be incomplete or extreme (edited by hand, written
by a buggy or hostile tool): no `files`, `step` 1e30, a shard named '../x'. Everything that resume,
`inspect` and `verify` index, compare or size an allocation from is checked here first, so such a
checkpoint is skipped with a reason (CheckpointError naming the field, the value and what is
valid) instead of crashing with a KeyError, a TypeError or a MemoryError, or resuming wrongly.

    check_manifest(body, where, dir_step)     # read_manifest runs it on every manifest it reads
    check_rows(rows, body, where)             # load_rows runs it on the decoded chunk table
"""

from __future__ import annotations

import binascii
import math
from base64 import b64decode
from typing import Optional

from trainer.checkpoint.format import CheckpointError, ChunkRow
from trainer.checkpoint.trainer_state import TRAINER_MARK, Kind, TrainerState

INT64_MAX = 2**63 - 1
"""Steps, sizes and counts are int64 in the chunk table and in torch: nothing larger is real."""


def check_manifest(body, where: str, dir_step: Optional[int]) -> None:
    """CheckpointError unless `body` (a decoded manifest) has every field with its type and
    bounds; `dir_step`: the step its step_NNNNNNNNN directory name says (None: not so named)."""
    _expect(isinstance(body, dict), where, "body", body, "a JSON object")
    step = _int(body, "step", where, 0)
    if dir_step is not None and step != dir_step:
        raise CheckpointError(
            f"{where}: manifest is for step {step}, the directory name says {dir_step}; "
            "valid: the step of its step_NNNNNNNNN directory"
        )
    world = _int(body, "world_size", where, 1)
    _number(body, "created_unix", where, 0.0)
    names = _check_files(_get(body, "files", where, "a list of {name, size, rank}"), world, where)
    table = _get(body, "chunk_table", where, "an object {name, size, crc32, rows}")
    _expect(isinstance(table, dict), where, "chunk_table", table, "an object")
    table_name = _file_name(table, "chunk_table", where)
    _expect(table_name not in names, where, "chunk_table.name", table_name, "not a shard's name")
    _int(table, "size", where, 0, prefix="chunk_table.")
    _int(table, "crc32", where, 0, 2**32 - 1, prefix="chunk_table.")
    _int(table, "rows", where, 0, prefix="chunk_table.")
    state = _get(body, "state", where, "an object (the trainer state)")
    _expect(isinstance(state, dict), where, "state", state, "an object")
    check_state(state, step, where)


def check_state(state: dict, step: int, where: str) -> None:
    """Each key of TrainerState, when present, holds the JSON its Kind says; a trainer's state
    (one with a model_digest) has the required ones; its step is the manifest's."""
    kinds = TrainerState.kinds()
    if TRAINER_MARK in state:
        for key in (k for k, kind in kinds.items() if kind.required):
            _get(state, key, where, "present in a trainer's state", prefix="state.")
    for key, kind in kinds.items():
        if key in state:
            _check_kind(state, key, kind, where)
    if "step" in state:
        _expect(state["step"] == step, where, "state.step", state["step"], f"{step} (as 'step')")


def _check_kind(state: dict, key: str, kind: Kind, where: str) -> None:
    v, field = state[key], f"state.{key}"
    if v is None and (kind.null or (kind.null_when and state.get(kind.null_when))):
        return
    or_null = " or null" if kind.null else ""
    if kind.json == "int":
        ok = isinstance(v, int) and not isinstance(v, bool) and kind.lo <= v <= INT64_MAX
        _expect(ok, where, field, v, f"an integer in [{kind.lo}, {INT64_MAX}]{or_null}")
    elif kind.json == "number":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        at_least = f" >= {kind.lo}" if kind.lo > -math.inf else ""
        _expect(ok and v >= kind.lo, where, field, v, f"a finite number{at_least}{or_null}")
    elif kind.json == "object":
        _expect(isinstance(v, dict), where, field, v, f"an object{or_null}")
    else:  # a string, or a string of base64
        _expect(isinstance(v, str), where, field, v, f"a string{or_null}")
        if kind.json == "base64":
            try:
                b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                _expect(False, where, field, v, "base64 (torch's RNG state)")


def check_rows(rows: list[ChunkRow], body: dict, where: str) -> None:
    """Each chunk lies in the file of its rank, inside the size the manifest lists for it."""
    files = {f["name"]: f for f in body["files"]}
    world = body["world_size"]
    if len(rows) != body["chunk_table"]["rows"]:
        raise CheckpointError(
            f"{where}: {len(rows)} rows, the manifest's chunk_table.rows says "
            f"{body['chunk_table']['rows']}; valid: the same count"
        )
    for r in rows:
        if not 0 <= r.rank < world:
            raise CheckpointError(
                f"{where}: {r.describe()}: rank={r.rank}; valid: 0..{world - 1} (world_size)"
            )
        f = files.get(r.file)
        if f is None or f["rank"] != r.rank:
            raise CheckpointError(
                f"{where}: {r.describe()}: file={r.file!r} is not rank {r.rank}'s shard; valid: "
                f"{', '.join(sorted(n for n, g in files.items() if g['rank'] == r.rank))}"
            )
        if r.offset + r.nbytes > f["size"]:
            raise CheckpointError(
                f"{where}: {r.describe()} lies outside the listed shard files (bytes "
                f"[{r.offset}, {r.offset + r.nbytes}) of a file of {f['size']} bytes)"
            )


# ----------------------------------------------------------------------------- helpers


def _check_files(files, world: int, where: str) -> set[str]:
    _expect(isinstance(files, list), where, "files", files, "a list of {name, size, rank}")
    if len(files) != world:
        raise CheckpointError(
            f"{where}: manifest world_size={world} but 'files' lists {len(files)} shard "
            "file(s); valid: one file per rank"
        )
    names, ranks = set(), set()
    for i, f in enumerate(files):
        field = f"files[{i}]"
        _expect(isinstance(f, dict), where, field, f, "an object {name, size, rank}")
        name = _file_name(f, field, where)
        _int(f, "size", where, 0, prefix=f"{field}.")
        rank = _int(f, "rank", where, 0, world - 1, prefix=f"{field}.")
        _expect(name not in names, where, f"{field}.name", name, "a name no other file has")
        _expect(rank not in ranks, where, f"{field}.rank", rank, "a rank no other file has")
        names.add(name)
        ranks.add(rank)
    return names


def _file_name(obj: dict, field: str, where: str) -> str:
    """A plain name inside the step directory: a path out of it must never be opened."""
    name = _get(obj, "name", where, "a file name", prefix=f"{field}.")
    ok = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )
    _expect(ok, where, f"{field}.name", name, "a base name (no '/', '\\', '..'; not absolute)")
    return name


def _get(obj: dict, key: str, where: str, valid: str, prefix: str = ""):
    if key not in obj:
        raise CheckpointError(f"{where}: manifest has no {prefix + key!r} field; valid: {valid}")
    return obj[key]


def _int(obj: dict, key: str, where: str, lo: int, hi: int = INT64_MAX, prefix: str = "") -> int:
    v = _get(obj, key, where, f"an integer in [{lo}, {hi}]", prefix)
    ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
    _expect(ok, where, prefix + key, v, f"an integer in [{lo}, {hi}]")
    return v


def _number(obj: dict, key: str, where: str, lo: float, prefix: str = "") -> float:
    valid = "a finite number" + (f" >= {lo}" if lo > -math.inf else "")
    v = _get(obj, key, where, valid, prefix)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= lo
    _expect(ok, where, prefix + key, v, valid)
    return v


def _expect(ok: bool, where: str, field: str, value, valid: str) -> None:
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(f"{where}: manifest {field}={shown}; valid: {valid}")
