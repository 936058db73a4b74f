"""A launch's snapshots, from the key its keepers share to their end: what the driver and the
workers decide about them, in one place.

    snaps = for_launch(cfg, launch_id, died_before(lease))   # the driver, before the workers
    ...                                                       # each worker, at each group start:
    snaps = LaunchSnapshots.of(cfg, launch.launch_id, launch.previous_launch_id)
    snaps.root()                 # keeper://<key>/snapshots; starts this node's keeper
    snaps.inherited_root()       # the dead previous launch's root, for the resume to read
    snaps.release_inherited()    # rank 0: stops the previous launch's keepers, once not needed
    snaps.stop_node_keeper()     # elastic/leave.py: this node leaves, and so does its keeper
    snaps.stop()                 # the driver, at the launch's end

A launch (one `python -m cluster.train`) keeps its snapshots under a key of its own (`run_key_of`):
they live as long as the launch (keepers are detached actors: the driver stops them when it
ends), and a new launch never writes an old one's. A launch whose driver was killed leaves its
keepers running; the next launch of the run reads their snapshots too (its resume may find them
newer than the durable checkpoint) and stops them once its own state is committed. Whether a
launch takes snapshots at all: cluster.config.snapshots_on.

Ray is imported only where a keeper is started, looked up or stopped: the driver imports this
module before it decides to import Ray.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Optional

from cluster.config import JobConfig, snapshots_on
from trainer.metrics import print0


def run_key_of(run_name: str, launch_id: str) -> str:
    """The keepers' key of one launch of a run: its snapshots live as long as the launch (the
    driver stops the keepers when it ends), and a new launch never reads an old one's."""
    launch = hashlib.sha1(launch_id.encode()).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9._-]', '-', run_name).lstrip('._-') or 'run'}-{launch}"


@dataclass(frozen=True)
class LaunchSnapshots:
    """One launch's snapshots: its keepers' key, and the dead launch whose snapshots it reads."""

    run_name: str
    launch_id: str
    on: bool
    """Whether this launch takes snapshots (cluster.config.snapshots_on)."""
    previous_launch_id: Optional[str] = None
    """The run's previous launch when it died without ending and this launch reads its
    snapshots (only when `on`: a launch without snapshots reads none)."""

    @classmethod
    def of(
        cls, cfg: JobConfig, launch_id: str, previous_launch_id: Optional[str] = None
    ) -> "LaunchSnapshots":
        on = snapshots_on(cfg)
        return cls(cfg.cluster.run_name, launch_id, on, previous_launch_id if on else None)

    @property
    def key(self) -> str:
        return run_key_of(self.run_name, self.launch_id)

    def root(self) -> Optional[str]:
        """Where this launch's snapshots go: keeper://, the memory of a keeper actor per node,
        each file on its writer's node and the next (keeper_fs.py); this node's keeper is
        started here if no worker started it yet. None when snapshots are off."""
        if not self.on:
            return None
        import ray  # noqa: PLC0415 -- ray: seconds to import; loaded already in a worker

        from cluster.snapshots import keeper_fs, keepers  # noqa: PLC0415 -- imports ray

        keeper_fs.register_keeper_scheme()
        keepers.ensure_keeper(self.key, ray.get_runtime_context().get_node_id())
        return keeper_fs.snapshots_url(self.key)

    def inherited_root(self) -> Optional[str]:
        """The previous launch's snapshot root, for the resume to read; None without one."""
        if self.previous_launch_id is None:
            return None
        from cluster.snapshots import keeper_fs  # noqa: PLC0415 -- imports ray

        previous = run_key_of(self.run_name, self.previous_launch_id)
        return keeper_fs.snapshots_url(previous)  # root() registered the scheme

    def release_inherited(self) -> Optional[Callable[[], None]]:
        """What stops the previous launch's keepers (and frees the memory of its snapshots) once
        this launch's own first snapshot or checkpoint is committed; None without one."""
        if self.previous_launch_id is None:
            return None
        previous = self.previous_launch_id
        key = run_key_of(self.run_name, previous)

        def release() -> None:
            from cluster.snapshots import keepers  # noqa: PLC0415 -- imports ray

            stopped = keepers.stop_keepers(key)
            if stopped:
                print0(
                    f"snapshots: stopped the {len(stopped)} keeper(s) of the previous launch "
                    f"{previous} (this launch's own state is committed): their memory is free"
                )

        return release

    def stop_node_keeper(self) -> Optional[Callable[[], None]]:
        """What stops this node's keeper when its node leaves (elastic/leave.py calls it); None
        when snapshots are off."""
        if not self.on:
            return None
        from cluster.snapshots import keepers  # noqa: PLC0415 -- imports ray

        key = self.key
        return lambda: keepers.stop_node_keeper(key)

    def stop(self) -> None:
        """The driver, at the launch's end: free the memory of its keepers and of the inherited
        ones (they are detached actors: they would outlive this driver)."""
        if not self.on:
            return
        for launch_id in filter(None, (self.launch_id, self.previous_launch_id)):
            stop_keepers(run_key_of(self.run_name, launch_id))


def for_launch(
    cfg: JobConfig, launch_id: str, previous_launch_id: Optional[str]
) -> LaunchSnapshots:
    """The driver, before its workers start: this launch's snapshots. `previous_launch_id`: the
    run's previous launch if it died without ending (cluster/train.py died_before): its keepers
    still hold its newest state, which the resume reads too (said here); when this launch keeps
    no snapshots nothing would read them, and they are stopped now."""
    snaps = LaunchSnapshots.of(cfg, launch_id, previous_launch_id)
    if snaps.previous_launch_id:
        print(
            f"snapshots: the previous launch {previous_launch_id} ended without stopping its "
            "keepers; the resume also reads their snapshots"
        )
    elif previous_launch_id:
        stop_keepers(run_key_of(cfg.cluster.run_name, previous_launch_id))
    return snaps


def stop_keepers(key: str) -> None:
    """Stop the keepers of `key`, saying so when they cannot be (the run's outcome stands)."""
    from cluster.snapshots import keepers  # noqa: PLC0415 -- imports ray

    try:
        keepers.stop_keepers(key)
    except Exception as e:  # the run's outcome stands; say what was left
        print(f"warning: could not stop the snapshot keepers ({type(e).__name__}: {e})")
