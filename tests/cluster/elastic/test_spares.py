"""Spare worker processes (cluster/elastic/spares.py) on a real local Ray: a worker asks its
raylet for a spare, the spare imports the training stack while it waits, and the next actor with
the same runtime env starts in it; keepers neither preload nor take a spare; the spares end with
their job; the preload never touches CUDA.

The actors here stand in for Ray Train's workers: the same runtime env (spares'), one CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import ray

from cluster.elastic import spares
from tests.cluster.elastic_cluster import LocalCluster, wait_until

REPO = Path(__file__).resolve().parents[3]
WARM_TIMEOUT_S = 120.0  # a spare imports torch, Ray Train and MLflow: ~5 s alone, more when busy


class Probe:
    """A stand-in train worker: what its process is, and what it has imported."""

    def pid(self) -> int:
        return os.getpid()

    def process(self):
        return spares.this_process()

    def threads(self) -> tuple[int, int, int]:
        """(OMP_NUM_THREADS, torch's threads before the worker's fix-up, after it)"""
        import torch

        before = torch.get_num_threads()
        spares.match_torch_threads()
        return int(os.environ["OMP_NUM_THREADS"]), before, torch.get_num_threads()

    def imported(self, names: list[str]) -> list[str]:
        return [n for n in names if n in sys.modules]

    def request(self, count: int) -> None:
        spares.request_spares(count)

    def hook(self):
        from ray._private import ray_constants

        return os.environ.get(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR)

    def start_apart(self) -> tuple[int, str]:
        """An actor started the way the keepers are (spares.apart()): its pid and hook."""
        child = ray.remote(Probe).options(num_cpus=0, runtime_env=spares.apart()).remote()
        pid, hook = ray.get(child.pid.remote()), ray.get(child.hook.remote())
        ray.kill(child)
        return pid, hook


def probe_class():
    return ray.remote(Probe).options(num_cpus=1, runtime_env=spares.worker_runtime_env())


def warm_spares(exclude=()) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith(spares.TITLE) and p.pid not in exclude:
            out.append(p)
    return out


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(head_cpus=2)
    try:
        ray.init(address=c.address, logging_level="WARNING")
        yield c
    finally:
        ray.shutdown()
        c.close()


def test_a_new_actor_starts_in_the_warm_spare_its_worker_asked_for(cluster):
    before = {p.pid for p in warm_spares()}
    first = probe_class().remote()
    first_pid = ray.get(first.pid.remote())
    # A process Ray started for the actor ran the hook too, before the actor (it cannot tell).
    started = ray.get(first.process.remote())
    assert started["preloaded"] >= started["started"]
    assert set(ray.get(first.imported.remote(list(spares.PRELOAD)))) == set(spares.PRELOAD)

    ray.get(first.request.remote(1))
    spare = wait_until(lambda: warm_spares(before), WARM_TIMEOUT_S, "a warm spare")[0]
    rss_gib = spare.memory_info().rss / 2**30
    print(f"warm spare {spare.pid}: {rss_gib:.2f} GiB RSS")
    assert spare.pid != first_pid

    ray.kill(first)  # as Ray Train ends a failed group
    failed_at = time.time()
    second = probe_class().remote()
    assert ray.get(second.pid.remote()) == spare.pid
    process = ray.get(second.process.remote())
    assert process["started"] < process["preloaded"] < failed_at  # warm before it was needed
    assert set(ray.get(second.imported.remote(list(spares.PRELOAD)))) == set(spares.PRELOAD)
    # torch was imported before Ray set the actor's OMP_NUM_THREADS: the worker resizes its pool
    omp, before, after = ray.get(second.threads.remote())
    assert after == omp == 1
    if (os.cpu_count() or 1) > 1:
        assert before > 1, "the preload sized torch's pool by the machine's cores"
    ray.kill(second)


def test_actors_started_apart_neither_preload_nor_take_a_spare(cluster):
    before = {p.pid for p in warm_spares()}
    worker = probe_class().remote()
    ray.get(worker.request.remote(1))
    spare = wait_until(lambda: warm_spares(before), WARM_TIMEOUT_S, "a warm spare")[0]
    assert ray.get(worker.hook.remote()) == spares.HOOK
    child_pid, child_hook = ray.get(worker.start_apart.remote())
    assert child_hook == ""  # Ray runs no setup hook in it
    assert child_pid != spare.pid
    assert spare.is_running() and spare.cmdline()[0].startswith(spares.TITLE)  # still idle
    ray.kill(worker)


DRIVER = textwrap.dedent(
    """
    import ray, sys
    from cluster.elastic import spares
    from tests.cluster.elastic.test_spares import probe_class
    ray.init(address=sys.argv[1], logging_level="WARNING")
    worker = probe_class().remote()
    ray.get(worker.request.remote(1))
    print("requested", flush=True)
    sys.stdin.readline()  # the test found the spare
    """
)


def test_spares_end_with_their_job(cluster):
    before = {p.pid for p in warm_spares()}
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, cluster.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert driver.stdout.readline().strip() == "requested"
        spare = wait_until(lambda: warm_spares(before), WARM_TIMEOUT_S, "the job's warm spare")[0]
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert driver.wait(60) == 0
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    wait_until(lambda: not spare.is_running(), 60, f"the ended job's spare {spare.pid} to end")


def test_the_preload_imports_every_module_and_never_touches_cuda():
    """A spare learns its GPU from Ray when its actor comes (CUDA_VISIBLE_DEVICES): CUDA must
    not be initialised, nor its devices counted, before that."""
    code = textwrap.dedent(
        """
        import torch
        calls = []
        def spy(name, real):
            def f(*a, **k):
                calls.append(name)
                return real(*a, **k)
            return f
        if hasattr(torch._C, "_cuda_getDeviceCount"):  # CUDA builds only
            torch._C._cuda_getDeviceCount = spy("getDeviceCount", torch._C._cuda_getDeviceCount)
        torch.cuda._lazy_init = spy("_lazy_init", torch.cuda._lazy_init)
        torch.cuda.is_available = spy("is_available", torch.cuda.is_available)
        torch.cuda.device_count = spy("device_count", torch.cuda.device_count)
        from cluster.elastic import spares
        failed = spares.import_all(spares.PRELOAD)
        print("failed", failed, "calls", calls, "initialized", torch.cuda.is_initialized())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "failed [] calls [] initialized False"


