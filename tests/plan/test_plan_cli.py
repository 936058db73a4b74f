"""`python -m cluster.plan` gives one answer, states what it assumes, prints the table of the
memory levers only when asked (one row per combination, none twice) and says in an `error:` line
when nothing fits (issue 35, item 9).

Nothing is allocated and no Ray is started: the plans are the engine's layout on the meta device;
the Ray cluster's nodes are given as Ray reports them.
"""

from __future__ import annotations

import dataclasses
import io
from contextlib import redirect_stderr, redirect_stdout

import pytest

from cluster.config import ClusterConfig, JobConfig
from cluster.plan import batch_note, compose_job, main, settings
from cluster.plan_assumptions import node_shape
from trainer.config import TrainConfig, model_config
from trainer.plan import CHOICE_RULE, choose, closest, options, strategies
from trainer.plan.choose import TIE_FRACTION, best_per_levers

GiB = 2**30
EIGHT_B_ON_8 = ["model=8b", "cluster.num_workers=8"]
NOTHING_FITS = ["model=70b", "cluster.num_workers=1", "device_memory_gb=24"]


def run(capsys, args: list[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def answers(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("recommended: ")]


def table_rows(out: str) -> list[str]:
    """The lines of the lever table between its column header and the blank line after it."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("levers "))
    end = lines.index("", start)
    return lines[start + 1 : end]


@pytest.fixture(scope="module")
def eight_b_with_table():
    """(exit status, stdout, stderr) of the 8b plan with --table, run once for the module."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(EIGHT_B_ON_8 + ["--table"])
    return code, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------- one answer


def test_the_plan_gives_one_answer_with_its_overrides_memory_step_time_and_rule(capsys):
    code, out, err = run(capsys, EIGHT_B_ON_8)
    assert code == 0 and not err
    (line,) = answers(out)  # one answer, not "recommended" and "cheapest that fits"
    assert "cheapest that fits" not in out and "also fits" not in out
    assert line.startswith("recommended: sharding.strategy=")
    assert "sharding.activation_checkpointing=" in line and "train.micro_batches=" in line
    assert "GiB peak of" in line and "GiB usable" in line  # why: its peak against usable memory
    assert " a step;" in line  # and its predicted step time
    assert CHOICE_RULE in line  # by the rule, said where it is applied


def test_the_answer_is_the_fastest_predicted_step_that_fits_whatever_model_predicts_it():
    cfg = compose_job(EIGHT_B_ON_8)
    opts = options(cfg, 8, 80 * GiB, strategies=strategies(cfg, 8, 8))
    best = choose(opts)
    # issue 39: the step-time model's fastest is bf16 state (a smaller optimizer step) within
    # the tie, so the answer keeps fp32 state; 1 x 128 tokens a worker: the network decides
    fastest = min(o.step_s for o in opts if o.fits)
    assert fastest <= best.step_s <= fastest * (1 + TIE_FRACTION)
    assert best.plan.strategy == "SHARD_GRAD_OP" and best.levers == ()  # 2x params sent, not 3x
    # another step-time model hands its own times (here each candidate half the one before):
    # the same rule picks its fastest that fits
    times = [2.0**-k for k in range(len(opts))]
    assert choose(opts, times) is [o for o in opts if o.fits][-1]
    # ties go to the mildest memory levers: with every time equal, no lever is used
    assert choose(opts, [1.0] * len(opts)).levers == ()
    with pytest.raises(ValueError):
        choose(opts, [1.0])


def test_steps_within_the_tie_fraction_tie_and_the_milder_levers_win():
    """8b with fp32 parameters, 8 x 4096 tokens a worker: bf16 moments and master make the
    optimizer step a little faster (issue 39's step-time model: ~0.1%), within the model's
    error, so the answer keeps fp32 state (and the larger margin)."""
    cfg = compose_job(EIGHT_B_ON_8 + ["train.global_batch_size=64", "data.seq_len=4096"])
    opts = options(cfg, 8, 80 * GiB, strategies=strategies(cfg, 8, 8))
    fastest, best = opts[0], choose(opts)
    assert fastest.levers and best.levers == ()
    assert fastest.step_s < best.step_s <= fastest.step_s * (1 + TIE_FRACTION)


# ----------------------------------------------------------------------------- assumptions


def test_the_assumptions_come_before_the_answer_with_their_sources(capsys):
    code, out, _ = run(capsys, EIGHT_B_ON_8)
    block = out[out.index("Assumed:") : out.index("recommended: ")]
    assert "device memory  80.00 GiB a worker (the default; device_memory_gb sets it)" in block
    assert "host memory    1024.00 GiB a node (the default" in block  # stated, not silent
    assert "host_memory_gb sets it" in block
    # the hardware the step times are priced on (issue 39: trainer/plan/hardware.py)
    assert "8 x h100 a node at 396 TFLOP/s (989 peak x 40%)" in block and "PCIe 25 GB/s" in block
    assert "nvlink-4 360 GB/s inside a node, ib-ndr-400 45 GB/s a GPU between nodes" in block


def test_the_tiny_default_micro_batch_is_named_for_an_8b_model_with_the_keys_to_set(capsys):
    _, out, _ = run(capsys, EIGHT_B_ON_8)
    block = out[out.index("Assumed:") : out.index("recommended: ")]
    assert "micro-batch    1 x 128 tokens a worker" in block
    assert "sized for the tiny model, not for 8b" in block
    for key in ("train.global_batch_size", "data.seq_len", "train.micro_batches"):
        assert key in block.split("sized for the tiny model")[1], key


def test_no_micro_batch_note_when_the_batch_is_set_or_the_model_is_tiny():
    cfg = compose_job(EIGHT_B_ON_8)
    assert batch_note(cfg, EIGHT_B_ON_8) is not None
    assert batch_note(cfg, EIGHT_B_ON_8 + ["train.global_batch_size=64"]) is None
    assert batch_note(cfg, EIGHT_B_ON_8 + ["data.seq_len=4096"]) is None
    assert batch_note(compose_job(["model=tiny"]), ["model=tiny"]) is None


def test_memory_comes_from_the_keys_then_the_job_then_the_defaults():
    cfg = compose_job(EIGHT_B_ON_8)
    s = settings({}, cfg)
    assert (s["device"].value, s["host"].value, s["local"].value) == (80.0, 1024.0, 8)
    assert "the default" in s["host"].source
    job = dataclasses.replace(
        cfg, cluster=ClusterConfig(num_workers=8, device_memory_gb=40, host_memory_gb=512)
    )
    s = settings({}, job)
    assert s["device"] == s["device"].__class__(40, "cluster.device_memory_gb")
    assert (s["host"].value, s["host"].source) == (512, "cluster.host_memory_gb")
    s = settings({"host_memory_gb": 256.0, "local_world_size": 4}, job)
    assert (s["host"].value, s["local"].value) == (256.0, 4)


def test_cluster_ray_without_a_reachable_ray_states_the_default_and_why(capsys):
    code, out, _ = run(capsys, EIGHT_B_ON_8 + ["cluster=ray", "cluster.address=127.0.0.1:1"])
    assert code == 0
    (host,) = [line for line in out.splitlines() if line.startswith("  host memory    ")]
    assert "1024.00 GiB a node (the default: " in host and "127.0.0.1:1" in host


def test_a_ray_cluster_s_tightest_gpu_node_gives_host_memory_and_workers_per_node():
    gpu = {"CPU": 96.0, "GPU": 8.0, "memory": 700 * GiB, "object_store_memory": 300 * GiB}
    small = {**gpu, "memory": 350 * GiB, "object_store_memory": 150 * GiB}
    head = {"CPU": 8.0, "memory": 10 * GiB, "object_store_memory": 5 * GiB}  # no GPU: no worker
    host, gpus, what = node_shape([head, gpu, small])
    assert (host, gpus) == (500.0, 8) and "tightest of 2 GPU nodes" in what
    assert node_shape([gpu])[:2] == (1000.0, 8)
    assert node_shape([head]) is None


# ----------------------------------------------------------------------------- the table


def test_the_table_is_printed_only_on_request(capsys, eight_b_with_table):
    _, out, _ = run(capsys, EIGHT_B_ON_8)
    assert "Memory levers on 8 workers" not in out
    assert "Memory levers on 8 workers" in eight_b_with_table[1]
    args = ["model=tiny", "cluster.num_workers=2"]
    assert "Memory levers on" in run(capsys, args + ["table=true"])[1]
    assert "Memory levers on" not in run(capsys, args + ["table=false"])[1]
    code, _, err = run(capsys, args + ["table=maybe"])
    assert code == 2 and "table='maybe'" in err and "--table" in err
    assert "--table" in run(capsys, ["--help"])[1]


def test_the_table_has_one_row_per_lever_combination_and_no_duplicates(eight_b_with_table):
    code, out, _ = eight_b_with_table
    rows = table_rows(out)
    # moments fp32/bf16 x master fp32/bf16 x offload none/optimizer/params: once each; snapshots
    # off is no row of its own (it doubled every row: same device, PCIe and step time)
    assert len(rows) == 2 * 2 * 3
    labels = [row[:60].strip() for row in rows]
    assert len(set(labels)) == len(labels) and not any("no snapshots" in x for x in labels)
    figures = [row[60:] for row in rows]
    assert len(set(figures)) == len(figures)
    (answer,) = answers(out)
    assert rows[0].split()[:2] == ["none", answer.split("sharding.strategy=")[1].split()[0]]


@pytest.mark.parametrize("world", [1, 8])
def test_no_two_candidates_are_the_same_job(world):
    """On one worker every strategy is the same job (nothing sharded, nothing sent): only the
    configured one is tried, so no configuration is counted, or shown, twice."""
    cfg = compose_job(["model=tiny", f"cluster.num_workers={world}"])
    opts = options(cfg, world, 80 * GiB, strategies=strategies(cfg, world, 8))
    assert len({o.overrides for o in opts}) == len(opts)
    assert len(strategies(cfg, 1, 8)) == 1
    rows = best_per_levers(opts)
    assert len({o.plan.levers for o in rows}) == len(rows) == 2 * 2 * 3


def test_snapshots_are_turned_off_in_a_row_only_where_the_host_needs_it():
    cfg = JobConfig(model=model_config("8b"), train=TrainConfig(global_batch_size=8))
    roomy = best_per_levers(options(cfg, 8, 80 * GiB, host_memory_bytes=1024 * GiB))
    assert not any(o.snapshots_off for o in roomy)
    tight = best_per_levers(options(cfg, 8, 80 * GiB, host_memory_bytes=64 * GiB))
    assert all(o.snapshots_off for o in tight if o.fits)


# ----------------------------------------------------------------------------- exit status


def test_nothing_fits_exits_1_with_an_error_line_naming_the_closest(capsys):
    code, out, err = run(capsys, NOTHING_FITS)
    assert code == 1
    assert not answers(out) and "DOES NOT FIT" in out
    (line,) = err.splitlines()
    assert line.startswith("error: nothing fits on 1 worker of 24.00 GiB")
    assert "the closest, sharding.strategy=" in line and "needs " in line
    assert "valid: more workers (cluster.num_workers)" in line


def test_closest_is_the_candidate_nearest_to_fitting():
    cfg = compose_job(NOTHING_FITS[:2])
    opts = options(cfg, 1, 24 * GiB)
    assert choose(opts) is None
    near = closest(opts)
    assert near is opts[0] and near.shortfall == min(o.shortfall for o in opts) > 0


def test_a_job_that_does_not_fit_as_configured_exits_0_with_the_answer_that_does(capsys):
    code, out, err = run(capsys, ["model=8b", "cluster.num_workers=8", "device_memory_gb=24"])
    assert "DOES NOT FIT" in out  # the configured job's breakdown
    (line,) = answers(out)
    assert code == 0 and not err
    levers = ("optim.state_dtype=", "sharding.master_dtype=", "sharding.offload=")
    assert any(lever in line for lever in levers)  # a memory lever makes it fit


# ----------------------------------------------------------------------------- hardware, --gpus


def test_gpus_plans_a_cluster_of_that_size_on_the_gpu_kind_given(capsys):
    batch = "train.global_batch_size=64"  # every rank a sequence
    code, out, err = run(capsys, ["model=tiny", batch, "--gpus", "64", "gpu=h200"])
    assert code == 0 and not err
    assert "on 64 workers" in out
    assert "141.00 GiB a worker (gpu=h200)" in out  # the kind's memory, and said so
    assert "8 x h200 a node" in out
    assert "on 16 workers" in run(capsys, ["model=tiny", batch, "gpus=16"])[1]
    code, _, err = run(capsys, ["model=tiny", "gpu=tpu"])
    assert code == 2 and "gpu='tpu'" in err and "h100" in err  # the valid kinds named
    code, _, err = run(capsys, ["model=tiny", "network=pigeon"])
    assert code == 2 and "network='pigeon'" in err and "ib-ndr-400" in err
