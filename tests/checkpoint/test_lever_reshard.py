"""Checkpoints written with each memory lever reshard and resume at another world size AND
another lever (optim.state_dtype, sharding.master_dtype, sharding.offload).

The chunk table records each tensor's dtype; loading converts to the dtype the new run keeps:
fp32 -> bf16 rounds to nearest (a run switching to a bf16 master at a resume), bf16 -> fp32 is
exact and said in a note (the precision bf16 lost is not recovered), moments convert either way.
After loading, every weight and moment equals the saved one converted (bit for bit), and the
next step's loss equals the one of the run that continued without a reload.
"""

import pytest
import torch
import torch.distributed as dist

from tests.checkpoint.test_engine_reshard import _step, consolidated
from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import WD, lever_optimizer, optimizer, wrap
from trainer.checkpoint import CheckpointReader, CheckpointWriter
from trainer.checkpoint.checkpointer import load_state, state_chunks

FP32 = dict(sharding={}, state="float32")
BF16_STATE = dict(sharding=dict(offload="optimizer"), state="bfloat16")
BF16_ALL = dict(sharding=dict(master_dtype="bfloat16", offload="params"), state="bfloat16")
BF16_ON_DEVICE = dict(sharding=dict(master_dtype="bfloat16"), state="bfloat16")
FP32_OFFLOADED = dict(sharding=dict(offload="params"), state="float32")
# (saved at, saved with, loaded at, loaded with)
CASES = [
    (2, FP32, 3, BF16_ALL),  # fp32 -> bf16 master and moments, parameters offloaded
    (3, BF16_ALL, 2, BF16_ON_DEVICE),  # same dtypes: bit for bit
    (1, BF16_ON_DEVICE, 2, FP32_OFFLOADED),  # bf16 -> fp32: exact, with a note
    (2, BF16_STATE, 1, FP32),  # bf16 moments -> fp32
]


def build(rank, world, lever):
    fsdp = wrap(rank, world, strategy="FULL_SHARD", **lever["sharding"])
    bf16 = lever["state"] != "float32" or "master_dtype" in lever["sharding"]
    opt = lever_optimizer(fsdp, state_dtype=lever["state"]) if bf16 else None
    return fsdp, opt or optimizer(fsdp.param_groups(WD))


def _save(rank, world, root, lever):
    fsdp, opt = build(rank, world, lever)
    for step in range(2):
        _step(fsdp, opt, step, rank, world)
    writer = CheckpointWriter(root, keep=5, group=dist.group.WORLD if world > 1 else None)
    writer.save(2, rank, world, state_chunks(fsdp, opt), {"optim_step": 2.0})
    path = writer.wait()
    writer.close()
    state = consolidated(fsdp, opt)
    next_loss = _step(fsdp, opt, 2, rank, world)
    return dict(path=path, state=state, next_loss=next_loss) if rank == 0 else None


def _load(rank, world, path, lever):
    fsdp, opt = build(rank, world, lever)
    reader = CheckpointReader(path)
    notes = load_state(fsdp, opt, reader, reader.state["optim_step"], torch.device("cpu"))
    dtypes = {k: reader.dtype(k) for k in reader.keys()}
    state = consolidated(fsdp, opt)
    steps = {float(s["step"]) for s in opt.state.values()}
    out = dict(state=state, notes=notes, dtypes=dtypes, steps=steps)
    out["next_loss"] = _step(fsdp, opt, 2, rank, world)
    return out if rank == 0 else None


def _dtype(lever, key: str) -> torch.dtype:
    if key.startswith("model/"):
        return getattr(torch, lever["sharding"].get("master_dtype", "float32"))
    return getattr(torch, lever["state"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}->{c[2]}")
def test_a_lever_checkpoint_resumes_at_another_world_size_and_lever(case, tmp_path):
    n, saved_with, m, loaded_with = case
    saved = run_distributed(_save, n, str(tmp_path / "ckpt"), saved_with)[0]
    got = run_distributed(_load, m, saved["path"], loaded_with)[0]
    assert got["steps"] == {2.0}
    assert sorted(got["state"]) == sorted(saved["state"])
    for key, value in saved["state"].items():
        assert got["dtypes"][key] == _dtype(saved_with, key), key  # the chunk table says
        want = value.to(_dtype(loaded_with, key)).float()  # converted as the load converts
        assert torch.equal(got["state"][key], want), key
    same_master = _dtype(saved_with, "model/") == _dtype(loaded_with, "model/")
    rel = 1e-6 if same_master or _dtype(loaded_with, "model/") == torch.float32 else 2e-3
    assert got["next_loss"] == pytest.approx(saved["next_loss"], rel=rel)
    upcast = _dtype(saved_with, "model/") == torch.bfloat16 != _dtype(loaded_with, "model/")
    assert any("not recovered" in note for note in got["notes"]) == upcast, got["notes"]
    if saved_with["state"] != loaded_with["state"]:
        assert any("AdamW moments" in note for note in got["notes"]), got["notes"]
