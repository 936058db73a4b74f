"""A multi-node Ray cluster on this machine for the elastic tests, and the real CLI run against it.

`ray.cluster_utils.Cluster` starts a head node and extra nodes as separate raylets, each with
its own logical CPUs; a node removed takes its worker processes with it, as a lost machine would.
The cluster lives under its own short RAY_TMPDIR (unix socket paths are length-limited), so
its address file never redirects another test's `ray.init()` to it, nor this one to another's.
The CLI runs as a subprocess in its own process group with RAY_ADDRESS set, its output going to a
file the test can read while it runs.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]

# Ray Train's clocks, shortened: a failure is seen within 0.2 s (default 2 s), a preemption
# notice within 0.5 s (5 s), and a group start that cannot be placed gives up after 10 s (60 s).
# The driver passes them on to Ray Train's controller and workers.
FAST_RAY_TRAIN_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
    "RAY_USAGE_STATS_ENABLED": "0",
}


class LocalCluster:
    """A head node plus worker nodes, each `cpus` logical CPUs; shut down by `close()`."""

    def __init__(self, head_cpus: int):
        from ray.cluster_utils import Cluster  # noqa: PLC0415 -- ray: seconds, when one starts

        self.tmp = tempfile.mkdtemp(prefix="efr", dir="/tmp")
        self.ray_tmp = os.path.join(self.tmp, "ray")  # where Ray looks under RAY_TMPDIR
        os.makedirs(self.ray_tmp)
        self._saved_env = {
            k: os.environ.get(k) for k in ("RAY_TMPDIR", "PYTHONPATH", "RAY_USAGE_STATS_ENABLED")
        }
        os.environ["RAY_TMPDIR"] = self.tmp  # inherited by every Ray process this cluster starts
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
        )
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        self.cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={
                "num_cpus": head_cpus,
                "temp_dir": self.ray_tmp,
                "include_dashboard": False,
            },
        )

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, cpus: int = 1):
        return self.cluster.add_node(num_cpus=cpus, temp_dir=self.ray_tmp)

    def add_nodes(self, count: int, cpus: int = 1) -> list:
        """`count` nodes started together (add_node waits for each in turn)."""
        added = [
            self.cluster.add_node(wait=False, num_cpus=cpus, temp_dir=self.ray_tmp)
            for _ in range(count)
        ]
        self.cluster.wait_for_nodes()
        return added

    def remove_node(self, node) -> None:
        self.cluster.remove_node(node)

    def remove_nodes(self, nodes: list) -> None:
        """Remove `nodes` at once, as machines lost together (a rack, a zone): one thread each,
        since removing one waits for its processes to end."""
        errors = []

        def remove(node):
            try:
                self.cluster.remove_node(node)
            except BaseException as e:  # handed to the caller below
                errors.append(e)

        threads = [threading.Thread(target=remove, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def preempt_node(self, node, deadline_s: float = 60.0) -> None:
        """Tell Ray the node will be preempted in deadline_s, as a cloud's spot reclaim does.

        Ray stops placing work there and announces it to Ray Train's preemption watcher; the
        node's raylet exits once nothing runs on it."""
        import ray  # noqa: PLC0415 -- ray costs seconds to import: loaded by the cluster already
        from ray.core.generated import autoscaler_pb2  # noqa: PLC0415 -- the same

        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        deadline_ms = int((time.time() + deadline_s) * 1000)
        accepted, why = ray._raylet.GcsClient(address=self.address).drain_node(
            node.node_id, reason, "elastic test: preemption", deadline_ms
        )
        assert accepted, f"Ray refused to drain node {node.node_id}: {why}"

    def occupy(self, node) -> None:
        """Keep something running on `node` (a detached actor using no CPU). Ray lets a drained
        node's raylet exit once nothing runs on it; on a cloud, a preempted machine lives on
        until its deadline. Occupied, the node plays the cloud's: drained yet still there."""
        code = (
            "import sys, ray\n"
            "from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy\n"
            "ray.init(address=sys.argv[1], logging_level='ERROR')\n"
            "@ray.remote(num_cpus=0)\n"
            "class Occupant:\n"
            "    def ready(self): return True\n"
            "a = Occupant.options(name='occupant-' + sys.argv[2], namespace='elastic-test',\n"
            "    lifetime='detached',\n"
            "    scheduling_strategy=NodeAffinitySchedulingStrategy(sys.argv[2], soft=False),\n"
            ").remote()\n"
            "ray.get(a.ready.remote())\n"
        )
        subprocess.run(
            [sys.executable, "-c", code, self.address, node.node_id], check=True, timeout=120
        )

    def close(self) -> None:
        try:
            self.cluster.shutdown()
            keep_ray_logs(self.ray_tmp)
        finally:
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            shutil.rmtree(self.tmp, ignore_errors=True)


