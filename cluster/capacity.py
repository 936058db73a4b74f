"""Can the Ray cluster hold the job? Its workers x resources against the cluster's nodes, checked
on the driver in a second, before any trainer is submitted.

    need = Request.of(cfg.cluster)                 # 8 workers x {CPU: 4, GPU: 1}
    problem = need.infeasible(Capacity.of_ray())   # None, or the one error line's text

Ray itself never refuses a request it cannot place: its autoscaler logs "No available node types
can fulfill resource request" and the trainer waits for nodes that never come. Here the request
is compared with

- the nodes alive now (`ray.nodes()`: each node's total resources; a worker's bundle must fit on
  one node, as Ray Train's placement group places them), and
- what the autoscaler can add, where Ray exposes it: the autoscaler's node groups (name,
  resources, max count) that autoscaler v2 reports to the GCS (KubeRay or the cluster launcher
  with autoscaler v2). Autoscaler v1 (KubeRay's default) does not expose its node types to a
  driver: a v1 autoscaler that can launch nodes (its status names real node types, not the
  read-only provider's `node_<id>` of a laptop or a hand-started cluster) is trusted to, with a
  note; with no autoscaler, or a read-only one, a request the nodes cannot hold is refused.

Only the workers' own resources are counted: Ray Train's controller and our helper actors ask for
no CPU (cluster/launch.py starts a local Ray with one CPU to spare).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Optional

from cluster.config import ClusterConfig

EPS = 1e-6  # Ray keeps resources in units of 1/10,000: 0.1 + 0.2 must hold 0.3


def worker_resources(cluster: ClusterConfig) -> dict[str, float]:
    """One worker actor's resources: its CPUs, and one GPU on GPU clusters (ScalingConfig's
    resources_per_worker, cluster/launch.py build_trainer)."""
    return {"CPU": cluster.cpus_per_worker, **({"GPU": 1.0} if cluster.use_gpu else {})}


def fits(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many `bundle`s one node of these total resources holds."""
    counts = [math.floor(node.get(k, 0.0) / v + EPS) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 0


@dataclass
class NodeGroup:
    """One of the autoscaler's node types: its resources and how many of it may exist (-1: no
    limit)."""

    name: str
    resources: dict[str, float]
    max_count: int


@dataclass
class Capacity:
    """What the connected cluster has and can grow to, as far as the driver can see."""

    address: str
    """Where the driver joined (or 'a local Ray started here')."""
    nodes: list[dict[str, float]]
    """Total resources of each node alive now."""
    node_groups: Optional[list[NodeGroup]] = None
    """The autoscaler's node types (autoscaler v2 reports them); None where Ray does not say."""
    autoscaler_v1: bool = False
    """An autoscaler v1 that can launch nodes runs (its node types are not exposed)."""

    @classmethod
    def of_ray(cls, address: str) -> "Capacity":
        """The cluster this process is connected to (ray.init has run)."""
        import ray  # noqa: PLC0415 -- connected already: ray is imported

        nodes = [
            {k: float(v) for k, v in n.get("Resources", {}).items()}
            for n in ray.nodes()
            if n.get("Alive")
        ]
        return cls(address, nodes, _node_groups(), _autoscaler_v1_launches())

    def describe(self) -> str:
        """'1 node with {CPU: 2, GPU: 0} in all': the resources a worker asks for, summed."""
        totals: dict[str, float] = {}
        for node in self.nodes:
            for k in ("CPU", "GPU"):
                totals[k] = totals.get(k, 0.0) + node.get(k, 0.0)
        many = "s" if len(self.nodes) != 1 else ""
        return f"{len(self.nodes)} node{many} with {_fmt(totals)} in all"


@dataclass
class Request:
    """The worker group a job asks for: at least `min_workers` (all of them for a fixed-size
    run) of `bundle` each."""

    min_workers: int
    max_workers: int
    bundle: dict[str, float]
    keys: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, cluster: ClusterConfig) -> "Request":
        lo, hi = cluster.world_sizes
        count = "cluster.min_workers" if cluster.elastic else "cluster.num_workers"
        keys = [count, "cluster.cpus_per_worker", "cluster.use_gpu"]
        return cls(lo, hi, worker_resources(cluster), keys)

    def describe(self) -> str:
        lo, hi = self.min_workers, self.max_workers
        return f"{lo if lo == hi else f'{lo}-{hi}'} workers x {_fmt(self.bundle)}"

    def held_now(self, capacity: Capacity) -> int:
        return sum(fits(node, self.bundle) for node in capacity.nodes)

    def held_at_most(self, groups: list[NodeGroup]) -> float:
        """Workers the autoscaler's node types hold at their max counts (inf: no limit)."""
        total = 0.0
        for g in groups:
            per_node = fits(g.resources, self.bundle)
            if per_node:
                total += math.inf if g.max_count < 0 else per_node * g.max_count
        return total

    def infeasible(self, capacity: Capacity) -> Optional[str]:
        """None when the cluster holds (or its autoscaler can grow to hold) the smallest worker
        group of this request; else the error's text: the request, the cluster, the keys."""
        now = self.held_now(capacity)
        if now >= self.min_workers:
            return None
        groups = capacity.node_groups
        if groups is not None:
            most = self.held_at_most(groups)
            if most >= self.min_workers:
                return None
            grows = (
                "; its autoscaler's node types ("
                + ", ".join(f"{g.name}: {_fmt(g.resources)} x {g.max_count}" for g in groups)
                + f") hold at most {most:g}"
            )
        elif capacity.autoscaler_v1:
            return None  # it may add nodes: Ray does not tell the driver which (see above)
        else:
            grows = " and no autoscaler that can add nodes"
        can_have = capacity.nodes + [g.resources for g in groups or []]
        gpu = "GPU" in self.bundle and not any(n.get("GPU") for n in can_have)
        advice = (
            "cluster.use_gpu=false (this cluster has no GPU), or a cluster.address of one with GPUs"
            if gpu
            else f"at most {now} workers of this size ({self.keys[0]}), fewer CPUs each "
            "(cluster.cpus_per_worker), or a cluster.address of a larger cluster"
        )
        return (
            f"the Ray cluster cannot hold this job: it asks for {self.describe()} "
            f"({', '.join(self.keys)}); the cluster at {capacity.address} has "
            f"{capacity.describe()}, which holds {now} such workers{grows}; valid: {advice}"
        )

    def waits_for(self, capacity: Capacity) -> Optional[str]:
        """A note when the job must wait for the autoscaler (or, elastic, runs below its max)."""
        now = self.held_now(capacity)
        if now >= self.max_workers:
            return None
        if now >= self.min_workers:
            return (
                f"cluster: {capacity.describe()} hold {now} of the {self.max_workers} workers "
                f"x {_fmt(self.bundle)} asked for: the run starts with {now} and grows when "
                "nodes join"
            )
        return (
            f"cluster: {capacity.describe()} hold {now} of the {self.min_workers} workers x "
            f"{_fmt(self.bundle)} asked for: waiting for the autoscaler to add nodes (if none "
            "of its node types fits, Ray's autoscaler says 'No available node types can "
            "fulfill resource request')"
        )