# ---- without Ray ---------------------------------------------------------------------------


def test_spares_are_requested_once_at_a_groups_second_step():
    asked = []
    req = spares.SpareRequest(request=lambda n: asked.append(n))
    req(7)  # the group's first step: its own start-up still runs
    assert req.thread is None
    req(8)
    req.thread.join(10)
    req(9)
    req(10)
    assert asked == [1]


def test_a_failed_request_is_printed_and_training_goes_on(capsys):
    def fail(n):
        raise ConnectionError("raylet gone")

    req = spares.SpareRequest(request=fail)
    req(0)
    req(1)
    req.thread.join(10)
    assert "could not start 1 spare worker process(es) on this node (ConnectionError: raylet " in (
        capsys.readouterr().out
    )


def test_a_process_tells_when_it_started_and_preloaded(monkeypatch):
    monkeypatch.setattr(spares, "_PRELOADED", {})
    assert spares.this_process() is None  # spares off: no hook ran
    monkeypatch.setattr(spares, "_PRELOADED", {"began": 100.0, "done": 104.0})
    assert spares.this_process() == {"started": 100.0, "preloaded": 104.0}


def test_only_the_train_workers_runtime_env_carries_the_hook():
    from ray._private import ray_constants

    var = ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    assert spares.worker_runtime_env() == {"env_vars": {var: spares.HOOK}}
    assert spares.apart() == {"env_vars": {var: ""}}
    module, func = spares.HOOK.rsplit(".", 1)  # what Ray imports in every new worker process
    assert module == spares.__name__ and callable(getattr(spares, func))


@pytest.mark.parametrize(
    "use_gpu, setting, on", [(True, None, True), (False, None, False), (False, True, True)]
)
def test_spares_default_to_gpu_workers(use_gpu, setting, on):
    from cluster.config import ClusterConfig

    assert ClusterConfig(use_gpu=use_gpu, spare_workers=setting).spares_on is on