RAY_LOGS_KEPT = Path(os.environ.get("ELASTIC_RAY_LOGS", "/tmp/elastic-ray-logs"))
"""Where the Ray logs of the last clusters these tests ran are kept (the cluster's own folder is
removed): what the workers, raylets and controller wrote, for a drill that failed in CI."""


def keep_ray_logs(ray_tmp: str, keep: int = 2, max_file_bytes: int = 32 * 2**20) -> None:
    logs = Path(ray_tmp) / "session_latest" / "logs"
    if not logs.is_dir():
        return
    dest = RAY_LOGS_KEPT / time.strftime("%Y%m%d-%H%M%S")
    shutil.copytree(
        logs,
        dest,
        symlinks=False,
        ignore=lambda d, names: [n for n in names if _too_big(Path(d) / n, max_file_bytes)],
        dirs_exist_ok=True,
    )
    for old in sorted(RAY_LOGS_KEPT.iterdir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _too_big(path: Path, limit: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size > limit
    except OSError:
        return True


@dataclass
class CliRun:
    """`python -m cluster.train` running in the background; output in `log`."""

    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """The exit status; on a timeout the whole process group is killed and AssertionError
        raised."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"cluster.train did not finish in {timeout}s; output:\n{self.output()[-8000:]}"
            )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_cli(
    launch_dir: Path,
    address: Optional[str],
    *overrides: str,
    env: Optional[dict] = None,
    name: str = "cli",
) -> CliRun:
    """The real entry point against the cluster at `address` (None: a local Ray of its own),
    launched from `launch_dir`; output in <name>.log. Launches of one folder need their own
    names."""
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")
    }
    full_env.update(FAST_RAY_TRAIN_ENV, **({"RAY_ADDRESS": address} if address else {}))
    full_env.update(env or {})
    log = launch_dir / f"{name}.log"
    outputs = "outputs" if name == "cli" else f"outputs-{name}"
    args = [
        sys.executable,
        "-m",
        "cluster.train",
        f"hydra.run.dir={launch_dir}/{outputs}",
        *overrides,
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            args,
            cwd=launch_dir,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return CliRun(proc, log)


def attempts(run_dir: Path) -> list[dict]:
    """The elastic records of a run (cluster/elastic/tracker.py), oldest first; torn ones left
    out."""
    out = []
    for path in sorted(glob.glob(str(run_dir / "elastic" / "attempts" / "*.json"))):
        try:
            out.append(json.loads(Path(path).read_text()))
        except ValueError:
            continue
    return out


def wait_until(
    condition: Callable[[], object], timeout: float, what: str, run: Optional[CliRun] = None
):
    """Poll `condition` (a file the run writes) until it holds; fail early if the run ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(
                f"the run ended (exit {run.proc.returncode}) before {what}:\n{run.output()[-8000:]}"
            )
        time.sleep(0.05)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}"
        + (f":\n{run.output()[-8000:]}" if run else "")
    )
