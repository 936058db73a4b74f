"""`python -m benchmarks.data --quick --no-ray` runs end to end and ends with its JSON line.

Not a timing test (the goals live in the printed ratios): a 1 MiB corpus prepared twice in this
process and once through Ray Data's UDF without Ray, a few loader steps, and two memory workers,
only to prove that every part still runs and reports its figures.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

POSITIVE = (
    "prepare_input_mib",
    "prepare_tokens",
    "prepare_process_tokens_per_s",
    "loader_tokens_per_s",
    "raw_tokens_per_s",
    "loader_vs_raw",
    "first_batch_ms",
    "peak_rss_small_mib",
    "peak_rss_large_mib",
    "dataset_small_tokens",
    "dataset_large_tokens",
    "window_tokens",
    "packed_vs_padded_useful_tiny",
    "document_mask_vs_causal_tiny",
    "packed_useful_tokens_per_s_tiny",
    "padded_vs_packed_windows_128",
)
RAY_ONLY = ("prepare_ray_tokens_per_s", "prepare_ray_vs_process", "prepare_ray_init_s")


def test_data_benchmark_quick_run_without_ray_ends_with_headline_json(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.data", "--quick", "--no-ray", "--dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("1. preparation"), proc.stdout  # the tables come first
    for title in (
        "2. loader vs raw",
        "3. time to first batch",
        "4. worker memory",
        "5. fine-tuning windows",
    ):
        assert any(line.startswith(title) for line in lines), proc.stdout
    head = json.loads(lines[-1])
    for key in POSITIVE:
        assert head[key] > 0, (key, head[key])
    for key in RAY_ONLY:
        assert head[key] is None, (key, head[key])  # --no-ray: no Ray figure is made up
    # The UDF that Ray Data runs, fed JSON round-tripped units in reverse order, writes the same
    # bytes as the in-process preparation.
    assert head["prepare_shards_bitwise_equal"] is True
    assert head["prepare_compared_with"] == "udf_in_process"
    assert isinstance(head["goal_loader_ge_0_8_raw"], bool)
    # The part-4 datasets are sized as promised: a few windows, and at least 20 windows.
    assert head["dataset_small_tokens"] >= 4 * head["window_tokens"]
    assert head["dataset_large_tokens"] >= 20 * head["window_tokens"]
    assert os.listdir(tmp_path) == []  # everything it wrote is removed
