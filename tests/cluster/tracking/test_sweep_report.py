"""cluster/report.py on a sqlite store filled with known metrics (no Ray): the numbers in the
table, the verdict (a fastest only when the numbers can tell it), the parent's description, the
files, the images, and which runs a target names. The report on a real sweep is in
tests/cluster/test_sweep.py."""

from __future__ import annotations

import csv
import math

import matplotlib.image
import pytest
from mlflow.tracking import MlflowClient

from cluster.config import JobConfig
from cluster.report import REPORT_ARTIFACTS, REPORT_FILES, format_table, main, write_report
from cluster.tracking.compare import RunSummary, find_runs, summarize, verdict
from cluster.tracking.plots import PLOT_SIZE_PX
from cluster.tracking.runs import NOTE_TAG, create_run, create_sweep_run, end_run
from cluster.tracking.summary import WARMUP_STEPS
from trainer.metrics import MLflowLogger

MiB = 2**20
EXPERIMENT = "report-test"
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
STEPS = 8  # 3 warm-up steps, 5 measured: too short to rank (fewer than 10)


def log_job(store: str, parent: str, num: int, strategy: str) -> str:
    """A finished child run whose metrics are known: job `num` is (num + 1) times job 0."""
    cfg = JobConfig()
    cfg.sharding.strategy, cfg.tracking.experiment = strategy, EXPERIMENT
    run_id = create_run(
        cfg,
        store,
        parent_run_id=parent,
        run_name=f"sharding={strategy.lower()}",
        tags={"sweep.job": num},
    )
    logger = MLflowLogger(store, run_id)
    k = num + 1
    for step in range(STEPS):
        warm = step < WARMUP_STEPS  # slow: the report must leave them out
        logger.log_metrics(
            {
                "train/loss": 5.0 - 0.5 * step - 0.1 * num,
                "perf/tokens_per_s": 1.0 if warm else 100.0 * k * step,
                "perf/step_ms": 10_000.0 if warm else 10.0 * k * step,
                "mem/peak_total_bytes": k * MiB * (step + 1) / STEPS,
                "comm/total_bytes": 2.0 * k * MiB,
            },
            step=step,
        )
    end_run(store, run_id, ok=True)
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('report')}/mlflow.db"


@pytest.fixture(scope="module")
def sweeps(store):
    """An older sweep of one job, then the sweep of three strategies; returns the newer parent."""
    older = create_sweep_run(store, EXPERIMENT, "sweep old", {}, {"sweep.jobs": 1})
    log_job(store, older, 0, "FULL_SHARD")
    end_run(store, older, ok=True)
    parent = create_sweep_run(
        store, EXPERIMENT, "sweep sharding=...", {"model.name": "tiny"}, {"sweep.jobs": 3}
    )
    children = [log_job(store, parent, num, s) for num, s in enumerate(STRATEGIES)]
    return parent, children


def test_a_row_holds_medians_and_spreads_after_the_warmup_the_peak_and_the_last_loss(store, sweeps):
    parent, children = sweeps
    client = MlflowClient(store)
    found_parent, runs = find_runs(client, parent)
    assert found_parent.info.run_id == parent and [r.info.run_id for r in runs] == children
    for num, run in enumerate(runs):
        row = summarize(client, run)
        k = num + 1
        assert (row.name, row.strategy, row.world_size) == (
            f"sharding={STRATEGIES[num].lower()}",
            STRATEGIES[num],
            "2",
        )
        # steps 3..7 measured: 300k..700k tokens/s, the warm-up left out
        assert row.tokens_per_s == pytest.approx(500.0 * k)
        assert (row.tokens_per_s_p10, row.tokens_per_s_p90) == pytest.approx((340.0 * k, 660.0 * k))
        assert row.step_ms == pytest.approx(50.0 * k)
        assert (row.step_ms_p10, row.step_ms_p90) == pytest.approx((34.0 * k, 66.0 * k))
        assert row.steps_measured == STEPS - WARMUP_STEPS
        assert row.too_short and row.too_short_reason.startswith("5 steps measured after 3 warm-up")
        assert row.peak_memory_bytes == pytest.approx(k * MiB)
        assert row.bytes_per_step == pytest.approx(2.0 * k * MiB)
        assert row.final_loss == pytest.approx(5.0 - 0.5 * (STEPS - 1) - 0.1 * num)
        assert [s for s, _ in row.loss_curve] == list(range(STEPS))
        assert math.isnan(row.device_peak_bytes)  # CPU runs log no device memory


