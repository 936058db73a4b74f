"""`python -m benchmarks.engine` (and with --compile) runs end to end in its quickest mode and ends
with its JSON line.

Not a timing test: both models (tiny and mid), one timed and one profiled step of each contestant
on a 1 x 16 token batch, only to prove that the benchmark still builds every contestant, trains
them on identical gradients, measures exposed communication for ours and FSDP2 and reports its
figures and goals per model. About 20 s on 2 idle cores.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--world", "2", "--steps", "1", "--reps", "1", "--warmup", "0", "--profile-steps", "1"]
QUICK += ["--batch", "1", "--seq", "16", "--models", "tiny,mid"]
CONTESTANTS = {
    "tiny": ("full_shard", "shard_grad_op", "no_shard", "fsdp2", "ddp"),
    "mid": ("full_shard", "fsdp2", "ddp"),  # the mid model's default contestants
}
PARAMS = {"tiny": 3_541_248, "mid": 35_660_288}
GOALS = ("goal_step_time_le_0.9x_fsdp2", "goal_exposed_le_fsdp2", "goal_peak_le_fsdp2")


def run_quick() -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", *QUICK],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_engine_benchmark_quick_run_reports_both_models_and_ends_with_headline_json():
    lines, head = run_quick()
    assert sum(line.startswith("ours FULL_SHARD") for line in lines) >= 2, lines  # tables first
    assert set(head["models"]) == {"tiny", "mid"}
    assert head["world"] == 2 and isinstance(head["all_goals_met"], bool)
    for model, names in CONTESTANTS.items():
        m = head["models"][model]
        assert m["tokens_per_step"] == 2 * 1 * 16 and m["params"] == PARAMS[model]
        for name in names:
            for key in ("ms", "tokens_per_s", "peak_bytes", "comm_bytes", "exposed_ms"):
                assert m[f"{name}_{key}"] > 0, (model, name, key)
        for key in ("step_time_vs_fsdp2_paired", "step_time_vs_ddp", "exposed_vs_fsdp2"):
            assert m[f"full_shard_{key}"] > 0, (model, key)
        assert all(isinstance(m[g], bool) for g in GOALS), m
        # FSDP2's collectives were found in its trace, and it blocked in them (gloo runs them
        # synchronously); ours' wait is the engine's own count.
        assert {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_"} <= set(m["fsdp2_comm_ops"])
        assert m["fsdp2_exposed_wait_ms"] > 0 and m["fsdp2_comm_launch_ms"] > 0
        assert m["full_shard_exposed_wait_ms"] >= 0 and m["full_shard_comm_launch_ms"] > 0
        # Same gradients for everyone (fp32): after the updates the losses still agree.
        assert m["max_loss_rel_diff_vs_fsdp2"] < 1e-4, model
        # Ours FULL_SHARD and FSDP2 move the same bytes: the same units (embedding, blocks,
        # norm + output kept after forward, an empty root), and every parameter's dim 0 is even,
        # so FSDP2's per-parameter padding and ours per flat parameter coincide (none).
        assert m["full_shard_comm_bytes"] == m["fsdp2_comm_bytes"], model
        # Between steps: the fp32 shard and AdamW's two moments, 12 bytes per parameter over 2
        # ranks (nothing padded); zero_grad freed the gradient shards, as FSDP2's does.
        assert m["full_shard_acct_persistent_bytes"] == 12 * PARAMS[model] // 2, model
        # The step-time model (trainer/plan/steptime.py on this machine's measured rates)
        # predicts each of ours beside its measurement (docs/planner.md's "here" command).
        for name in (n for n in names if n in ("full_shard", "shard_grad_op", "no_shard")):
            pred, ratio = m[f"{name}_predicted_ms"], m[f"{name}_predicted_vs_measured"]
            assert pred > 0 and ratio == pytest.approx(pred / m[f"{name}_ms"], rel=0.01), name
    assert any(line.startswith("step-time model (this machine") for line in lines), lines[-30:]


COMPILE = ("full_shard", "full_shard_compiled", "fsdp2", "fsdp2_compiled")
COMPILE += ("compute_only", "compute_only_compiled")
COMPILE_GOALS = (
    "goal_compiled_le_0.9x_fsdp2_compiled",
    "goal_le_1.15x_compute_only",
    "goal_compiled_le_1.15x_compute_only_compiled",
)


def run_compile_quick(backend: str) -> dict:
    quick = [a for a in QUICK if a != "tiny,mid"]
    quick[quick.index("--models") + 1 :] = ["tiny"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", *quick, "--compile"]
        + ["--compile-backend", backend],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("goals, compiled:") for line in lines), lines[-20:]
    return json.loads(lines[-1])


def check_compile_headline(head: dict) -> None:
    assert head["compile"] is True and set(head["models"]) == {"tiny"}
    m = head["models"]["tiny"]
    for name in COMPILE:
        assert m[f"{name}_ms"] > 0 and m[f"{name}_tokens_per_s"] > 0, name
    for name in ("full_shard_compiled", "fsdp2_compiled", "compute_only_compiled"):
        assert m[f"{name}_compile_s"] is not None, name  # the first step's extra time
    for key in (
        "full_shard_compiled_step_time_vs_full_shard_paired",
        "full_shard_compiled_step_time_vs_fsdp2_compiled_paired",
        "full_shard_step_time_vs_compute_only_paired",
        "full_shard_compiled_step_time_vs_compute_only_compiled_paired",
    ):
        assert m[key] > 0, key
    assert all(isinstance(m[g], bool) for g in COMPILE_GOALS), m
    # The compute-only limit issues no collective and moves no byte.
    assert m["compute_only_comm_bytes"] == 0 and m["compute_only_exposed_ms"] == 0
    assert m["compute_only_comm_ops"] == []
    # Compiled or not, ours and FSDP2 compute the same gradients: the losses agree.
    assert m["max_loss_rel_diff_vs_fsdp2"] < 1e-4
    # The compiled blocks leave the engine's collectives outside: the same bytes move.
    assert m["full_shard_compiled_comm_bytes"] == m["full_shard_comm_bytes"]
    assert m["full_shard_compiled_comm_bytes"] == m["fsdp2_compiled_comm_bytes"]


def test_engine_benchmark_compile_quick_run_pairs_compiled_eager_and_the_compute_only_limit():
    """--compile's plumbing with the aot_eager backend (dynamo and AOT autograd, seconds)."""
    check_compile_headline(run_compile_quick("aot_eager"))


@pytest.mark.slow
def test_engine_benchmark_compile_quick_run_with_inductor():
    """The same with inductor, as `python -m benchmarks.engine --compile` runs (minutes cold)."""
    check_compile_headline(run_compile_quick("inductor"))
