"""The keepers of a run: one named actor per node, started by the first worker there, listed
and looked up from any process, stopped by the driver when the launch ends.

Keepers are named, detached, 0-CPU actors pinned to their node (NodeAffinity, soft=False): they
outlive a failed worker group that Ray Train restarts, and die with their node instead of
moving (a moved keeper would hold nothing). Ray frees a dead actor's name, so the live keepers
are those Ray lists under the run key's names.
"""

from __future__ import annotations

import re
import time

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.elastic import spares
from cluster.snapshots.keeper import SnapshotKeeper

NAMESPACE = "elastic-fsdp"
"""Ray namespace of the keepers, whatever namespace the process that starts them runs in."""
_NAME_PREFIX = "snapshot-keeper"
_RUN_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


_KeeperActor = ray.remote(SnapshotKeeper)

_HANDLES: dict[str, dict[str, ActorHandle]] = {}
"""Per run key, node id -> keeper handle already looked up in this process (one GCS round trip
per keeper saved on every filesystem call)."""

LIST_EVERY_S = 1.0
"""How long a process reuses its listing of a run's live keepers. Listing them is one GCS call
that lists every named actor of the cluster, and a snapshot makes several filesystem calls on
every rank (it was asked on each). A keeper that died meanwhile fails its call, and that drops
the listing; one that appeared meanwhile is seen at the next listing (files written before are
placed among the keepers listed: still two nodes)."""
_LISTED: dict[str, tuple[float, list[str]]] = {}


def check_run_key(run_key: str) -> None:
    if not isinstance(run_key, str) or not _RUN_KEY.match(run_key):
        raise ValueError(
            f"snapshot run_key={run_key!r}; valid: letters, digits, '.', '_' and '-', starting "
            "with a letter or digit (it is the host part of keeper://<run_key>/...)"
        )


def keeper_name(run_key: str, node_id: str) -> str:
    """The Ray actor name of `run_key`'s keeper on node `node_id` (in NAMESPACE)."""
    check_run_key(run_key)
    return f"{_NAME_PREFIX}:{run_key}:{node_id}"


def ensure_keeper(run_key: str, node_id: str) -> ActorHandle:
    """The keeper of `run_key` on node `node_id`, started there if there is none yet.

    Every worker of a node may call this at the same time: they all get the one keeper.
    """
    handle = _KeeperActor.options(
        name=keeper_name(run_key, node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        get_if_exists=True,
        runtime_env=spares.apart(),  # no preload, and no spare taken (it holds torch and MLflow)
    ).remote()
    _HANDLES.setdefault(run_key, {})[node_id] = handle
    listed = _LISTED.get(run_key)
    if listed is not None and node_id not in listed[1]:
        _LISTED[run_key] = (listed[0], [*listed[1], node_id])
    return handle


def _forget(run_key: str, nodes=()) -> None:
    """A keeper call failed: drop those keepers' handles and the listing (asked again next)."""
    for node in nodes:
        _HANDLES.get(run_key, {}).pop(node, None)
    _LISTED.pop(run_key, None)


def keepers(run_key: str, fresh: bool = False) -> dict[str, ActorHandle]:
    """node id -> handle of every live keeper of `run_key`, as listed at most LIST_EVERY_S ago
    (`fresh`: now). A keeper that died (with its node, or stopped) is not listed: Ray frees a
    dead actor's name."""
    prefix = keeper_name(run_key, "")
    listed = _LISTED.get(run_key)
    if fresh or listed is None or time.monotonic() - listed[0] >= LIST_EVERY_S:
        live = [
            a["name"][len(prefix) :]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)
        ]
        _LISTED[run_key] = (time.monotonic(), live)
    else:
        live = listed[1]
    cache = _HANDLES.setdefault(run_key, {})
    for node in set(cache) - set(live):
        cache.pop(node, None)
    out = {}
    for node in live:
        if node not in cache:
            try:
                cache[node] = ray.get_actor(prefix + node, namespace=NAMESPACE)
            except ValueError:  # it died between the listing and the lookup
                continue
        out[node] = cache[node]
    return out


def stop_keepers(run_key: str) -> list[str]:
    """Kill every keeper of `run_key`, freeing the memory its snapshots held (the driver, at the
    end of the job: detached actors outlive it otherwise). Returns their node ids."""
    found = keepers(run_key, fresh=True)
    for handle in found.values():
        ray.kill(handle, no_restart=True)
    _HANDLES.pop(run_key, None)
    _LISTED.pop(run_key, None)
    return sorted(found)


def stop_keeper(run_key: str, node_id: str) -> bool:
    """Kill `run_key`'s keeper on `node_id` (its node is leaving); False if there was none."""
    handle = keepers(run_key, fresh=True).get(node_id)
    if handle is None:
        return False
    ray.kill(handle, no_restart=True)
    _forget(run_key, [node_id])
    return True


def stop_node_keeper(run_key: str) -> None:
    """A node being drained (preempted, or a SIGTERM) goes idle, and leaves, only once nothing
    runs on it; its keeper would keep it. Its snapshot files all have a copy on another node,
    and the drain committed a durable checkpoint anyway. Call it on the leaving node."""
    try:
        stop_keeper(run_key, ray.get_runtime_context().get_node_id())
    except Exception as e:  # another rank of this node stopped it first, or Ray is going
        print(f"snapshots: this node's keeper: {type(e).__name__}: {e}", flush=True)
