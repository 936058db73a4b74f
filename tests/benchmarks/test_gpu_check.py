"""`python -m benchmarks.gpu_check --device cpu --quick` runs the GPU check's code path end to end
(tiny model, gloo, ours and FSDP2 without and with activation checkpointing, compiled (by
aot_eager here), compiled with Float8 (torchao's emulation, when torchao is installed); the
parameter-offload row is CUDA's and is skipped) and ends with its JSON line. Not a timing test:
it proves the check builds, trains, plans and reports, so the one run on a GPU machine is not the
first.
"""

import importlib.util
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks import gpu_check, gpu_contestants, gpu_stages

ROOT = Path(__file__).resolve().parents[2]
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
RUNS = ("tiny_bf16", "tiny_bf16_ac")
RUNS += ("tiny_bf16_compile_float8",) if HAS_TORCHAO else ("tiny_bf16_compile",)


def quick(order: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick"]
        + ["--order", order],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # generous: other runs load the machine (4 rows took 9.6 min at load 20)
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("run ") for line in lines), "the table's header is missing"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def both_orders() -> dict:
    return {order: quick(order) for order in gpu_check.ORDERS}


def test_gpu_check_quick_run_on_cpu_ends_with_headline_json(both_orders):
    head = both_orders["ours,fsdp2"]
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
    assert set(head["compile_s"]) == {r for r in RUNS if "compile" in r}
    assert "tiny_bf16_offload_params" in head["skipped"]  # CUDA's row


def test_a_float8_row_without_torchao_is_skipped_naming_the_extra(monkeypatch):
    import importlib.util as util

    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    float8 = next(x for x in gpu_check.LEVERS if x.train.float8)
    why = gpu_check.unavailable(float8, torch.device("cpu"))
    assert why and "elastic-fsdp[float8]" in why
    assert gpu_check.unavailable(gpu_check.LEVERS[0], torch.device("cpu")) is None


def test_each_rows_peak_is_its_own_whoever_ran_first(both_orders):
    """A contestant's peak counts from what was allocated when it started: run FSDP2 first or
    ours first, each peak is the same (the leak made later rows carry earlier models)."""
    first, second = (both_orders[o]["peak_gib"] for o in gpu_check.ORDERS)
    for run in RUNS:
        for who in ("measured", "fsdp2"):
            a, b = first[run][who], second[run][who]
            assert a > 0 and abs(a - b) <= 0.01 * a, (run, who, a, b)
        # the watch saw the model itself (its fp32 state is most of the planned peak)
        assert first[run]["measured"] > 0.5 * first[run]["planned"], first[run]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_check_without_cuda_says_how_to_get_it():
    with pytest.raises(SystemExit) as exc:
        gpu_check.resolve_device("cuda")
    message = str(exc.value)
    assert "torch==2.13.0" in message and "download.pytorch.org/whl/cu128" in message
    assert "PY=python3" in message


def test_a_budget_too_small_for_any_stage_is_refused_naming_the_minimum(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", "x", "--budget-s", "5"])
    assert "--budget-s 5: valid is at least 20" in capsys.readouterr().err


def test_gpu_check_names_the_valid_models():
    with pytest.raises(SystemExit, match="valid are 125m, 1b"):
        gpu_check.setups(gpu_check.parse_args(["--models", "8b"]))


# ---- the staged run (benchmarks/gpu_stages.py) -------------------------------------------------
def fake_stages(hang_limit_s: float):
    """A quick stage, one that hangs (killed at its limit), and one after it."""
    quick_ok = ("timeit", "-n", "1", "-r", "1", "pass")
    hang = ("timeit", "-n", "1", "-r", "1", "import time; time.sleep(60)")
    return lambda models: [
        gpu_stages.Stage(1, "first", 30, quick_ok),
        gpu_stages.Stage(2, "hangs", hang_limit_s, hang),
        gpu_stages.Stage(3, "after", 30, quick_ok),
    ]


def test_a_hanging_stage_is_killed_at_its_limit_and_the_rest_still_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_stages, "stages", fake_stages(1.0))
    rc = gpu_stages.run_all(tmp_path, ("125m",), budget_s=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 1 and summary["status"] == "failed"
    by = {s["name"]: s for s in summary["stages"]}
    assert [by[n]["status"] for n in ("first", "hangs", "after")] == ["passed", "timeout", "passed"]
    assert by["hangs"]["seconds"] < 10 and "killed after 1 s" in by["hangs"]["detail"]
    assert (tmp_path / "02_hangs.log").read_text().startswith("$ ")  # its log stays


def test_a_stage_with_too_little_budget_left_is_skipped_not_started(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_stages, "stages", fake_stages(2.0))
    budget = gpu_stages.MIN_STAGE_S + 1.5  # the hang eats what the last stage would need
    gpu_stages.run_all(tmp_path, ("125m",), budget_s=budget)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["passed", "timeout", "skipped"]
    assert "skipped" in (tmp_path / "summary.txt").read_text()


def test_the_stages_are_the_ones_the_issue_lists_in_order_within_the_budget():
    """The lever rows (compile, Float8, parameter offload) run after the plain rows, in a stage
    of their own, then the mixture's stage and the long-sequence stage; 10 minutes in all leave
    the lent H200's 15 for its start and the transfers."""
    stages = gpu_stages.stages(("125m", "1b"))
    names = [s.name for s in stages]
    assert names == [
        "env",
        "leak",
        "tests",
        "threaded",
        "bench_125m",
        "bench_1b",
        "bench_1b_levers",
        "moe",
        "context",
    ]
    assert [s.number for s in stages] == list(range(1, 10))
    assert "--levers" in stages[-3].argv
    assert gpu_stages.BUDGET_S <= 10 * 60


def test_the_leak_stage_builds_steps_and_drops_every_contestant(monkeypatch):
    """The leak stage's code path on the CPU (its figures need CUDA's allocator): each
    contestant builds, steps and is dropped; and a contestant that is kept alive is caught."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        cpu = torch.device("cpu")
        built = gpu_stages.leak_contestants(gpu_contestants, cpu, "tiny", batch=1, seq_len=8)
        alive = []
        live_models = lambda: 20 * gpu_stages.LEAK_SLACK * len(alive)  # a stand-in allocator
        for label, build in built:

            def tracked(build=build):
                c, setup = build()
                alive.append(weakref.ref(c))
                return c, setup

            row = gpu_stages.probe(label, tracked, cpu, lambda: live_models())
            assert row["contestant"] == label and row["held_while_alive_mib"] > 0
            alive = [r for r in alive if r() is not None]
            assert alive == [], f"{label} outlived its last reference"
        kept = []
        row = gpu_stages.probe(
            "kept",
            lambda: kept.append(built[0][1]()) or kept[0],
            cpu,
            lambda: 20 * gpu_stages.LEAK_SLACK * len(kept),
        )
        assert row["freed"] is False
    finally:
        dist.destroy_process_group()
