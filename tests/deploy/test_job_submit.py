"""`python -m cluster.submit -- python -m cluster.train ...` against a real Ray head.

deploy/README.md section 9, run for real: a Ray 2.60 head on loopback with token authentication
on (its own temp dir, ports and token; tests/deploy/local_ray_head.py), the real entry point
submitted with `python -m cluster.submit` (`ray job submit` with the checkout's git commit added
to the runtime env), the checkout uploaded through .rayignore, two CPU workers, a few steps. One
job backs every test below (1.5-2.5 min on this loaded 2-core machine, most of it Ray and worker
start-up); the head is stopped, and only that head, before they look at what it left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_helpers import REPO_ROOT
from local_ray_head import RayHead, local_ray_head
from mlflow.tracking import MlflowClient

from trainer.checkpoint import list_checkpoints
from trainer.checkpoint.format import data_file_name

JOB_ID = "elastic-fsdp-job-submit-test"
RUN_NAME = "job-submit"
STEPS = 4
WORKERS = 2
SUBMIT_TIMEOUT_S = 480  # generous: another test may run Ray on this 2-core machine meanwhile
MAX_UPLOAD_MIB = 20  # the code is ~1 MiB; a venv or a run's checkpoints would be far more
USER_TOKEN = Path.home() / ".ray" / "auth_token"


@dataclass
class SubmittedJob:
    head: RayHead
    out: Path  # storage, prepared data, MLflow store and Hydra outputs of the job
    returncode: int | None  # of `ray job submit`; None if it timed out
    output: str  # `ray job submit` stdout+stderr: the upload, then the job's own logs
    info: dict  # GET /api/jobs/<id> once the submit command returned
    http_status: dict[str, int]  # GET /api/jobs/ without, with a wrong, with the right token
    uploaded: set[str]  # top-level names of the working dir as the head unpacked it
    uploaded_bytes: int
    user_token_before: tuple | None
    user_token_after: tuple | None = None


def train_overrides(out: Path) -> list[str]:
    """README section 9's command made small: absolute paths, since the job runs in Ray's copy."""
    return [
        "cluster=ray",
        "model=tiny",
        "model.n_layers=2",
        "model.dim=64",
        "model.n_heads=4",
        "model.ffn_dim=128",
        "cluster.use_gpu=false",
        f"cluster.num_workers={WORKERS}",
        "cluster.cpus_per_worker=1",
        "cluster.max_failures=0",
        f"cluster.run_name={RUN_NAME}",
        f"cluster.storage_path={out}/runs",
        f"data.prepared_dir={out}/data",
        "data.max_bytes=50000",
        "data.seq_len=64",
        f"tracking.tracking_uri={tracking_uri(out)}",
        f"tracking.experiment={RUN_NAME}",
        f"train.steps={STEPS}",
        "train.checkpoint_every=2",
        "train.global_batch_size=4",
        "optim.warmup_steps=1",
        f"hydra.run.dir={out}/outputs",
    ]


def tracking_uri(out: Path) -> str:
    return f"sqlite:///{out}/mlflow.db"  # out is absolute: four slashes


def submit_command(head: RayHead, out: Path) -> list[str]:
    """deploy/README's `python -m cluster.submit` (ray job submit, the checkout's commit added
    to the runtime env given here; --working-dir defaults to the checkout)."""
    runtime_env = {"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}}
    return [
        sys.executable,
        "-m",
        "cluster.submit",
        "--address",
        head.dashboard_url,
        "--submission-id",
        JOB_ID,
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--",
        "python",
        "-m",
        "cluster.train",
        *train_overrides(out),
    ]


def get(head: RayHead, path: str, token: str | None) -> tuple[int, bytes]:
    """GET on the head's dashboard, with `Authorization: Bearer <token>` unless token is None."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = urllib.request.Request(head.dashboard_url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def token_file_state() -> tuple | None:
    """The user's own ~/.ray/auth_token as (size, mtime): compared, never read or written."""
    if not USER_TOKEN.exists():
        return None
    st = USER_TOKEN.stat()
    return st.st_size, st.st_mtime_ns


def unpacked_working_dir(head: RayHead) -> tuple[set[str], int]:
    """The uploaded package as the head unpacked it for the job: its top-level names and its
    bytes (the zip that crossed the wire was at most that; Ray keeps no copy of it)."""
    unpacked = head.session_dir() / "runtime_resources" / "working_dir_files"
    packages = [p for p in unpacked.iterdir() if p.is_dir()] if unpacked.is_dir() else []
    if len(packages) != 1:
        return {f"<{len(packages)} packages in {unpacked}>"}, 0
    files = [f for f in packages[0].rglob("*") if f.is_file()]
    return {p.name for p in packages[0].iterdir()}, sum(f.stat().st_size for f in files)


