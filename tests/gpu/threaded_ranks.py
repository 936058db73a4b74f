"""N ranks on one device: N threads of this process joined by torch's threaded process group.

    results = run_threaded(train_tiny, 3, "cuda", steps, global_batch, dict(strategy="FULL_SHARD"))
    run_threaded(train_tiny, 3, "cuda", steps, global_batch, fp16, overflow_at=(1, 2))  # keywords

Why threads: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and one H200 is the
machine our GPU checks get. torch's threaded process group
(torch.testing._internal.distributed.multi_threaded_pg) runs one rank per thread and implements
every collective with tensor ops. It supports what the engine calls: the tensor all-gather and
reduce-scatter (under the names its own torch dispatches to: all_gather_single and
reduce_scatter_single in 2.13, _allgather_base and _reduce_scatter_base before), async_op
handles (a finished Work: the call returns once every rank has joined, so the engine's issue
order must match across ranks, as NCCL needs anyway), all_reduce, and subgroups from new_group
(HYBRID_SHARD's shard and replicate groups).
Each rank thread gets its own CUDA stream as its compute stream, so each rank's engine runs its
own compute stream and three collective streams against the others' on one device, with its own
buffers, events and exposed-communication timing, as separate processes would.

Two things make it faithful on CUDA:
- Upstream, rank 0's thread does every rank's copies on its own current stream, ordered after
  nothing the other ranks queued: another rank's input may not be written yet, and its later
  kernels may read the output before the copy ran. NCCL orders a collective after the work
  queued on each rank's issuing stream and that stream's later work after it; _StreamOrdered
  gives the threaded group the same contract with two CUDA events (ready per rank, done once).
  On CPU tensors it changes nothing.
- Autograd runs a CUDA backward on one engine thread per device, shared by every rank thread:
  one rank's gradient hook would block there in a reduce-scatter waiting for a rank whose
  backward is queued behind it on the same thread. The group turns autograd's multithreading off
  in the thread that creates it (a thread-local setting), so each rank runs its own backward;
  the worker says so once more, in its own thread, rather than rely on that side effect.

Not chosen: one process per rank with gloo on CUDA tensors. Gloo stages CUDA tensors through
host copies on streams of its own and blocks the host in every synchronous call, so it would
test gloo's staging more than our streams; its reduce-scatter on CUDA tensors was not verified
(the harness was written on a machine without a GPU); and rank processes cost seconds each to
start. The threaded group runs in this process, in milliseconds, and its CPU twin runs in CI.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg as mtpg
from torch.utils._pytree import tree_leaves

from tests.fsdp.scaffold import CLIP, LR, SEQ, WD, batch, micro_batch_split, optimizer, wrap
from trainer.config import OptimConfig
from trainer.fsdp.accounting import COMM_OPS
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.fsdp.state import full_gradients, full_parameters
from trainer.optim import build_optimizer
from trainer.step import train_step

_LOCK = threading.Lock()  # one threaded world at a time: it replaces torch.distributed's world


def run_threaded(fn: Callable, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
    """fn(rank, world_size, *args, **kwargs) on `world_size` rank threads sharing one threaded
    process group; returns the results ordered by rank. Raises with every failing rank's
    traceback, or TimeoutError naming the ranks still running after `timeout` seconds."""
    with _LOCK, _threaded_world():
        store = dist.HashStore()
        results: list = [None] * world_size
        errors: dict[int, str] = {}
        threads = [
            threading.Thread(
                target=_rank_main,
                args=(fn, rank, world_size, store, args, kwargs, results, errors),
                name=f"rank{rank}",
                daemon=True,  # a hung rank must not keep the test process alive
            )
            for rank in range(world_size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            mtpg.ProcessLocalGroup.exception_handle(TimeoutError())  # wakes ranks in collectives
            raise TimeoutError(f"{fn.__name__} on {world_size} threads: {stuck} after {timeout} s")
    if errors:
        raise RuntimeError("\n".join(f"rank {r} failed:\n{errors[r]}" for r in sorted(errors)))
    return results


def _rank_main(fn, rank, world_size, store, args, kwargs, results, errors) -> None:
    try:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        torch.autograd.set_multithreading_enabled(False)  # this thread runs its own backward
        results[rank] = fn(rank, world_size, *args, **kwargs)
    except BaseException as exc:  # the caller re-raises with this rank's traceback
        errors[rank] = traceback.format_exc()
        mtpg.ProcessLocalGroup.exception_handle(exc)  # other ranks leave their collectives
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _threaded_world():
    """Install the thread-local world and the stream-ordered collective; restore both after."""
    multithreading = torch._C._is_multithreading_enabled()
    isolate = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    if isolate is not None:  # groups resolved by name (functional collectives) stay per thread
        isolate(True)
    upstream = mtpg.Collective
    mtpg.Collective = _StreamOrdered
    mtpg._install_threaded_pg()
    try:
        yield
    finally:
        mtpg.ProcessLocalGroup.reset()
        mtpg._uninstall_threaded_pg()
        mtpg.Collective = upstream
        if isolate is not None:
            isolate(False)
        torch.autograd.set_multithreading_enabled(multithreading)  # older torch leaves it off


class _StreamOrdered(mtpg.Collective):
    """The threaded group's collective, ordered on CUDA streams as NCCL orders it: after the
    work each rank queued on its issuing stream, and before the work it queues there next."""

    def __init__(self, world_size, collective, pg):
        super().__init__(world_size, _OrderedWork(collective, world_size), pg)

    def join(self, rank, data):
        if not any(torch.is_tensor(t) and t.is_cuda for t in tree_leaves(data)):
            return super().join(rank, data)
        work = self._collective
        work.ready[rank] = _recorded_event()  # set before joining: rank 0 reads it after
        result = super().join(rank, data)  # returns once rank 0 queued the copies
        torch.cuda.current_stream().wait_event(work.done)
        return result


class _OrderedWork:
    """Runs on rank 0's thread once every rank joined: its stream waits for every rank's ready
    event, queues the copies, and records `done` for the others to wait on."""

    def __init__(self, inner, world_size: int):
        self.inner = inner
        self.ready: list[Optional[torch.cuda.Event]] = [None] * world_size
        self.done: Optional[torch.cuda.Event] = None

    def work(self, data) -> None:
        cuda = any(e is not None for e in self.ready)
        if cuda:
            stream = torch.cuda.current_stream()
            for event in self.ready:
                if event is not None:
                    stream.wait_event(event)
        self.inner.work(data)
        if cuda:
            self.done = _recorded_event()


def _recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


@contextlib.contextmanager
def rank_stream(device: torch.device):
    """A compute stream of this rank's own on CUDA (separate processes each have theirs)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.Stream(device)):
        yield
    torch.cuda.synchronize(device)


