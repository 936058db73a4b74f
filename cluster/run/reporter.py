"""Reports to Ray Train from a thread of their own, so that a report never blocks training.

`ray.train.report` puts each result on a queue of one that Ray Train's controller empties when it
polls the workers. While the controller is busy (in a callback of ours: a grow waiting for more
nodes or for the running group's drain; a resize; a slow poll), a second report blocks the
caller until the first is taken. Called from the training loop, that blocked training itself,
and once it blocked a drain's own checkpoint report before the drain was acknowledged: the
controller waited for the acknowledgement, the group for the controller, until the drain timed
out (120 s; the known hang of an earlier stop).

    reporter = Reporter(report_checkpoint)       # one per worker process, on every rank
    ctx.on_checkpoint = reporter.report           # the loop: returns at once
    ...
    reporter.flush(timeout_s)                     # a normal end: every report handed to Ray
    reporter.drop()                               # a leave: the queued ones are not sent

Reports go in the order they were made, from one thread per process: `ray.train.report` is a
barrier across the workers (the checkpoint folder's name is agreed on), and every rank reports
the same steps, so the threads of the ranks pair up as the loop's calls did. What is reported
is only Ray's record: the loop resumes from the run folder (the newest valid checkpoint there),
never from what Ray was told, so a dropped report loses nothing. A report that Ray has not taken
within `slow_s` is logged once (the controller is busy), not waited on.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

_STOP = object()


class Reporter:
    def __init__(
        self,
        send: Callable[[str, int], None],
        slow_s: float = 10.0,
        log: Callable[[str], None] = lambda line: print(line, flush=True),
    ):
        """`send(checkpoint_path, step)` reports to Ray (blocking: it is called on this class's
        thread only). `slow_s`: a report still not taken after this long is logged."""
        self.send, self.slow_s, self.log = send, slow_s, log
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._pending = 0  # reports queued or being sent
        self._dropped = False
        self.sent: list[int] = []  # the steps Ray has taken, in order
        self.errors: list[BaseException] = []
        self.slow_reports: list[int] = []  # the steps logged as not taken within slow_s
        self._thread = threading.Thread(target=self._run, name="ray-report", daemon=True)
        self._thread.start()

    def report(self, checkpoint_path: str, step: int) -> None:
        """WorkerContext.on_checkpoint: queue the report of a committed checkpoint; returns at
        once."""
        with self._lock:
            if self._dropped:
                return
            self._pending += 1
            self._idle.clear()
        self._queue.put((checkpoint_path, step))

    def flush(self, timeout_s: float) -> bool:
        """A normal end: wait until Ray has taken every report (the controller polls a group that
        is finishing), at most `timeout_s`. False (and logged) when some were still not taken."""
        if self._idle.wait(timeout_s):
            return True
        self.log(
            f"ray-report: {self._pending} checkpoint report(s) not taken by Ray Train within "
            f"{timeout_s:.0f} s; ending without them (the checkpoints themselves are committed)"
        )
        return False

    def drop(self) -> None:
        """A leave: reports not yet handed to Ray are not sent (the next group resumes from the
        run folder); one Ray is taking now cannot be withdrawn and ends with the process."""
        with self._lock:
            self._dropped = True
        self._queue.put(_STOP)

    @property
    def pending(self) -> int:
        return self._pending

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            path, step = item
            if not self._dropped:
                slow = threading.Timer(self.slow_s, self._slow, (step,))
                slow.daemon = True
                slow.start()
                try:
                    self.send(path, step)
                    self.sent.append(step)
                except Exception as e:  # Ray's record only: never fail training over it
                    self.errors.append(e)
                    self.log(f"ray-report: reporting step {step} failed ({type(e).__name__}: {e})")
                finally:
                    slow.cancel()
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()

    def _slow(self, step: int) -> None:
        self.slow_reports.append(step)
        self.log(
            f"ray-report: Ray Train has not taken the report of step {step} within "
            f"{self.slow_s:.0f} s (its controller is busy); training goes on"
        )