def submit(head: RayHead, out: Path) -> tuple[int | None, str]:
    """Run `ray job submit`; it tails the job's logs and returns once the job has ended.
    (exit code, output); the exit code is None if it was still running after the timeout."""
    try:
        proc = subprocess.run(
            submit_command(head, out),
            env={**head.client_env(), "PYTHONPATH": str(REPO_ROOT)},  # cwd is not the checkout
            cwd=out,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=SUBMIT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        output = e.stdout or b""  # bytes even with text=True
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        return None, output + f"\n<ray job submit still running after {SUBMIT_TIMEOUT_S}s>"
    return proc.returncode, proc.stdout


def job_info(head: RayHead) -> dict:
    """The job as the head reports it (what `ray job status` prints), asked with the token."""
    status, body = get(head, f"/api/jobs/{JOB_ID}", head.token)
    if status != 200:
        return {"status": f"HTTP {status}", "body": body.decode(errors="replace")}
    return json.loads(body)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> SubmittedJob:
    """Start a head, submit the job, wait for it to end, stop the head; record what happened."""
    out = tmp_path_factory.mktemp("job_submit")
    before = token_file_state()
    with local_ray_head(num_cpus=3) as head:
        tokens = {"none": None, "wrong": "0" * 64, "right": head.token}
        http_status = {name: get(head, "/api/jobs/", token)[0] for name, token in tokens.items()}
        returncode, output = submit(head, out)
        record = SubmittedJob(
            head,
            out,
            returncode,
            output,
            job_info(head),
            http_status,
            *unpacked_working_dir(head),
            before,
        )
    record.user_token_after = token_file_state()
    return record


def test_job_succeeded(job):
    assert job.info["status"] == "SUCCEEDED", f"{job.info}\n{job.output[-6000:]}"
    assert job.returncode == 0
    assert f"Job '{JOB_ID}' succeeded" in job.output
    assert job.info["driver_exit_code"] == 0


def test_job_joined_the_head_on_loopback_instead_of_starting_its_own_ray(job):
    """cluster/launch.py takes RAY_ADDRESS, which `ray job` sets to the head's GCS."""
    assert f"Connecting to existing Ray cluster at address: {job.head.gcs_address}" in job.output, (
        job.output[-6000:]
    )
    assert "started a local Ray for this job" not in job.output


def test_head_refuses_clients_without_its_token_and_the_users_token_is_untouched(job):
    assert job.http_status == {"none": 401, "wrong": 403, "right": 200}
    assert job.user_token_after == job.user_token_before


def test_upload_is_the_code_only_and_small(job):
    """.rayignore at work on what reached the head. Ray 2.60 drops .git and .venv by itself; the
    checkout's runs/ (and data/, outputs/, mlruns/ once a run made them) only .rayignore drops."""
    assert job.uploaded_bytes < MAX_UPLOAD_MIB * 2**20, f"{job.uploaded_bytes / 2**20:.1f} MiB"
    assert {"cluster", "trainer", "conf", "pyproject.toml"} <= job.uploaded
    assert not job.uploaded & {
        ".venv",
        ".git",
        "runs",
        "outputs",
        "multirun",
        "data",
        "mlruns",
        "mlflow.db",
    }, sorted(job.uploaded)


def test_mlflow_has_the_finished_run_with_a_loss_per_step(job):
    client = MlflowClient(tracking_uri(job.out))
    experiment = client.get_experiment_by_name(RUN_NAME)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert (params["cluster.num_workers"], params["train.steps"]) == (str(WORKERS), str(STEPS))
    assert run.data.tags["checkpoint_root"] == f"{job.out}/runs/{RUN_NAME}/checkpoints"
    losses = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in losses] == list(range(1, STEPS + 1))  # step N = N steps done
    assert losses[-1].value < losses[0].value


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_run_names_the_commit_and_dirty_state_of_the_submitting_checkout(job):
    """The job ran from Ray's copy of the working tree, without .git: cluster.submit carried
    the answer over (asked of git here, independently of the code under test)."""
    client = MlflowClient(tracking_uri(job.out))
    (run,) = client.search_runs([client.get_experiment_by_name(RUN_NAME).experiment_id])
    head = git("rev-parse", "HEAD")
    dirty = "true" if git("status", "--porcelain", "--untracked-files=no") else "false"
    assert f"source: {head[:12]}" in job.output
    assert run.data.tags["mlflow.source.git.commit"] == head
    assert run.data.tags["git_dirty"] == dirty


def test_both_ranks_wrote_their_shards_of_every_checkpoint(job):
    checkpoints = list_checkpoints(f"{job.out}/runs/{RUN_NAME}/checkpoints")
    assert [c.step for c in checkpoints] == [STEPS, STEPS // 2]
    for c in checkpoints:
        assert c.problem is None, c
        for rank in range(WORKERS):
            assert Path(c.path, data_file_name(rank, WORKERS)).stat().st_size > 0


def test_stopping_the_head_left_none_of_its_processes_and_removed_its_temp_dir(job):
    assert job.head.processes() == [], job.head.killed
    assert job.head.process.returncode is not None
    assert not job.head.temp_dir.exists()