def test_report_prints_the_table_writes_the_files_and_logs_them_to_the_parent(
    store, sweeps, tmp_path, capsys
):
    parent, _ = sweeps
    report = write_report(store, parent, str(tmp_path / "out"))
    printed = capsys.readouterr().out
    assert report.table in printed
    lines = report.table.splitlines()
    assert lines[0].split()[:4] == ["run", "strategy", "world", "tokens/s"]
    assert [line.split() for line in lines[2:]] == [
        [
            "sharding=full_shard",
            "FULL_SHARD",
            "2",
            "500",
            "(340-660)",
            "50.0",
            "(34.0-66.0)",
            "5*",
            "1.00",
            "2.00",
            "1.5000",
            "FINISHED",
        ],
        [
            "sharding=shard_grad_op",
            "SHARD_GRAD_OP",
            "2",
            "1,000",
            "(680-1,320)",
            "100.0",
            "(68.0-132.0)",
            "5*",
            "2.00",
            "4.00",
            "1.4000",
            "FINISHED",
        ],
        [
            "sharding=no_shard",
            "NO_SHARD",
            "2",
            "1,500",
            "(1,020-1,980)",
            "150.0",
            "(102.0-198.0)",
            "5*",
            "3.00",
            "6.00",
            "1.3000",
            "FINISHED",
        ],
    ]
    assert "no ranking: 3 runs are too short or too noisy to rank strategies" in printed
    assert "fastest:" not in printed
    assert "least memory: sharding=full_shard, 1.00 MiB peak per rank" in printed
    assert sorted(p.rsplit("/", 1)[1] for p in report.files) == sorted(REPORT_FILES)
    with open(tmp_path / "out" / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["tokens_per_s"]) for r in rows] == [500.0, 1000.0, 1500.0]
    assert [float(r["tokens_per_s_p10"]) for r in rows] == [340.0, 680.0, 1020.0]
    client = MlflowClient(store)
    logged = {a.path for a in client.list_artifacts(parent)}
    logged |= {a.path for a in client.list_artifacts(parent, "report")}
    assert set(REPORT_ARTIFACTS) <= logged  # the plots at the root, the table under report/


def test_the_csv_flags_are_booleans_with_the_reason_beside_them(store, sweeps, tmp_path):
    parent, _ = sweeps
    write_report(store, parent, str(tmp_path))
    with open(tmp_path / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["too_short"] for r in rows] == ["True", "True", "True"]
    assert all(r["too_short_reason"].startswith("5 steps measured") for r in rows)


def test_plots_are_real_images_of_the_documented_size(store, sweeps, tmp_path):
    parent, _ = sweeps
    write_report(store, parent, str(tmp_path))
    for name in REPORT_FILES:
        if not name.endswith(".png"):
            continue
        image = matplotlib.image.imread(tmp_path / name)
        assert image.shape == (PLOT_SIZE_PX[1], PLOT_SIZE_PX[0], 4), name
        rgb = image[..., :3].reshape(-1, 3)
        colours = {tuple(c) for c in (rgb * 255).round().astype(int)[::7]}
        assert len(colours) > 20, f"{name} looks blank ({len(colours)} colours)"


def test_an_experiment_name_means_its_newest_sweep(store, sweeps):
    parent, children = sweeps
    found_parent, runs = find_runs(MlflowClient(store), EXPERIMENT)
    assert found_parent.info.run_id == parent
    assert [r.info.run_id for r in runs] == children


def test_an_experiment_without_sweeps_is_reported_run_by_run(store, tmp_path):
    cfg = JobConfig()
    cfg.tracking.experiment = "plain-runs"
    ids = [create_run(cfg, store) for _ in range(2)]
    report = write_report(store, "plain-runs", str(tmp_path))
    assert report.parent_run_id is None and [r.run_id for r in report.rows] == ids


def test_a_run_without_children_is_refused(store, sweeps):
    _, children = sweeps
    with pytest.raises(ValueError, match="has no child runs"):
        find_runs(MlflowClient(store), children[0])


def test_an_unknown_target_is_an_error_naming_the_experiments_there(store, sweeps, capsys):
    assert main(["no-such-thing", "--tracking-uri", store]) == 2
    err = capsys.readouterr().err
    assert "no run id or experiment named 'no-such-thing'" in err and EXPERIMENT in err


