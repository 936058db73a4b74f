"""Hostile manifests: a manifest (or chunk table) that passes its own crc32 but is incomplete or
extreme is a skipped checkpoint with a reason naming the field, never a crash: resume falls back
to the previous good step, `validate` raises only CheckpointError, and the CLI prints one line
without a traceback. `verify` also reports NaN/Inf in floating tensors, naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch

from trainer import storage
from trainer.checkpoint import CheckpointError, CheckpointReader, latest_checkpoint, verify
from trainer.checkpoint.__main__ import main
from trainer.checkpoint.catalog import validate
from trainer.checkpoint.format import (
    encode_manifest,
    rows_to_table,
    table_from_bytes,
    table_to_bytes,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(step: int) -> dict:
    """What the trainer stores (trainer.checkpoint.trainer_state.TrainerState), small."""
    return {
        "step": step,
        "consumed_samples": 8 * step,
        "global_batch_size": 8,
        "optim_step": float(step),
        "lr": 1e-3,
        "world_size": 2,
        "strategy": "FULL_SHARD",
        "model_config": {"dim": 8},
        "model_digest": "0123456789abcdef",
        "grad_scaler": {},
        "rng_cpu": None,
        "data": {"seed": 0},
    }


def _finite(tensors: dict) -> dict:
    """The sample tensors without their deliberate NaN/Inf (those test bitwise round trips)."""
    return {k: torch.nan_to_num(t) if t.is_floating_point() else t for k, t in tensors.items()}


@pytest.fixture
def two_steps(tmp_path, tensors, ck):
    """Sound checkpoints at steps 10 and 20 (2 ranks, 64-byte blocks): (root, path10, path20)."""
    root, tensors = str(tmp_path), _finite(tensors)
    p10 = ck.save_ranks(root, 10, tensors, world_size=2, state=_state(10), block_bytes=64)
    p20 = ck.save_ranks(root, 20, tensors, world_size=2, state=_state(20), block_bytes=64)
    return root, p10, p20


def _body(path: str) -> dict:
    return json.loads(open(f"{path}/manifest.json", "rb").read())["manifest"]


def _write_body(path: str, body) -> None:
    """Re-encode with a correct crc32: only the schema check can refuse it."""
    open(f"{path}/manifest.json", "wb").write(encode_manifest(body))


def _set(dotted: str, value):
    """A tamper: set (or with value=DEL, delete) the field at a dotted path like 'files.0.rank'."""

    def tamper(body):
        *parents, last = dotted.split(".")
        node = body
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is DEL:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return body

    return tamper


DEL = object()

# (id, tamper, text the skip reason must contain: the field, and the value where there is one)
MANIFEST_CASES = [
    ("no_files", _set("files", DEL), "'files'"),
    ("no_chunk_table", _set("chunk_table", DEL), "'chunk_table'"),
    ("no_state", _set("state", DEL), "'state'"),
    ("state_without_global_batch_size", _set("state.global_batch_size", DEL), "global_batch_size"),
    ("state_without_step", _set("state.step", DEL), "state.step"),
    ("state_optim_step_nan", _set("state.optim_step", float("nan")), "state.optim_step"),
    ("state_step_1e30", _set("state.step", 1e30), "state.step"),
    ("state_step_mismatch", _set("state.step", 10**6), "state.step"),
    ("state_lr_inf", _set("state.lr", float("inf")), "state.lr"),
    ("state_batch_zero", _set("state.global_batch_size", 0), "global_batch_size"),
    ("state_batch_bool", _set("state.global_batch_size", True), "global_batch_size"),
    ("step_1e30", _set("step", 1e30), "step"),
    ("step_float", _set("step", 20.0), "step"),
    ("step_not_the_directory", _set("step", 21), "step"),
    ("world_size_0", _set("world_size", 0), "world_size"),
    ("world_size_not_file_count", _set("world_size", 3), "world_size"),
    ("file_name_dotdot", _set("files.0.name", "../x"), "'../x'"),
    ("file_name_absolute", _set("files.0.name", "/abs"), "'/abs'"),
    ("file_size_negative", _set("files.0.size", -1), "size"),
    ("duplicate_rank", _set("files.1.rank", 0), "rank"),
    ("file_not_an_object", _set("files.0", "rank-00000-of-00002.bin"), "files[0]"),
    ("chunk_table_name_dotdot", _set("chunk_table.name", "../chunks.arrow"), "chunk_table"),
    ("chunk_table_crc_string", _set("chunk_table.crc32", "0"), "crc32"),
    ("body_not_an_object", lambda body: [body], "object"),
]


def _tamper_manifest(path: str, tamper) -> None:
    _write_body(path, tamper(_body(path)))


def _tamper_block_bytes(path: str, block_bytes: int) -> None:
    """Re-write chunk 0 of the table with one block of `block_bytes` (its crc32 made right, so
    every checksum passes) and fix the manifest's record of the table."""
    table, _ = table_from_bytes(open(f"{path}/chunks.arrow", "rb").read(), "chunks.arrow")
    rows = table.to_pylist()
    row = rows[0]
    nbytes = row["numel"] * {"float32": 4, "bfloat16": 2, "int64": 8}[row["dtype"]]
    with open(f"{path}/{row['file']}", "rb") as f:
        f.seek(row["offset"])
        row["crc32"] = [zlib.crc32(f.read(nbytes))]
    row["block_bytes"] = block_bytes
    data = table_to_bytes(rows_to_table(rows))
    open(f"{path}/chunks.arrow", "wb").write(data)
    body = _body(path)
    body["chunk_table"].update(size=len(data), crc32=zlib.crc32(data))
    _write_body(path, body)


