"""What the engine assumes of gloo, checked on the torch it runs with: a reduce-scatter's input is
copied when the collective is issued, so the caller may overwrite or free it at once
(trainer/fsdp/collectives.py drops its reference on the CPU: a unit's unsharded gradient is freed
as its reduce-scatter goes out). An all-gather's input is not copied (overwriting it in flight
corrupts the gather, seen here), so the engine keeps that one until the wait. If a torch release
stops copying, this fails before any parity test turns flaky."""

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

N = 1 << 21  # large enough that the collective is still in flight when the input is overwritten


def _overwrite_inputs_in_flight(rank: int, world: int) -> list[bool]:
    ok = []
    for _ in range(5):
        inp = torch.full((N,), float(rank + 1))
        out = torch.empty(N // world)
        work = dist.reduce_scatter_tensor(out, inp, async_op=True)
        inp.fill_(1e6)
        del inp
        torch.full((N,), -1.0)  # may take the freed storage
        work.wait()
        ok.append(bool((out == sum(range(1, world + 1))).all()))
    return ok


def test_gloo_copies_a_reduce_scatter_input_so_the_engine_frees_it_once_issued():
    for ok in run_distributed(_overwrite_inputs_in_flight, 2):
        assert all(ok), ok
