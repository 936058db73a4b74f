"""`python -m benchmarks.engine` runs end to end in its quickest mode and ends with its JSON line.

Not a timing test: one timed step of each contestant on a 1 x 16 token batch, only to prove that the
benchmark still builds every contestant, trains them on identical gradients and reports its figures.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "--world",
    "2",
    "--steps",
    "1",
    "--reps",
    "1",
    "--warmup",
    "0",
    "--batch",
    "1",
    "--seq",
    "16",
]


def test_engine_benchmark_quick_run_ends_with_headline_json():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", *QUICK],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("ours FULL_SHARD") for line in lines), (
        proc.stdout
    )  # the table came first
    head = json.loads(lines[-1])
    for name in ("full_shard", "shard_grad_op", "no_shard", "fsdp2", "ddp"):
        assert head[f"{name}_ms"] > 0
        assert head[f"{name}_tokens_per_s"] > 0
        assert head[f"{name}_peak_bytes"] > 0
        assert head[f"{name}_comm_bytes"] > 0
    for key in (
        "full_shard_step_time_vs_fsdp2",
        "full_shard_step_time_vs_ddp",
        "no_shard_step_time_vs_ddp",
    ):
        assert head[key] > 0
    assert isinstance(head["goal_full_shard_le_fsdp2"], bool)
    assert head["world"] == 2 and head["tokens_per_step"] == 2 * 1 * 16
    # Same gradients for everyone (fp32): after one update the losses still agree.
    assert head["max_loss_rel_diff_vs_fsdp2"] < 1e-4
    # Ours FULL_SHARD and FSDP2 move the same bytes here: both pad to the world size, and every
    # tiny-model parameter's dim 0 is even, so per-parameter and per-flat padding coincide.
    assert head["full_shard_comm_bytes"] == head["fsdp2_comm_bytes"]
    # Persistent fp32 AdamW state: 16 bytes per parameter over 2 ranks (tiny pads nothing).
    assert head["full_shard_acct_persistent_bytes"] == 16 * 3_541_248 // 2