def _fmt(resources: dict[str, float]) -> str:
    """'{CPU: 4, GPU: 1}': the resources a worker asks for (memory and node labels left out)."""
    items = [(k, resources.get(k, 0.0)) for k in ("CPU", "GPU") if k in resources]
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in items) + "}"


def _node_groups() -> Optional[list[NodeGroup]]:
    """The autoscaler's node groups as autoscaler v2 reports them to the GCS; None where none
    reported (autoscaler v1, or none). Ray's internals, probed: where they moved, None."""
    try:
        from ray._private.state import state  # noqa: PLC0415 -- ray's GCS accessor

        config = state.get_cluster_config()
    except Exception:
        return None
    if config is None or not config.node_group_configs:
        return None
    return [
        NodeGroup(g.name, {k: float(v) for k, v in g.resources.items()}, int(g.max_count))
        for g in config.node_group_configs
    ]


READONLY_NODE_TYPE = re.compile(r"^node_[0-9a-f]+$")
"""The read-only provider's anonymous node types (ray/autoscaler/_private/util.py
format_readonly_node_type): a cluster whose nodes were started by hand, which nothing grows."""


def _autoscaler_v1_launches() -> bool:
    """Whether an autoscaler v1 with real node types runs (its status in the GCS's KV names
    them); False for the read-only provider of a laptop or a hand-started cluster."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get  # noqa: PLC0415

        raw = _internal_kv_get("__autoscaling_status")  # ray_constants.DEBUG_AUTOSCALING_STATUS
    except Exception:
        return False
    if not raw:
        return False
    try:
        report = json.loads(raw).get("autoscaler_report") or {}
    except ValueError:
        return False
    types = set(report.get("active_nodes") or {}) | set(report.get("pending_launches") or {})
    types |= set((report.get("node_type_mapping") or {}).values())
    return any(not READONLY_NODE_TYPE.match(t) for t in types)