def test_a_missing_store_is_an_error_and_is_not_created(tmp_path, capsys):
    missing = tmp_path / "nothing.db"
    assert main(["x", "--tracking-uri", f"sqlite:///{missing}"]) == 2
    assert f"no MLflow store at {missing}" in capsys.readouterr().err
    assert not missing.exists()


def test_the_table_shows_device_memory_only_when_measured_and_a_dash_when_missing():
    cpu = RunSummary(
        "a", "cpu-run", "FINISHED", "FULL_SHARD", "2", 1000.0, 5.0, MiB, math.nan, math.nan, 3.0
    )
    gpu = RunSummary(
        "b", "gpu-run", "FAILED", "NO_SHARD", "8", 2000.0, 4.0, MiB, 10 * MiB, MiB, 2.5
    )
    assert "device peak MiB" not in format_table([cpu])
    table = format_table([cpu, gpu]).splitlines()
    assert "device peak MiB" in table[0]
    assert table[2].split() == [
        "cpu-run",
        "FULL_SHARD",
        "2",
        "1,000",
        "5.0",
        "0",
        "1.00",
        "-",
        "-",
        "3.0000",
        "FINISHED",
    ]
    assert table[3].split()[7] == "10.0"


def test_too_short_runs_name_no_winner_and_set_no_winner_tag(store, sweeps, tmp_path):
    parent, _ = sweeps
    write_report(store, parent, str(tmp_path))
    run = MlflowClient(store).get_run(parent)
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("sweep/")}
    assert "sweep/winner" not in tags and "sweep/winner_tokens_per_s_median" not in run.data.metrics
    assert tags["sweep/verdict"].startswith("no ranking: 3 runs are too short")
    assert (tags["sweep/too_short"], tags["sweep/least_memory"]) == ("true", "sharding=full_shard")


def test_the_parents_description_is_the_markdown_table_with_the_verdict(store, sweeps, tmp_path):
    parent, _ = sweeps
    write_report(store, parent, str(tmp_path))
    note = MlflowClient(store).get_run(parent).data.tags[NOTE_TAG]
    lines = note.splitlines()
    assert lines[0] == (  # one short line: the Overview shows it before its "Show more"
        "**no ranking (3 of 3 runs too short or noisy) · "
        "least memory: sharding=full_shard (1.00 MiB/rank)**"
    )
    assert "- no ranking: 3 runs are too short or too noisy to rank strategies" in note
    header = lines.index(next(line for line in lines if line.startswith("| run |")))
    assert lines[header + 1].startswith("|:--|:--|--:|")
    rows = [line.split(" | ") for line in lines[header + 2 : header + 5]]
    assert [r[0] for r in rows] == [f"| sharding={s.lower()}" for s in STRATEGIES]
    assert [r[3] for r in rows] == ["500 (340-660)", "1,000 (680-1,320)", "1,500 (1,020-1,980)"]
    assert [r[5] for r in rows] == ["**1.00**", "2.00", "3.00"]  # the least memory in bold
    assert all(r[-1] == "FINISHED, too short or noisy |" for r in rows)


# ---- the verdict on long, steady runs ----------------------------------------------------------

LONG = 17  # 3 warm-up, 14 measured (7 low, 7 high): long enough to rank


def log_steady(store: str, parent: str, num: int, name: str, rate: float, wobble: float) -> str:
    """A finished child whose measured steps run at rate * (1 +- wobble), alternately."""
    cfg = JobConfig()
    cfg.tracking.experiment = EXPERIMENT
    run_id = create_run(
        cfg, store, parent_run_id=parent, run_name=name,
        tags={"sweep.job": num, "sweep.config": name.split(" #")[0]},
    )  # fmt: skip
    logger = MLflowLogger(store, run_id)
    for step in range(LONG):
        tokens = rate * (1 + (wobble if step % 2 else -wobble))
        logger.log_metrics(
            {
                "train/loss": 3.0,
                "perf/tokens_per_s": tokens,
                "perf/step_ms": 1e6 / tokens,
                "mem/peak_total_bytes": (num + 1) * MiB,
            },
            step=step,
        )
    end_run(store, run_id, ok=True)
    return run_id


