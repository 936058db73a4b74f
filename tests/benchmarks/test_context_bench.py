"""The context-parallel benchmarks run end to end at their smallest: benchmarks/context.py's
ranks (world 4, gloo: context 1, 2 and 4, checkpointing on, one timed step each) with its
figures and table, and the GPU check's context stage on the CPU (`python -m
benchmarks.gpu_context --device cpu --quick`). Not timing tests: they prove the benchmarks build,
train, measure and report, and that the split does what it is for: a rank of context 2 holds
fewer activation bytes at once than a rank of context 1 (one sequence per forward, half of it).
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks import context, gpu_stages
from benchmarks.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SMOKE = replace(context.QUICK, checkpointing=(True,), warmup=0, reps=1)


def test_context_benchmark_measures_less_activation_memory_per_rank_as_the_degree_grows():
    ranks = run_ranks(context.bench_rank, context.WORLD, SMOKE, timeout=300)
    head = context.figures(ranks, SMOKE)
    assert set(context.HEADLINE_KEYS) <= set(head)
    names = ["cp1_ac", "cp2_ac", "cp4_ac"]
    assert [n for n, _, _ in SMOKE.contestants()] == names
    act = head["activation_peak_bytes"]
    assert all(len(act[n]) == context.WORLD and min(act[n]) > 0 for n in names)
    # measured, not assumed: every rank of cp2 below every rank of cp1, cp4 below cp2
    assert max(act["cp2_ac"]) < min(act["cp1_ac"]) and max(act["cp4_ac"]) < min(act["cp2_ac"])
    assert 0 < head["activation_ratio"]["cp4_ac"] < head["activation_ratio"]["cp2_ac"] < 1
    assert set(head["activation_ratio"]) == {"cp2_ac", "cp4_ac"} == set(head["step_time_ratio"])
    # only a context axis exchanges K/V, and it is accounted (bytes and wait) under "context"
    assert head["context_bytes"]["cp1_ac"] == [0] * 4
    assert all(b > 0 for b in head["context_bytes"]["cp2_ac"] + head["context_bytes"]["cp4_ac"])
    assert head["exposed_ms"]["cp1_ac"]["context"] == 0 < head["exposed_ms"]["cp2_ac"]["context"]
    assert all(head["step_ms"][n] > 0 for n in names)
    assert max(head["loss_rel_diff"].values()) <= 1e-5  # the same batches, the same losses
    predicted = head["predicted_activation_bytes"]  # None until trainer/plan/ has the term
    assert predicted is None or all(predicted[n]["bytes"] > 0 for n in names)
    lines = context.table(head, SMOKE).splitlines()
    assert lines[0].startswith("contestant") and [x.split()[0] for x in lines[1:4]] == names
    assert any(x.startswith("checkpointing on : activation peak cp2/cp1 ") for x in lines)
    json.dumps(head)  # the last line of the run is this, as JSON


def test_the_gpu_context_stage_runs_on_the_cpu_and_writes_its_result_file(tmp_path):
    file = tmp_path / "09_context.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = ["-m", "benchmarks.gpu_context", "--device", "cpu", "--quick", "--file", str(file)]
    proc = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(file.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    assert result["failed"] == [] and result["train"]["finite"]
    assert result["train"]["tokens_per_s"] > 0 and result["train"]["mfu"] is None  # no CPU peak
    att = result["attention"]
    assert att["whole"]["ms"] > 0
    got = [(r["degree"], r["rank"]) for r in att["ranks"]]
    assert got == [(2, 0), (2, 1), (4, 0), (4, 3)]
    assert all(r["ms"] > 0 and r["kv_gather_mib"] > 0 for r in att["ranks"])


def test_the_context_stage_runs_after_every_other_within_its_limit():
    for models in (("125m", "1b"), ("125m",)):
        last = gpu_stages.stages(models)[-1]
        assert last.name == "context" and last.limit_s <= 90
        assert last.argv == ("benchmarks.gpu_context", "--file", "{file}")
