"""Drain on grow: a node joins, the running group checkpoints the step it is at, then Ray grows it.

Ray Train grows a running elastic group by tearing it down and starting a bigger one: the steps
since the last checkpoint are trained again (1-3 here, up to `train.checkpoint_every` on a real
run). Before Ray executes such a resize, the controller (`ClusterView`, cluster_view.py) asks the
running group to drain, the way a SIGTERM does, and waits for its answer:

    controller                                   rank 0 of the running group
    GrowDrain.request()  -> elastic/drain_request.json {id, reason, time}
                                                 DrainRequests() sees it at its next step poll;
                                                 the ranks agree (the loop's MAX all-reduce),
                                                 commit a checkpoint of the step they are at,
                                                 and leave; rank 0 writes
    GrowDrain.wait()     <- elastic/drain_ack.json {id, step}
    Ray tears the group down and starts the bigger one, which resumes at that step.

The request is removed once answered (or timed out), and carries the launch id, so a request
left open by a controller that died is never another launch's. A group that trains to its end
answers a request it did not see in time (`finished`). The wait is bounded
(`cluster.drain_on_grow_timeout_s`; 0 turns draining on grow off): past it, Ray grows the group
as it would have, and the steps since the last checkpoint are trained again.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable, Optional

from cluster.run.folder import RunFolder

REQUEST = "drain_request.json"
ACK = "drain_ack.json"


class GrowDrain:
    """The controller's side: ask the running group to drain, and wait for it."""

    def __init__(self, folder: RunFolder, timeout_s: float, launch_id: str, poll_s: float = 0.05):
        self.folder, self.timeout_s, self.poll_s = folder, timeout_s, poll_s
        self.launch_id = launch_id

    def drain(self, reason: str, clock: Callable[[], float] = time.monotonic) -> Optional[dict]:
        """Request a drain and wait for the ack: {id, step} when the group drained, None when it
        did not answer within the timeout (or draining is off)."""
        if self.timeout_s <= 0:
            return None
        request = {"id": uuid.uuid4().hex, "reason": reason, "launch": self.launch_id}
        self.folder.write(REQUEST, request)
        deadline = clock() + self.timeout_s
        try:
            while clock() < deadline:
                ack = self.folder.read(ACK)
                if ack and ack.get("id") == request["id"]:
                    return ack
                time.sleep(self.poll_s)  # a file another process writes: nothing to wait on
            return None
        finally:
            self.folder.write(REQUEST, {"id": None, "answered": request["id"]})


class DrainRequests:
    """Rank 0's side, polled every step by DrainWatcher: the reason of an open drain request of
    this launch, else None (a request left open by a launch whose controller died is not this
    launch's). On an object store the request is read at most every `every_s` (a GET costs tens
    of milliseconds); on a local or shared disk, every step."""

    def __init__(self, folder: RunFolder, launch_id: str, every_s: Optional[float] = None):
        self.folder, self.launch_id = folder, launch_id
        self.every_s = every_s if every_s is not None else (0.0 if folder.is_local else 1.0)
        self._read_at = float("-inf")
        self.request: Optional[dict] = None

    def __call__(self) -> Optional[str]:
        if self.request is not None:
            return self.request["reason"]
        now = time.monotonic()
        if now - self._read_at < self.every_s:
            return None
        self._read_at = now
        doc = self.folder.read(REQUEST)
        if doc and doc.get("id") and doc.get("launch") == self.launch_id:
            self.request = doc
            return doc["reason"]
        return None

    def acknowledge(self, step: int) -> None:
        """After the drain's checkpoint committed: tell the controller the group may go."""
        if self.request is not None:
            self.folder.write(ACK, {"id": self.request["id"], "step": step}, durable=True)

    def finished(self, step: int) -> None:
        """The group trained to the end: a request that came after its last poll is answered
        too, or the controller would wait it out (Ray then starts a group that has nothing left
        to train, and the run ends)."""
        self._read_at = float("-inf")
        if self.request is not None or self() is not None:
            self.acknowledge(step)
