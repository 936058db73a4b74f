"""`python -m benchmarks.gpu_check --device cpu --quick` runs the GPU check's code path end to end
(tiny model, gloo, ours and FSDP2 without and with activation checkpointing) and ends with its
JSON line. Not a timing test: it proves the check builds, trains, plans and reports, so the one
run on a GPU machine is not the first.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("tiny_bf16", "tiny_bf16_ac")


def test_gpu_check_quick_run_on_cpu_ends_with_headline_json():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    head = json.loads(lines[-1])
    assert head["world_size"] == 1 and head["param_dtype"] == "bfloat16"
    assert set(head["tokens_per_s_ratio_vs_fsdp2"]) == set(RUNS)
    for run in RUNS:
        assert head[f"mfu_{run}"] is None  # no MFU on a CPU: peak_flops does not know it
        assert head["tokens_per_s"][run] > 0
        assert head["tokens_per_s_ratio_vs_fsdp2"][run] > 0
        assert head["peak_gib"][run]["planned"] > 0
        assert head["exposed_comm_ms"][run] == 0.0  # world size 1: no collective is issued
        # same weights, batch and bf16 compute: the first losses agree
        assert head["loss_rel_diff_vs_fsdp2"][run] <= gpu_check.LOSS_TOLERANCE
    assert any(line.startswith("run ") for line in lines), "the table's header is missing"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_check_without_cuda_says_how_to_get_it():
    with pytest.raises(SystemExit) as exc:
        gpu_check.resolve_device("cuda")
    message = str(exc.value)
    assert "torch==2.13.0" in message and "download.pytorch.org/whl/cu128" in message
    assert "PY=python3" in message


def test_gpu_check_names_the_valid_models():
    with pytest.raises(SystemExit, match="valid are 125m, 1b"):
        gpu_check.setups(gpu_check.parse_args(["--models", "8b"]))
