"""Graceful drain: a SIGTERM or Ray's preemption notice makes the loop checkpoint and leave.

A SIGTERM to the worker (Kubernetes, a spot reclaim, the drain drill) or Ray's preemption notice
(what ray.train.get_preemption_info returns) makes the loop commit a checkpoint of the current
step and leave, so a graceful leave loses no step. The handler is installed in each worker's main
thread by `SigtermCallback` (Python only lets that thread); `DrainWatcher` is the loop's
should_stop. How the group then leaves: leave.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Optional

import ray.train
from ray.train.v2._internal.execution.callback import WorkerCallback

try:  # Ray's internals, probed: where they moved, preemption_notice uses the public call
    from ray.train.v2._internal.execution.context import get_train_context
except ImportError:
    get_train_context = None


class DrainedError(RuntimeError):
    """Raised by a worker that left early and gracefully: Ray Train then restarts the group.

    Returning normally would tell Ray the training is finished; an error makes it restart the
    group (counted against FailureConfig.max_failures) from the checkpoint just committed."""


class _Sigterm:
    """This worker process's view of SIGTERM. A SIGTERM is a graceful-drain request only while the
    loop is training (`training`) and Ray is not tearing the group down (`teardown`): then there
    is a step to checkpoint. Otherwise, or at a second SIGTERM, the previous handler runs (Ray's
    exits the process at once): holding on would only keep the worker's CPU/GPU from the next
    group until Ray escalates to SIGKILL (seen here: the next group waited 30 s for its CPU)."""

    requested = threading.Event()
    training = False
    teardown = False
    previous = signal.SIG_DFL


def install_sigterm_handler() -> None:
    """Take over SIGTERM in this process. Must run in its main thread (Python's rule)."""
    _Sigterm.previous = signal.getsignal(signal.SIGTERM)
    _Sigterm.requested.clear()
    _Sigterm.training = _Sigterm.teardown = False
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    if _Sigterm.training and not _Sigterm.teardown and not _Sigterm.requested.is_set():
        _Sigterm.requested.set()
        print(
            f"pid {os.getpid()}: SIGTERM: checkpointing the current step before leaving", flush=True
        )
        return
    previous = _Sigterm.previous
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, previous)
    os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def training():
    """Around run_training in the worker: the span in which a SIGTERM means "checkpoint, then
    go"."""
    _Sigterm.training = True
    try:
        yield
    finally:
        _Sigterm.training = False


WORKER_TIMES: dict[str, float] = {}
"""Per worker process: 'context' = when Ray had created this worker and its train context."""


class SigtermCallback(WorkerCallback):
    """Ray Train worker callback. Its hooks run as actor tasks in each worker process's main
    thread (the training function runs in another), the one thread that may install a signal
    handler. `before_worker_shutdown` is Ray tearing the group down (a restart or a resize):
    the SIGTERM that follows it must end the process at once."""

    def after_init_train_context(self):
        WORKER_TIMES["context"] = time.time()
        install_sigterm_handler()

    def before_worker_shutdown(self):
        _Sigterm.teardown = True


class DrainWatcher:
    """WorkerContext.should_stop: True once a SIGTERM arrived, Ray announced a preemption or the
    controller asked the group to drain (a node joined: grow.py).

    `preemption_info` returns Ray's notice or None (`preemption_notice()` under Ray). It is
    called on every poll, even once the answer is known: the public ray.train.get_preemption_info
    is a barrier across the workers, so every rank must call it as often as the others (the loop
    polls once per step on every rank, then agrees across ranks with a MAX all-reduce)."""

    def __init__(
        self,
        rank: int,
        preemption_info: Optional[Callable[[], object]] = None,
        requests: Optional[Callable[[], Optional[str]]] = None,
    ):
        """`requests`: rank 0's reader of the controller's drain requests (grow.py
        DrainRequests: a node joined); it returns the request's reason or None."""
        self.rank = rank
        self.preemption_info = preemption_info
        self.requests = requests
        self.reason: Optional[str] = None
        self.leaving = False
        """This process itself must go (it got the SIGTERM, or its node is being preempted);
        the other ranks only stop because it does."""
        self.preempted: list[int] = []
        """The ranks Ray's preemption notice named, once this rank saw it."""

    def __call__(self) -> bool:
        info = self.preemption_info() if self.preemption_info is not None else None
        if self.reason is None:
            if _Sigterm.requested.is_set():
                self.reason, self.leaving = "SIGTERM", True
            elif info is not None:
                self.reason = (
                    f"Ray preemption notice for ranks {list(info.preempted_ranks)} "
                    f"(deadline {info.deadline_ms} ms)"
                )
                self.leaving = self.rank in info.preempted_ranks
            elif self.requests is not None and (request := self.requests()) is not None:
                self.reason = f"drain requested ({request})"
            if self.reason is not None:
                print(
                    f"rank {self.rank}: {self.reason}: leaving after a checkpoint of this step",
                    flush=True,
                )
        if info is not None and not self.preempted:  # (also after another reason to stop)
            self.preempted = [int(r) for r in info.preempted_ranks]
            self.leaving = self.leaving or self.rank in self.preempted
        return self.reason is not None

    def leaving_ranks(self) -> list[int]:
        """The ranks this one knows must go: those a preemption notice it saw named, and
        itself when it must go (a SIGTERM). Polled once more first, on every rank alike (the
        public notice call is a barrier): the notice may have come since the last step."""
        self()
        return sorted(set(self.preempted) | ({self.rank} if self.leaving else set()))

    @staticmethod
    def wait_for_sigterm(timeout: float) -> bool:
        return _Sigterm.requested.wait(timeout)


def preemption_notice() -> Callable[[], object]:
    """This worker's copy of Ray's preemption notice, read without a barrier.

    ray.train.get_preemption_info() is a barrier across the workers: an actor round trip for
    every rank, 2.7 ms per call measured here, every step. Ray's PreemptionWatcher hands the same
    notice to every worker, and the loop already agrees on stopping with one MAX all-reduce, so
    the local copy is enough. Where Ray's internals differ, the public call is used."""
    if get_train_context is None:
        return ray.train.get_preemption_info
    try:
        context = get_train_context()
        context.preemption_context.preemption_info  # noqa: B018 -- probe the attribute path
        return lambda: context.preemption_context.preemption_info
    except AttributeError:
        return ray.train.get_preemption_info
