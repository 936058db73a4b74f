"""Which Ray a job runs on: cluster.address, RAY_ADDRESS, a `ray start` on this machine,
or none (a local Ray is started). No Ray import at the top: the driver asks before it decides
to import Ray at all, and the driver's MLflow (tracking/job.py) asks whether workers share this
machine.

    ray_address(cfg.cluster)      # 'auto', 'host:6379', 'local' or None, as the job names it
    joins_cluster(cfg.cluster)    # True: a running Ray is joined (checked before any write)
    join_address(cfg.cluster)     # the host:port to join (probed), None: start one; NoCluster
"""

from __future__ import annotations

import os
import socket
from typing import Optional

from cluster.config import ClusterConfig


def ray_address(cluster: ClusterConfig) -> str | None:
    """cluster.address, else RAY_ADDRESS (set by `ray job submit`), else None: start locally."""
    return cluster.address or os.environ.get("RAY_ADDRESS") or None


def joins_cluster(cluster: ClusterConfig) -> bool:
    """Whether the job joins a running Ray (an address, RAY_ADDRESS) rather than starting one
    here: the cluster is then checked before anything is written (cluster/train.py)."""
    return ray_address(cluster) not in (None, "local")


class NoCluster(ConnectionError):
    """No Ray to join at the address the job names; the message says where it looked."""


def join_address(cluster: ClusterConfig) -> Optional[str]:
    """The host:port (or ray:// URL) to join, or None to start a local Ray.

    `auto` is resolved as Ray does, but without its last resort: Ray's `auto` joins any Ray
    process it finds on this machine (another program's private instance, a test's), and waits
    long for one it cannot reach. Here `auto` means RAY_ADDRESS (`ray job submit` sets it), else
    the cluster a `ray start` on this machine recorded; an address is probed for a few seconds.
    """
    address = ray_address(cluster)
    if address in (None, "local"):
        return None
    given = f"cluster.address={cluster.address!r}" if cluster.address else "RAY_ADDRESS"
    env = os.environ.get("RAY_ADDRESS")
    if address == "auto" and env and env != "auto":
        address, given = env, f"RAY_ADDRESS={env!r} (for cluster.address='auto')"
    if address == "auto":
        address = started_cluster()
        if address is None:
            raise NoCluster(
                f"{given}: no Ray cluster to join: RAY_ADDRESS is unset and no `ray start` on "
                f"this machine recorded one ({ray_address_file()} is absent); valid: run it on "
                "the cluster (`ray job submit` or python -m cluster.submit), "
                "cluster.address=<head host>:6379, or cluster=local to start Ray here"
            )
        given = f"cluster.address='auto' (the `ray start` in {ray_address_file()})"
    probe(address, given)
    return address


def ray_address_file() -> str:
    """Where `ray start` records its cluster's address (Ray's default temp dir; RAY_TMPDIR)."""
    from ray._common.utils import get_ray_address_file  # noqa: PLC0415 -- ray: a job's only

    return get_ray_address_file(None)


def started_cluster() -> Optional[str]:
    """The GCS address the last `ray start` on this machine wrote, or None."""
    try:
        with open(ray_address_file()) as f:
            return f.read().strip() or None
    except OSError:
        return None


PROBE_TIMEOUT_S = 5.0


def probe(address: str, given: str) -> None:
    """NoCluster unless `address`'s host:port takes a TCP connection within PROBE_TIMEOUT_S
    (ray.init would otherwise wait minutes, printing one warning every 5 s)."""
    host, sep, port = address.rpartition("://")[2].rpartition(":")
    if not sep or not port.isdigit():
        return  # not host:port: Ray says what is wrong with it
    try:
        socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise NoCluster(
            f"{given}: no Ray cluster reachable at {address} ({type(e).__name__}: "
            f"{e.strerror or e}); valid: the address of a running Ray head (its GCS port, "
            "6379 unless changed), or cluster=local to start Ray here"
        ) from None
