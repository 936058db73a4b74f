"""Recovery from a worker crash, with and without spare worker processes (elastic/spares.py).

The real path: a 2-node local Ray (ray.cluster_utils.Cluster, 1 CPU each), the CLI
(`python -m cluster.train`) training a tiny model on 2 workers with an in-memory snapshot every
step, and rank 1 crashing (fault config) late enough that the spares are warm. Ray restarts the
group; the new rank 0 splits the time from the crash to its first step into phases (its
elastic record). Modes alternate within each repetition; medians over the repetitions.

Ray Train's clocks are the test drills' (health check every 0.2 s): detection is not what is
measured here. Run: python -m benchmarks.recovery [--reps 3]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ray.cluster_utils import Cluster

REPO = Path(__file__).resolve().parents[1]
MODEL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.ffn_dim=160",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "train.global_batch_size=6",
    "optim.warmup_steps=2",
]
FAST_RAY_TRAIN_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
    "RAY_USAGE_STATS_ENABLED": "0",
}
MODES = {"spares": "true", "new processes": "false"}
PHASES = ["ray_restart_s", "process_group_s", "imports_s", "build_and_load_s", "first_step_s"]


def run_once(launch: Path, address: str, mode: str, rep: int, a) -> dict:
    name = f"rec-{rep}-{mode.replace(' ', '-')}"
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env.update(FAST_RAY_TRAIN_ENV, RAY_ADDRESS=address, PYTHONPATH=str(REPO))
    args = [
        sys.executable,
        "-m",
        "cluster.train",
        f"hydra.run.dir={launch}/outputs-{name}",
        *MODEL,
        f"data.prepared_dir={launch}/prepared",
        f"train.steps={a.crash_at + 20}",
        "cluster.num_workers=2",
        f"cluster.run_name={name}",
        "tracking.experiment=recovery",
        "fault.kill_rank=1",
        f"fault.at_step={a.crash_at}",
        "fault.kind=crash",
        "train.checkpoint_every=1000",
        "train.snapshot_every=1",
        f"cluster.spare_workers={MODES[mode]}",
    ]
    with open(launch / f"{name}.log", "w") as out:
        run = subprocess.run(args, cwd=launch, env=env, stdout=out, stderr=subprocess.STDOUT)
    rc = run.returncode
    if rc != 0:
        raise SystemExit(f"{name}: exit {rc}; see {launch / f'{name}.log'}")
    records = [
        json.loads(Path(p).read_text())
        for p in sorted(glob.glob(str(launch / "runs" / name / "elastic" / "attempts" / "*.json")))
    ]
    restarted = next(r for r in records if r.get("recovery", {}).get("recovery_s") is not None)
    rec = restarted["recovery"]
    preloaded = (restarted.get("process") or {}).get("preloaded") or float("inf")
    return {
        "recovery_s": rec["recovery_s"],
        **rec["breakdown"],
        "start_workers_s": (rec.get("ray_phases") or {}).get("start_workers_s"),
        "steps_lost": rec["steps_lost"],
        "spare": bool(rec.get("spare")),
        # done importing before the failure (else the restart waited for the rest)
        "warm": bool(rec.get("spare")) and preloaded < (rec.get("failure") or 0),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--crash-at", type=int, default=150, help="the step rank 1 crashes before")
    a = p.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="brec-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp  # the cluster's processes, and the spares, inherit it
    os.environ["PYTHONPATH"] = str(REPO)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args=dict(num_cpus=1, include_dashboard=False, temp_dir=f"{tmp}/ray"),
    )
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        cluster.add_node(num_cpus=1, temp_dir=f"{tmp}/ray")
        cluster.wait_for_nodes()
        launch = Path(tmp) / "launch"
        launch.mkdir()
        for rep in range(a.reps):
            for mode in MODES:
                r = run_once(launch, cluster.address, mode, rep, a)
                results[mode].append(r)
                print(f"rep {rep + 1}/{a.reps} {mode}: {r['recovery_s']:.2f} s", flush=True)
    finally:
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    report(results)
    return 0


def median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def report(results: dict[str, list[dict]]) -> None:
    cols = ["recovery_s", "start_workers_s", *PHASES[1:]]
    names = ["recovery", "Ray start", "pg", "imports", "build+load", "1st step"]
    head = f"{'restart in':<14}" + "".join(f"{n:>11}" for n in names)
    head += f"{'range':>14}{'lost':>6}{'rank 0 in spare':>17}"
    print(head)
    print("-" * len(head))
    summary = {}
    for mode, rows in results.items():
        rec = [r["recovery_s"] for r in rows]
        spare = sum(r["spare"] for r in rows)
        warm = sum(r["warm"] for r in rows)
        line = f"{mode:<14}" + "".join(f"{median(rows, c):>10.2f}s" for c in cols)
        line += f"{f'{min(rec):.1f}-{max(rec):.1f} s':>14}{median(rows, 'steps_lost'):>6.0f}"
        line += f"{f'{spare}/{len(rows)} ({warm} warm)':>17}"
        print(line)
        summary[mode] = {c: round(median(rows, c), 3) for c in cols}
    ratio = summary["spares"]["recovery_s"] / summary["new processes"]["recovery_s"]
    goal = summary["spares"]["recovery_s"] < 6.0
    print(
        f"\nrecovery with spares / without: {ratio:.2f}x; "
        f"goal under 6 s for a worker crash: {'met' if goal else 'NOT met'}"
    )
    print(
        json.dumps(
            {
                "benchmark": "recovery",
                "median": summary,
                "ratio_spares_vs_new": round(ratio, 3),
                "goal_under_6s_met": goal,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
