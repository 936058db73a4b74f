"""The planner under context parallelism (issue 37): the activation term per context degree, the
smallest degree that fits, the longest sequence, and the CLI's lines."""

import dataclasses

import pytest

from cluster.plan import main as plan_main
from trainer.config import PRESETS, ConfigError, ShardingStrategy, TrainerConfig
from trainer.plan import activation_bytes, longest_sequence, plan, profile, smallest_context
from trainer.plan.context import _at, context_degrees, leanest_fits
from trainer.plan.planner import strategies
from trainer.plan.timeline import activation_peak

MiB = 2**20
TINY = PRESETS["tiny"]


def job(seq_len=4096, batch=4, context=1, strategy="FULL_SHARD") -> TrainerConfig:
    cfg = TrainerConfig()
    model = dataclasses.replace(TINY, max_seq_len=max(seq_len, TINY.max_seq_len))
    return dataclasses.replace(
        cfg,
        model=model,
        data=dataclasses.replace(cfg.data, seq_len=seq_len),
        train=dataclasses.replace(
            cfg.train, global_batch_size=batch, context_parallel=context, snapshot_every=0
        ),
        sharding=dataclasses.replace(cfg.sharding, strategy=strategy),
    )


def kv_bytes(model, rows, seq_len, itemsize):
    """One layer's gathered keys and values: [rows, T, kv_heads, 2 head_dim]."""
    return rows * seq_len * model.kv_heads * 2 * model.head_size * itemsize


def test_activation_term_at_context_2_is_half_plus_the_gathered_kv():
    seq, dtype = 4096, "float32"
    one = profile(TINY, 1, seq, dtype, True, None, 1)
    two = profile(TINY, 1, seq, dtype, True, None, 2)
    # checkpointed blocks keep their input only: exactly half the tokens
    assert two.block.retained * 2 == one.block.retained
    assert two.block.io_bytes * 2 == one.block.io_bytes
    # the recompute + backward of one block: half of context 1's, plus the whole sequence's K/V
    # (gathered, ordered, repeated per chunk's key range) and their gradients, not all at the peak
    kv = kv_bytes(TINY, 1, seq, 4)
    extra = two.block.backward_peak - one.block.backward_peak / 2
    assert 0.5 * kv <= extra <= 8 * kv, (extra / kv, one.block, two.block)
    a1 = activation_bytes(TINY, 1, seq, 1, True, dtype)
    a2 = activation_bytes(TINY, 1, seq, 2, True, dtype)
    assert a1 == activation_peak(one, TINY.n_layers)
    assert a2 == activation_peak(two, TINY.n_layers)
    assert 0.5 * a1 < a2 < 0.5 * a1 + 8 * kv
    assert a2 < 0.7 * a1
    # without checkpointing every layer keeps its share: also about half, never more than 0.7
    b1 = activation_bytes(TINY, 1, seq, 1, False, dtype)
    b2 = activation_bytes(TINY, 1, seq, 2, False, dtype)
    assert 0.5 * b1 < b2 < 0.7 * b1
    # more degree, less memory
    assert activation_bytes(TINY, 1, seq, 4, True, dtype) < a2


def test_plain_causal_chunks_build_no_mask():
    seq = 2048
    cuda = profile(TINY, 1, seq, "float32", True, None, 2)
    cpu = profile(TINY, 1, seq, "float32", True, None, 2, device="cpu")
    assert cuda.shared == cpu.shared == 0
    assert cuda.block == cpu.block and cuda.root == cpu.root


def test_plan_splits_the_batch_over_data_ranks_and_keeps_the_layout():
    one = plan(job(batch=4), 4, 2**40, headroom=False)
    two = plan(job(batch=4, context=2), 4, 2**40, headroom=False)
    assert (one.rows, two.rows) == (1, 2)  # 4 sequences over 4, then 2 data ranks
    assert (one.tokens_per_row, two.tokens_per_row) == (4096, 2048)
    assert two.sharded_params == one.sharded_params and two.optim_state == one.optim_state
    assert two.bytes_moved["context"] > 0 and "context" not in one.bytes_moved


