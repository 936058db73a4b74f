"""`python -m benchmarks.snapshots` runs end to end in its quickest mode, ending with a JSON line.

Not a timing test: the tiny model, 2 ranks, one repetition of 3 timed steps per mode, only to
prove the benchmark still trains with snapshots going to two keepers on a 2-node local Ray
cluster, and reports the blocked time, the bytes and the keepers' memory. About 40 s here."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_snapshot_benchmark_reports_every_mode_and_what_the_keepers_hold():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.snapshots", "--models", "tiny", "--steps", "3",
         "--reps", "1", "--warmup", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    tiny = result["models"]["tiny"]
    assert set(tiny) >= {"off", "every", "auto", "shard_bytes_per_rank"}
    assert tiny["off"]["snapshots"] == 0
    assert tiny["every"]["snapshots"] == 4  # one after every step, warm-up included
    assert tiny["auto"]["snapshots"] >= 1
    shard = tiny["shard_bytes_per_rank"]
    assert shard > 3_541_248 * 4 * 3 / 2 * 0.9  # params + AdamW's two moments, fp32, half each
    # two copies of two ranks' shards: two generations for "every", at least one for "auto"
    assert result["keepers_bytes_held"] >= (2 + 1) * 2 * 2 * shard
    assert any(line.startswith("tiny   every") for line in lines)
