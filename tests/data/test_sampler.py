"""trainer/data/sampler.py: the global order is a pure function of (seed, epoch, position), the
same at every world size, a permutation per epoch, and a mix at its weights."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.data import GlobalOrder, Permutation, global_tokens_per_step, rank_range
from trainer.data.sampler import MIX_BLOCK, SourceOrder


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 12_345, 2**16 + 1])
def test_permutation_is_a_bijection_of_range_n(n):
    values = Permutation(n, [7, 1])(np.arange(n))
    np.testing.assert_array_equal(np.sort(values), np.arange(n))


def test_permutation_is_keyed_and_pointwise():
    p, q = Permutation(10_000, [0, 1]), Permutation(10_000, [0, 2])
    all_at_once = p(np.arange(10_000))
    np.testing.assert_array_equal(p(np.array([9_999, 3, 5_000])), all_at_once[[9_999, 3, 5_000]])
    assert (all_at_once != q(np.arange(10_000))).mean() > 0.99  # another key, another order
    assert (all_at_once != np.arange(10_000)).mean() > 0.99  # and not the identity


def test_a_billion_samples_cost_no_table():
    """Any position of a 10^9-sample epoch, at once: nothing of size n is built."""
    order = SourceOrder(10**9, seed=3, source=0)
    draws = np.array([0, 1, 999_999_999, 10**9, 5 * 10**9 + 17])
    samples = order.samples(draws)
    assert ((0 <= samples) & (samples < 10**9)).all()
    np.testing.assert_array_equal(order.samples(draws[::-1]), samples[::-1])


def test_order_is_a_function_of_seed_and_epoch_only():
    a, b = GlobalOrder([50], [1.0], seed=3), GlobalOrder([50], [1.0], seed=3)
    late_first = b.lookup(np.arange(100, 150))[1]  # epoch 2 before anything else
    np.testing.assert_array_equal(a.lookup(np.arange(150))[1][100:], late_first)
    for epoch in range(3):
        ids = a.lookup(np.arange(50 * epoch, 50 * (epoch + 1)))[1]
        np.testing.assert_array_equal(np.sort(ids), np.arange(50))  # each sample once per epoch
    assert not np.array_equal(a.lookup(np.arange(50))[1], a.lookup(np.arange(50, 100))[1])
    other_seed = GlobalOrder([50], [1.0], seed=4).lookup(np.arange(50))[1]
    assert not np.array_equal(a.lookup(np.arange(50))[1], other_seed)


def test_mix_gives_each_source_its_share_in_every_block_and_each_epoch_is_a_permutation():
    order = GlobalOrder([700, 300, 11], [0.6, 0.3, 0.1], seed=0)
    assert order.counts == [2458, 1229, 409] and sum(order.counts) == MIX_BLOCK
    sources, samples = order.lookup(np.arange(3 * MIX_BLOCK))
    for b in range(3):
        block = sources[b * MIX_BLOCK : (b + 1) * MIX_BLOCK]
        assert np.bincount(block, minlength=3).tolist() == order.counts
    for i, n in enumerate([700, 300, 11]):
        drawn = samples[sources == i]
        for epoch in range(len(drawn) // n):  # every full epoch of every source: each once
            np.testing.assert_array_equal(np.sort(drawn[epoch * n : (epoch + 1) * n]), np.arange(n))
    assert not np.array_equal(sources[:MIX_BLOCK], sources[MIX_BLOCK : 2 * MIX_BLOCK])  # reshuffled


def test_mix_positions_are_pointwise_too():
    order = GlobalOrder([700, 300], [0.5, 0.5], seed=1)
    everything = order.lookup(np.arange(2 * MIX_BLOCK + 100))
    some = np.array([2 * MIX_BLOCK + 99, 5, MIX_BLOCK + 3])
    got = GlobalOrder([700, 300], [0.5, 0.5], seed=1).lookup(some)
    np.testing.assert_array_equal(got[0], everything[0][some])
    np.testing.assert_array_equal(got[1], everything[1][some])


@pytest.mark.parametrize("batch,world", [(7, 1), (7, 3), (7, 5), (8, 4), (5, 5)])
def test_rank_range_is_a_balanced_contiguous_split(batch, world):
    ranges = [rank_range(batch, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == batch
    assert all(ranges[r][1] == ranges[r + 1][0] for r in range(world - 1))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_global_tokens_per_step_is_batch_times_seq_len():
    assert global_tokens_per_step(7, 128) == 896