def test_invalid_degrees_are_refused_and_valid_ones_tried():
    with pytest.raises(ConfigError, match="valid: 1, 2, 4"):
        plan(job(context=3), 4, 2**40)
    assert context_degrees(job(), 8) == [1, 2, 4, 8]
    assert context_degrees(job(seq_len=8), 8) == [1, 2, 4]  # 2N <= seq_len
    hybrid = job(strategy="HYBRID_SHARD")
    assert ShardingStrategy.HYBRID_SHARD in strategies(_at(hybrid, 2), 8, 4)
    assert ShardingStrategy.HYBRID_SHARD not in strategies(_at(hybrid, 8), 8, 4)


def test_smallest_degree_that_fits():
    cfg = job(seq_len=8192, batch=4)
    world = 4

    def leanest(d):  # the least memory any candidate needs at degree d
        from trainer.plan import options

        opts = options(_at(cfg, d), world, 2**40, headroom=False, host_memory_bytes=None)
        return min(o.plan.total for o in opts)

    m1, m2 = leanest(1), leanest(2)
    assert m2 < m1
    device = (m1 + m2) // 2  # context 1 does not fit, context 2 does
    got = smallest_context(cfg, world, device, headroom=False, host_memory_bytes=None)
    assert got.degree == 2 and got.tried == (1, 2, 4)
    assert got.best.plan.total <= device and got.best.plan.context_parallel == 2
    roomy = smallest_context(cfg, world, 2 * m1, headroom=False, host_memory_bytes=None)
    assert roomy.degree == 1
    none = smallest_context(cfg, world, 1 * MiB, headroom=False, host_memory_bytes=None)
    assert none.degree == 0 and none.best is None
    # the cluster's hardware ranks the answer (a consumer card's step is slower than an H100's)
    from trainer.plan.hardware import hardware

    kw = dict(headroom=False, host_memory_bytes=None)
    fast = smallest_context(cfg, world, device, hw=hardware("h100"), **kw).best
    slow = smallest_context(cfg, world, device, hw=hardware("rtx4090"), **kw).best
    assert slow.time.step_s > 2 * fast.time.step_s


def test_longest_sequence_fits_and_grows_with_the_degree():
    cfg = job(seq_len=4096, batch=4)
    kw = dict(headroom=False, host_memory_bytes=None)
    device = 160 * MiB
    found = [longest_sequence(cfg, 4, device, context=d, **kw) for d in (1, 2, 4)]
    assert 0 < found[0] <= found[1] <= found[2], found
    assert found[2] > found[0]
    for d, t in zip((1, 2, 4), found):
        assert leanest_fits(_at(cfg, d, t), 4, device, **kw)


def test_cli_names_the_smallest_degree_and_the_longest_sequence(capsys):
    args = [
        "cluster.num_workers=4",
        "data.seq_len=32768",
        "model.max_seq_len=32768",
        "train.global_batch_size=4",
        "local_world_size=4",
    ]
    cfg = job(seq_len=32768, batch=4)
    opts_1 = __import__("trainer.plan", fromlist=["options"]).options(
        cfg, 4, 2**40, 4, headroom=True, host_memory_bytes=None
    )
    need = min(o.plan.total + o.plan.headroom.total for o in opts_1)  # context 1's least
    gb = (need - 1) / 2**30
    code = plan_main([*args, f"device_memory_gb={gb:.4f}"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("context parallelism:"))
    assert "train.context_parallel=1 does not fit" in line
    assert "train.context_parallel=2 is the smallest that does" in line
    assert code == 0
    longest = next(x for x in out.splitlines() if x.startswith("longest sequence:"))
    assert "train.context_parallel=4" in longest
