"""`python -m benchmarks.loss --quick` runs end to end and ends with its JSON line.

Not a timing test: a 4k-vocabulary model of dim 32 on 2 x 64 tokens, one timed step per memory
contestant (each in its own process) and one paired crossover point, only to prove that the
benchmark builds both contestants, measures their memory both ways and reports the figures. The
chunked loss must save at least the whole fp32 logits even here (2 MiB of them: every tensor
above 64 KiB is its own mapping in the contestants' processes). About 15 s on 2 idle cores.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~16 s in CI; the chunked loss itself: tests/trainer/test_chunked_loss.py
def test_quick_loss_benchmark_reports_memory_time_and_the_crossover():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.loss", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    mem = out["memory"]
    assert mem["goal_saves_at_least_the_logits"], mem
    assert mem["plain_step_s"] > 0 and mem["chunked_step_s"] > 0 and mem["time_ratio"] > 0
    assert [r["vocab"] for r in out["crossover"]] == [4096]
    assert out["auto_min_vocab"] > 4096
    assert any(line.startswith("contestant") for line in lines)
