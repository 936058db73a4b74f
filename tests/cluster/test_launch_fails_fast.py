"""A launch the cluster cannot hold fails in seconds with one error, and leaves nothing behind.

Against a real Ray head of 2 CPUs and no GPU (tests/deploy/local_ray_head.py: its own temp dir,
ports and token, stopped by pid), through the real CLI: 64 workers are refused before the
preflight writes anything (no run folder, no prepared data, no MLflow store). And where there is
no Ray at all: `cluster=ray` (as the README's fine-tuning example runs it) with `address: auto`
and nothing to join, or an address nothing listens on, says so at once instead of Ray's minutes
of waiting. GPU workers on a CPU-only Ray: tests/cluster/test_launch_ends_its_run.py (a local
Ray) and tests/cluster/test_capacity.py (the arithmetic).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
from local_ray_head import RayHead, free_ports, local_ray_head  # noqa: E402

SECONDS_TO_ERROR = 40  # the CLI's own imports take ~6 s on this loaded 2-core machine


@pytest.fixture(scope="module")
def head():
    with local_ray_head(num_cpus=2) as h:
        yield h


def small_job(launch_dir: Path) -> list[str]:
    """Every location under the launch dir, so that what a refused launch wrote shows there."""
    return [
        f"cluster.storage_path={launch_dir}/store",
        f"data.prepared_dir={launch_dir}/prepared",
        "data.max_bytes=200000",
        "data.seq_len=32",
    ]


def launch(launch_dir: Path, *overrides: str, env: dict | None = None):
    start = time.monotonic()
    result = run_cli(launch_dir, *small_job(launch_dir), *overrides, timeout=150, env=env)
    result.seconds = time.monotonic() - start
    print(f"\n[{' '.join(overrides)}] -> rc {result.returncode} in {result.seconds:.1f} s")
    return result


def the_error(result) -> str:
    """rc 1 and exactly one `error:` line, no traceback, in seconds: that line."""
    out = result.output
    assert result.returncode == 1, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert result.seconds < SECONDS_TO_ERROR, f"{result.seconds:.1f} s"
    return errors[0]


def assert_nothing_written(launch_dir: Path) -> None:
    for name in ("store", "prepared", "mlflow.db"):
        assert not (launch_dir / name).exists(), name


def client_env(head: RayHead) -> dict[str, str]:
    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    return {k: head.client_env()[k] for k in keys}


def test_more_workers_than_the_cluster_holds_fail_naming_request_cluster_and_keys(head, launch_dir):
    result = launch(
        launch_dir,
        f"cluster.address={head.gcs_address}",
        "cluster.num_workers=64",
        "train.global_batch_size=64",
        env=client_env(head),
    )
    line = the_error(result)
    for text in (
        "cannot hold this job",
        "64 workers x {CPU: 1}",
        "cluster.num_workers",
        f"the cluster at {head.gcs_address} has 1 node with {{CPU: 2, GPU: 0}}",
        "holds 2 such workers",
        "no autoscaler",
        "valid: at most 2 workers",
    ):
        assert text in line, f"{text!r} not in {line}"
    assert_nothing_written(launch_dir)


def test_address_auto_with_no_cluster_to_join_says_so(launch_dir, tmp_path):
    empty = tmp_path / "ray_tmp"  # no `ray start` recorded a cluster here
    empty.mkdir()
    result = launch(
        launch_dir, "cluster=ray", *small_job(launch_dir), env={"RAY_TMPDIR": str(empty)}
    )
    line = the_error(result)
    assert "cluster.address='auto': no Ray cluster to join" in line, line
    assert "cluster=local" in line, line
    assert "Connecting to existing Ray cluster" not in result.output
    assert_nothing_written(launch_dir)


def test_an_address_nothing_listens_on_fails_in_seconds(launch_dir):
    (port,) = free_ports(1)
    result = launch(launch_dir, f"cluster.address=127.0.0.1:{port}")
    line = the_error(result)
    assert f"no Ray cluster reachable at 127.0.0.1:{port}" in line, line
    assert_nothing_written(launch_dir)
