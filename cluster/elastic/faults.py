"""Fault drills: before step s, rank r crashes (os._exit) or is drained (SIGTERM), once per run.

A marker is written to the run folder before the fault fires, so the restarted group, or the
same run submitted again, trains through step s.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

from cluster.config import FaultConfig
from cluster.elastic.drain import DrainWatcher
from cluster.run.folder import RunFolder

FAULT_MARKER = "fault.json"
DRAIN_ACK_TIMEOUT_S = 60.0
"""How long a drain drill waits for the worker's SIGTERM handler to run (it runs in the main
thread, which takes signals between Ray's health-check polls:
RAY_TRAIN_HEALTH_CHECK_INTERVAL_S)."""


class FaultInjector:
    """WorkerContext.before_step: config `fault` (kill_rank, at_step, kind) fired once per run.

    The marker is written durably before the fault fires; a restarted group, or the same run
    submitted again, finds it and trains step at_step like any other."""

    def __init__(
        self,
        fault: FaultConfig,
        rank: int,
        folder: RunFolder,
        exit_process: Callable[[int], None] = os._exit,
    ):
        self.fault, self.rank, self.folder = fault, rank, folder
        self.exit_process = exit_process

    def __call__(self, step: int) -> None:
        f = self.fault
        if not f.enabled or self.rank != f.kill_rank or step != f.at_step:
            return
        if self.folder.exists(FAULT_MARKER):
            return
        self.folder.write(
            FAULT_MARKER,
            {
                "kind": f.kind,
                "rank": self.rank,
                "step": step,
                "time": time.time(),
                "pid": os.getpid(),
            },
            durable=True,
        )
        print(f"fault injection: {f.kind} of rank {self.rank} before step {step}", flush=True)
        if f.kind == "crash":
            self.exit_process(1)
        else:
            os.kill(os.getpid(), signal.SIGTERM)
            # The handler runs in the main thread; wait for it, so the drill drains at this step.
            DrainWatcher.wait_for_sigterm(DRAIN_ACK_TIMEOUT_S)