def _assert_skipped(root: str, p10: str, p20: str, reason: str) -> str:
    """Resume falls back to step 10 naming the field; validate raises only CheckpointError;
    the reader refuses it; inspect and verify exit nonzero with the reason and no exception."""
    messages = []
    assert latest_checkpoint(root, log=messages.append) == p10, messages
    assert messages[0].startswith(f"checkpoint: skipping {p20}: ") and reason in messages[0], (
        messages[0]
    )
    with pytest.raises(CheckpointError) as e:  # anything else escapes and fails the test
        validate(storage.resolve(p20))
    with pytest.raises(CheckpointError):
        CheckpointReader(p20)
    problems = verify(p20)
    assert len(problems) == 1 and reason in problems[0], problems
    return str(e.value)


@pytest.mark.parametrize("case, tamper, reason", MANIFEST_CASES, ids=[c[0] for c in MANIFEST_CASES])
def test_tampered_manifest_with_a_good_crc_is_skipped_naming_the_field(
    two_steps, capsys, case, tamper, reason
):
    root, p10, p20 = two_steps
    _tamper_manifest(p20, tamper)
    _assert_skipped(root, p10, p20, reason)
    for cmd in ("inspect", "verify"):
        rc = main([cmd, p20])
        out = capsys.readouterr()
        assert rc == 1 and reason in out.out and "Traceback" not in out.err, (cmd, out)
    rc = main(["inspect", root])  # the listing shows it as invalid, and step 10 as valid
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rc == 0 and "NO: " in rows["20"] and rows["10"].endswith("yes")


def test_block_bytes_of_2_pow_40_is_refused_before_any_allocation(two_steps):
    root, p10, p20 = two_steps
    _tamper_block_bytes(p20, 2**40)
    why = _assert_skipped(root, p10, p20, "block_bytes")
    assert str(2**40) in why


def test_block_bytes_not_a_multiple_of_the_itemsize_is_refused(two_steps):
    root, p10, p20 = two_steps
    _tamper_block_bytes(p20, 63)
    _assert_skipped(root, p10, p20, "block_bytes")


def test_block_larger_than_its_chunk_reads_with_a_chunk_sized_buffer(tmp_path, ck):
    """The writer records its block size for every chunk, so tiny chunks carry 4 MiB blocks:
    that stays valid, and a read allocates no more than the chunk."""
    t = {"model/w": torch.arange(10, dtype=torch.float32)}
    path = ck.save_ranks(str(tmp_path), 1, t, world_size=1, state=_state(1))
    with CheckpointReader(path) as r:
        assert torch.equal(r.read("model/w", 3, 4), t["model/w"][3:7])
        assert len(r._scratch_buf) <= 40
    assert verify(path) == []


def test_hostile_manifests_through_the_real_cli_print_no_traceback(two_steps, capsys):
    """The commands scripts run exit 1 with the reason and no traceback; export, which has no
    report of its own, says it in one `error: ...` line."""
    root, _, p20 = two_steps
    _tamper_manifest(p20, _set("files", DEL))
    for cmd in ("inspect", "verify"):
        r = subprocess.run(
            [sys.executable, "-m", "trainer.checkpoint", cmd, p20],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=REPO),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1 and "'files'" in r.stdout, (cmd, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
    rc = main(["export", p20, os.path.join(root, "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "'files'" in lines[0], lines


def test_cli_errors_from_bad_input_are_one_line_without_traceback(tmp_path, capsys):
    """A bad URI (ValueError from pyarrow) and an unreadable file (OSError): `error: ...`."""
    rc = main(["inspect", "nosuchscheme://bucket/x"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


def test_verify_reports_nan_and_inf_in_floating_tensors_naming_the_key(tmp_path, ck, capsys):
    w = torch.randn(40, 3)
    w[1, 1], w[7, 0], w[39, 2] = float("nan"), float("inf"), -float("inf")
    b = torch.ones(50, dtype=torch.bfloat16)
    b[49] = float("nan")
    t = {"model/w": w, "model/b": b, "data/ids": torch.arange(30)}
    path = ck.save_ranks(str(tmp_path), 3, t, world_size=2, state=_state(3), block_bytes=32)
    problems = verify(path, check_finite=True)
    assert problems == [
        f"{path}: tensor 'model/b' (bfloat16): 1 non-finite value(s) (NaN/Inf)",
        f"{path}: tensor 'model/w' (float32): 3 non-finite value(s) (NaN/Inf)",
    ], problems
    assert verify(path) == []  # the library default checks integrity only
    rc = main(["verify", path])
    out = capsys.readouterr().out
    assert rc == 1 and "'model/w'" in out and "3 non-finite" in out and "data/ids" not in out
    assert main(["verify", "--allow-nonfinite", path]) == 0
