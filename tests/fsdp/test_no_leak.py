"""A built engine is freed when its last reference goes: `del` (and the collector, for the plain
Python cycles between a module and its hooks) gives back its shards, gathered buffers, gradient
shards and optimizer state. A leak here is silent on a CPU and fatal on a GPU: every later model
(the next sweep job in one process, the next benchmark row, a rebuilt engine after a resize)
would run beside the dead one's device memory.

The probe holds weak references to the engine and to one of its fp32 shards; after a real
training step (so every hook has fired and the optimizer holds state) and `del`, both must be
gone. The case that leaked: the post-accumulate-grad hook on each unsharded parameter closed over
its unit, through a tensor hook the collector cannot traverse.
"""

import gc
import time
import weakref

import pytest

from tests.fsdp.scaffold import CLIP, SEQ, WD, batch, optimizer, wrap
from tests.gpu.threaded_ranks import run_threaded
from trainer.model import loss_sum

CASES = [
    dict(strategy="FULL_SHARD"),  # world 1 fp32: the shard IS the parameter (no gather buffer)
    dict(strategy="FULL_SHARD", param_dtype="bfloat16"),
    dict(strategy="SHARD_GRAD_OP", param_dtype="bfloat16", activation_checkpointing=True),
    dict(strategy="FULL_SHARD", offload="optimizer"),
    dict(strategy="NO_SHARD"),
]


def _build_train_release(rank: int, world: int, sharding: dict) -> tuple[bool, bool]:
    """Build, train two steps (one with micro-batch accumulation), drop every reference; returns
    whether the engine and its first shard are still alive after the collector ran."""
    fsdp = wrap(rank, world, **sharding)
    opt = optimizer(fsdp.param_groups(WD))
    x, y = batch(0, 2 * world)
    x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
    for micro in (1, 2):
        for k in range(micro):
            rows = slice(k, k + 1) if micro == 2 else slice(None)
            ctx = fsdp.no_sync() if k < micro - 1 else _Null()
            with ctx:
                s, _ = loss_sum(fsdp(x[rows]), y[rows])
                (s / (2 * world * SEQ)).backward()
        fsdp.clip_grad_norm_(CLIP)
        opt.step()
        fsdp.zero_grad()
    assert opt.state, "the optimizer never stepped: the probe would prove nothing"
    engine, shard = weakref.ref(fsdp), weakref.ref(next(fsdp.flats()).shard)
    del fsdp, opt, s, ctx
    # gc.collect() does nothing while another thread's collection runs (threaded ranks share one
    # collector): collect until both are gone, a few times at most; a real leak outlives them all.
    for _ in range(20):
        gc.collect()
        if engine() is None and shard() is None:
            break
        time.sleep(0.01)
    return engine() is not None, shard() is not None


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("sharding", CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_an_engine_is_freed_when_its_last_reference_goes(sharding):
    engine_alive, shard_alive = _build_train_release(0, 1, sharding)
    assert not engine_alive, "the engine outlived its last reference"
    assert not shard_alive, "a parameter shard outlived the engine"


def test_engines_of_every_rank_are_freed_at_world_size_2():
    """With collectives in the step (gathers, reduce-scatters on handles, the norm's all-reduce):
    nothing in flight keeps a rank's engine alive either."""
    results = run_threaded(_build_train_release, 2, dict(strategy="FULL_SHARD"))
    assert results == [(False, False), (False, False)]
