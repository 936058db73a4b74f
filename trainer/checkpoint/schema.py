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

INT64_MAX = 2**63 - 1
"""Steps, sizes and counts are int64 in the chunk table and in torch: nothing larger is real."""

# What trainer.checkpointing reads from `state` (TrainerState): the kind each key must have when
# present. A trainer's state (one with a model_digest) must carry the step it resumes at and the
# global batch its data position depends on, and AdamW's step count (Checkpointer._try_load
# indexes it); other states (tests, tools) are free-form.
_STATE_INT_MIN = {"step": 0, "consumed_samples": 0, "global_batch_size": 1, "world_size": 1}
_STATE_NUMBER_MIN = {"optim_step": 0.0, "lr": -math.inf}
_STATE_OBJECTS = ("model_config", "grad_scaler", "data", "tokenizer")  # an object or null
_STATE_STRINGS = ("strategy", "model_digest")
_STATE_OPTIONAL_STRINGS = ("rng_cpu", "imported_from")
# For the record only (inspect shows them; older checkpoints lack them): a number or null each.
_STATE_OPTIONAL_INT_MIN = {"tokens_seen": 0}
_STATE_OPTIONAL_NUMBERS = ("loss",)
_TRAINER_MARK = "model_digest"
_TRAINER_REQUIRED = ("step", "global_batch_size", "optim_step")


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
    """The keys resume uses, when present, have sane types; a trainer's state has them all."""
    if _TRAINER_MARK in state:
        for key in _TRAINER_REQUIRED:
            _get(state, key, where, "present in a trainer's state", prefix="state.")
    for key, lo in _STATE_INT_MIN.items():
        if key == "global_batch_size" and state.get(key) is None and state.get("imported_from"):
            continue  # a step-0 import has no batch size yet (trainer/hf.py)
        if key in state:
            _int(state, key, where, lo, prefix="state.")
    for key, lo in _STATE_NUMBER_MIN.items():
        if key in state:
            _number(state, key, where, lo, prefix="state.")
    if "step" in state:
        _expect(state["step"] == step, where, "state.step", state["step"], f"{step} (as 'step')")
    for key in _STATE_OBJECTS:
        v = state.get(key)
        _expect(v is None or isinstance(v, dict), where, f"state.{key}", v, "an object or null")
    for key in _STATE_STRINGS:
        if key in state:
            _expect(isinstance(state[key], str), where, f"state.{key}", state[key], "a string")
    for key in _STATE_OPTIONAL_STRINGS:
        v = state.get(key)
        _expect(v is None or isinstance(v, str), where, f"state.{key}", v, "a string or null")
    for key, lo in _STATE_OPTIONAL_INT_MIN.items():
        v = state.get(key)
        ok = v is None or (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= INT64_MAX)
        _expect(ok, where, f"state.{key}", v, f"an integer in [{lo}, {INT64_MAX}] or null")
    for key in _STATE_OPTIONAL_NUMBERS:
        v = state.get(key)
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        ok = v is None or (number and math.isfinite(v))
        _expect(ok, where, f"state.{key}", v, "a finite number or null")
    if state.get("rng_cpu") is not None:
        try:
            b64decode(state["rng_cpu"], validate=True)
        except (binascii.Error, ValueError):
            _expect(False, where, "state.rng_cpu", state["rng_cpu"], "base64 (torch's RNG state)")


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
