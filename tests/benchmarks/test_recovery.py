"""`python -m benchmarks.recovery` runs end to end in its quickest mode, ending with a JSON line.

Not a timing test: one repetition of each mode (a crash at step 40) on a 2-node local Ray, only
to prove the benchmark still drives the CLI through a crash and reads each mode's recovery and
whether rank 0 restarted in a spare. About 2.5 min here: slow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_recovery_benchmark_reports_both_modes():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.recovery", "--reps", "1", "--event-at", "40"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(result["median"]["crash"]) == {"spares", "new processes"}
    for mode in result["median"]["crash"].values():
        assert mode["recovery_s"] > 0
    assert any("new processes" in line and line.endswith("0/1 (0 warm)") for line in lines)