def steady_sweep(store: str, runs: list[tuple[str, float, float]]) -> tuple[str, list[str]]:
    parent = create_sweep_run(store, EXPERIMENT, "sweep steady", {}, {"sweep.jobs": len(runs)})
    ids = [log_steady(store, parent, i, *r) for i, r in enumerate(runs)]
    return parent, ids


def test_a_clear_win_names_the_winner_and_tags_it(store, tmp_path, capsys):
    parent, ids = steady_sweep(store, [("sharding=a", 1000.0, 0.02), ("sharding=b", 1500.0, 0.02)])
    report = write_report(store, parent, str(tmp_path))
    assert report.verdict.fastest.config == "sharding=b"
    assert "fastest: sharding=b 1,500 tokens/s (p10-p90 1,470-1,530)" in capsys.readouterr().out
    run = MlflowClient(store).get_run(parent)
    assert run.data.tags["sweep/winner"] == "sharding=b"
    assert run.data.tags["sweep/winner_run_id"] == ids[1]
    assert run.data.metrics["sweep/winner_tokens_per_s_median"] == pytest.approx(1500.0)
    assert run.data.tags[NOTE_TAG].startswith("**fastest: sharding=b (1,500 tokens/s) · least")
    assert "| **1,500 (1,470-1,530)** |" in run.data.tags[NOTE_TAG]


def test_overlapping_ranges_are_no_ranking_and_remove_an_earlier_winner(store, tmp_path):
    parent, _ = steady_sweep(store, [("sharding=a", 1000.0, 0.08), ("sharding=b", 1050.0, 0.08)])
    client = MlflowClient(store)
    client.set_tag(parent, "sweep/winner", "sharding=b")  # as an earlier report might have left
    report = write_report(store, parent, str(tmp_path))
    assert report.verdict.fastest is None
    assert report.verdict.no_ranking.startswith("the throughput of sharding=b 1,050 tokens/s")
    assert "within the noise" in report.verdict.no_ranking
    tags = client.get_run(parent).data.tags
    assert "sweep/winner" not in tags and tags["sweep/verdict"].startswith("no ranking: ")


def test_repeats_rank_by_the_spread_of_their_medians():
    """Per-step ranges that overlap (10% wobble) do not hide a difference every repeat shows;
    repeats whose medians cross are no ranking."""

    def run(config: str, median: float) -> RunSummary:
        return RunSummary(
            f"{config}-{median}", config, "FINISHED", "FULL_SHARD", "2", median, 1.0, MiB,
            math.nan, MiB, 1.0, tokens_per_s_p10=median * 0.8, tokens_per_s_p90=median * 1.2,
            steps_measured=20, config=config,
        )  # fmt: skip

    apart = [run("a", 1000.0), run("b", 1100.0), run("a", 1010.0), run("b", 1090.0)]
    decided = verdict(apart)
    assert decided.fastest.config == "b" and decided.fastest.noise == (1090.0, 1100.0)
    crossing = [run("a", 1000.0), run("b", 1100.0), run("a", 1150.0), run("b", 1090.0)]
    assert verdict(crossing).fastest is None
    assert "range of 2 repeats' medians" in verdict(crossing).no_ranking


def row(name: str, status: str, median: float, p10: float, p90: float) -> RunSummary:
    return RunSummary(
        name,
        name,
        status,
        "FULL_SHARD",
        "2",
        median,
        1.0,
        MiB,
        math.nan,
        MiB,
        1.0,
        tokens_per_s_p10=p10,
        tokens_per_s_p90=p90,
        steps_measured=20,
    )


def test_the_fastest_is_the_highest_finished_median_and_noise_is_an_overlap():
    a, b = row("a", "FINISHED", 100.0, 95.0, 105.0), row("b", "FINISHED", 120.0, 110.0, 130.0)
    failed = row("c", "FAILED", 500.0, 490.0, 510.0)  # a failed run is never the winner
    assert verdict([a, b, failed]).winner is b
    close = row("d", "FINISHED", 108.0, 104.0, 112.0)  # its p90 reaches b's p10
    assert verdict([a, b, close]).fastest is None
    assert verdict([failed]).winner is None
    assert verdict([a, failed]).no_ranking.startswith("only a finished")
    short = row("e", "FINISHED", 50.0, 49.0, 51.0)
    short.too_short_reason = "2 steps measured"
    assert verdict([a, b, short]).fastest is None  # any too-short run: no ranking