def train_tiny(
    rank: int,
    world: int,
    device: str,
    steps: int,
    global_batch: int,
    sharding: dict,
    *,
    micro_batches: int = 1,
    lr: float = LR,
    overflow_at: Optional[tuple[int, int]] = None,
) -> dict:
    """The test model under our engine on this rank, stepped as trainer/loop.py's train_step
    steps it: this rank's rows of each global batch in `micro_batches` (all but the last under
    no_sync), each micro-batch's token-loss sum over the global token count, scaled by the
    ShardedGradScaler (enabled in fp16), unscaled and checked on every rank, the global-norm
    clip, AdamW built as the loop builds it (trainer/optim.py: fused on CUDA, foreach on the
    host when sharding.offload=optimizer) with the reference's hyperparameters, the step skipped
    on an overflow, the scale updated, zero_grad. overflow_at=(step, rank): that rank's loss is
    multiplied by 2**30 in that step (as tests/fsdp/scaffold.py's engine_run), so its fp16
    backward overflows there only.

    Returns, on the CPU: losses and grad norms per step (all-reduced), step-0 gradients and final
    parameters (whole), per step the bytes the engine moved (in all and by collective) and the ms
    it waited on them, the steps skipped for an overflow, and what _final_state lists."""
    device = torch.device(device)
    lo, hi = rank * global_batch // world, (rank + 1) * global_batch // world
    tokens = global_batch * SEQ
    out = dict(losses=[], norms=[], comm_bytes=[], comm_by_op=[], exposed_ms=[], skipped=[])
    with rank_stream(device):
        fsdp = wrap(rank, world, device=device, **sharding)
        opt = _loop_optimizer(fsdp, lr)
        scaler = ShardedGradScaler(enabled=fsdp.param_dtype == torch.float16)
        for step in range(steps):
            x, y = (t[lo:hi].to(device) for t in batch(step, global_batch))
            grads0 = {}
            step_out = train_step(
                fsdp,
                opt,
                micro_batch_split(x, y, micro_batches),
                global_tokens=tokens,
                grad_clip=CLIP,
                scaler=scaler,
                world=world,
                device=device,
                grad_scale=2.0**30 if overflow_at == (step, rank) else 1.0,
                on_gradients=(lambda: grads0.update(full_gradients(fsdp))) if step == 0 else None,
            )
            if step == 0:
                out["grads0"] = _to_cpu(grads0)
            if step_out.overflow:  # an fp16 overflow on any rank: every rank skipped it
                out["skipped"].append(step)
            out["norms"].append(float(step_out.norm))
            out["losses"].append(float(step_out.loss))
            m = fsdp.metrics(opt)
            out["comm_bytes"].append(m["comm/total_bytes"])
            out["exposed_ms"].append(m["comm/exposed_ms"])
            out["comm_by_op"].append({op: m[f"comm/{op}_bytes"] for op in COMM_OPS})
        out.update(_final_state(fsdp, opt, scaler))
    return out


def _final_state(fsdp, opt, scaler) -> dict:
    """After the last step: the parameters (whole), the collective streams, the loss scale, the
    padded size of each reduced flat parameter, whether each host master shard is pinned
    (offload), the devices AdamW's state lives on, and the event trace (with sharding.trace)."""
    return dict(
        params=_to_cpu(full_parameters(fsdp)),
        collective_streams=len(getattr(fsdp.comm, "streams", {})),
        scale=scaler.scale,
        reduced_numels=[f.padded_numel for f in fsdp.flats() if f.requires_grad],
        host_master_pinned=[f.shard.is_pinned() for f in fsdp.flats() if f.host],
        optim_state_on=sorted(
            {v.device.type for st in opt.state.values() for v in st.values() if v.ndim}
        ),
        events=[(e.kind, e.op) for e in fsdp.acct.events],
    )


def _loop_optimizer(fsdp, lr: float) -> torch.optim.AdamW:
    """AdamW as the loop builds it (trainer/optim.py: fused on CUDA, foreach on the host when the
    optimizer is offloaded) with the reference's hyperparameters, read off tests/fsdp/scaffold.py's
    `optimizer` so they have one home."""
    d = optimizer([torch.zeros(1, requires_grad=True)], lr).defaults
    (beta1, beta2), eps = d["betas"], d["eps"]
    cfg = OptimConfig(lr=lr, weight_decay=WD, beta1=beta1, beta2=beta2, eps=eps)
    return build_optimizer(fsdp, cfg)


def _to_cpu(tensors: dict) -> dict:
    return {k: v.detach().float().cpu() for k, v in tensors.items()}
