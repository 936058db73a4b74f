"""The mixture-of-experts benchmarks run end to end in their quickest modes: `python -m
benchmarks.moe --quick` (world 2, gloo: expert_parallel 1 and 2 and the dense model of the same
active parameters) and the GPU check's moe stage on the CPU (`python -m benchmarks.gpu_moe
--device cpu --quick`: the grouped matmul against the loop, a tiny mixture and its dense twin
trained at world 1). Not timing tests: they prove the benchmarks build, train, measure and
report, so the one run on a GPU machine is not the first. ~10 s each on 2 idle cores.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_stages, moe

ROOT = Path(__file__).resolve().parents[2]


def run_module(*args: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,  # generous: other runs load the machine
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()


def test_moe_benchmark_quick_run_prints_a_table_and_ends_with_its_headline_json():
    lines = run_module("benchmarks.moe", "--quick")
    assert lines[0].startswith("contestant") and any(x.startswith("moe_ep2") for x in lines)
    head = json.loads(lines[-1])
    assert set(moe.HEADLINE_KEYS) <= set(head)
    assert head["world"] == 2 and head["config"] == dict(vars(moe.QUICK), lr=0.0)
    for key in ("ep2_vs_ep1", "moe_vs_dense", "moe_ep2_vs_dense"):
        assert head[f"step_time_ratio_{key}"] > 0
    for name in moe.CONTESTANTS:
        assert head["step_ms"][name] > 0 and head["tokens_per_s"][name] > 0
        assert all(b > 0 for b in head["acct_peak_bytes"][name] + head["torch_peak_bytes"][name])
    # only the expert axis exchanges tokens; it gathers no expert, so it moves fewer bytes
    assert head["all_to_all_ms"]["moe_ep2"] > 0 and 0 < head["all_to_all_fraction"]["moe_ep2"] < 1
    assert head["all_to_all_ms"]["moe_ep1"] == 0 == head["all_to_all_ms"]["dense"]
    assert head["comm_bytes"]["moe_ep2"][0] < head["comm_bytes"]["moe_ep1"][0]
    # the same model and batches: the same losses; the dense twin has the active parameters
    assert head["loss_rel_diff_ep2_vs_ep1"] <= 1e-5
    params = head["params"]
    assert params["moe_ep1"]["total"] > params["moe_ep1"]["active"]
    assert abs(params["moe_ep1"]["active"] / params["dense"]["active"] - 1) < 0.02
    assert head["grouped_mm"]["max_rel_diff"] <= 1e-5  # fp32, either path


def test_the_gpu_moe_stage_runs_on_the_cpu_and_writes_its_result_file(tmp_path):
    file = tmp_path / "08_moe.json"
    lines = run_module("benchmarks.gpu_moe", "--device", "cpu", "--quick", "--file", str(file))
    result = json.loads(file.read_text())
    assert json.loads(lines[-1])["train"] == result["train"]
    assert result["failed"] == [] and result["device"] == "cpu"
    (shape,) = result["experts"]
    assert shape["grouped_ms"] > 0 and shape["loop_ms"] > 0 and shape["max_rel_diff"] <= 5e-2
    assert shape["path"] in ("torch._grouped_mm", "loop (grouped_mm_ok said no)")
    train = result["train"]
    for who in ("moe", "dense"):
        r = train[who]
        assert r["finite"] and r["tokens_per_s"] > 0 and r["mfu"] is None  # no CPU peak
        assert r["flops_per_token"] > 6 * (r["active_params"] - 256 * 64)  # 6 x active, at least
    assert train["moe"]["params"] > train["moe"]["active_params"]
    assert abs(train["moe"]["active_params"] / train["dense"]["params"] - 1) < 0.02
    assert train["moe_over_dense_step_time"] > 0


def test_the_moe_stage_runs_after_the_others_and_writes_its_file():
    """After every stage but the long-sequence one, so it takes no time from them (it gets what
    they leave)."""
    for models in (("125m", "1b"), ("125m",)):
        last = gpu_stages.stages(models)[-2]
        assert last.name == "moe" and last.limit_s <= 90
        assert last.argv == ("benchmarks.gpu_moe", "--file", "{file}")
