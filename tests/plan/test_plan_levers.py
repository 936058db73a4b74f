"""The planner's memory levers: each lever's bytes from the one table, equal to what the real
engine allocates for it (world sizes 1 and 2, gloo), the PCIe each offload moves, the ordering by
cost, the refusal that names the levers, and the answers for the sizes people fine-tune (Llama 3
70B on 8 x 80 GB, 8B on 4 x 24 GB, 8B on 8 x 80 GB).

The plans allocate nothing: the engine wrapped on the meta device (trainer/plan/layout.py) with
its element counts priced by trainer/plan/levers.py's BYTES.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.config import JobConfig
from cluster.plan import main as plan_main
from tests.dist_utils import run_distributed
from tests.fsdp.scaffold import MODEL
from trainer.config import (
    PRESETS,
    ConfigError,
    DataConfig,
    OptimConfig,
    ShardingConfig,
    TrainConfig,
    model_config,
)
from trainer.fsdp import build_mesh, parallelize
from trainer.model import build_model, count_params, initializer, loss_sum
from trainer.optim import build_optimizer
from trainer.plan import BYTES, cheapest, check_fits, layout, options, plan
from trainer.plan import levers as levers_module
from trainer.plan.choose import best_per_levers, default_hardware

GiB = 2**30
TiB = 2**40
BIG = 2**50
UNEVEN = model_config("tiny", **MODEL)  # pads at world size 3


def job(model=UNEVEN, global_batch=6, seq_len=16, state="float32", snapshot_every=None, **sh):
    return JobConfig(
        model=model,
        sharding=ShardingConfig(**sh),
        optim=OptimConfig(state_dtype=state),
        train=TrainConfig(global_batch_size=global_batch, snapshot_every=snapshot_every),
        data=DataConfig(seq_len=seq_len),
    )


def elements(world: int, rank: int = 0):
    """(P, G, V) of the engine's own layout: shard, gradient-shard and optimizer-view elements."""
    lay = layout(UNEVEN, ShardingConfig(), world, world, rank)
    return lay.shard_elements, lay.grad_elements, lay.optim_elements


# ----------------------------------------------------------------------------- bytes per lever


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_lever_prices_the_engines_elements_with_the_table(world):
    P, G, V = elements(world)
    base = plan(job(), world, BIG, world)
    assert (base.sharded_params, base.optim_state) == (4 * P, 8 * V)  # the fp32 engine's own

    bf16_state = plan(job(state="bfloat16"), world, BIG, world)
    assert bf16_state.optim_state == V * BYTES["moments"]["bfloat16"] == 4 * V
    assert bf16_state.sharded_params == base.sharded_params

    bf16_master = plan(job(master_dtype="bfloat16", param_dtype="bfloat16"), world, BIG, world)
    assert bf16_master.sharded_params == P * BYTES["master"]["bfloat16"] == 2 * P
    assert bf16_master.sharded_grads == 2 * G  # the gradient shard has the master's dtype

    both = plan(
        job(state="bfloat16", master_dtype="bfloat16", param_dtype="bfloat16"), world, BIG, world
    )
    assert both.persistent == 2 * P + 4 * V  # 6 bytes a parameter (ZeRO's 16 at fp32)

    opt = plan(job(offload="optimizer", param_dtype="bfloat16"), world, BIG, world)
    assert (opt.sharded_params, opt.sharded_grads, opt.optim_state) == (2 * P, 0, 0)
    assert opt.host_state == 4 * P + 4 * G + 8 * V
    assert opt.host_staging == 4 * G  # fp32 reduce: the pinned copies of the reduced shards

    params = plan(job(offload="params", param_dtype="bfloat16"), world, BIG, world)
    assert (params.sharded_params, params.sharded_grads, params.optim_state) == (0, 0, 0)
    assert params.host_state == opt.host_state
    assert params.persistent == 0  # nothing between gathers: the copies in are transient


def test_kahan_compensation_adds_its_bytes_and_stochastic_rounding_none():
    args = dict(offload="none", param_dtype="bfloat16", reduce_bytes=4)
    kahan = levers_module.state_bytes(
        100, 90, 80, master="bfloat16", moments="bfloat16", rounding="kahan", **args
    )
    stochastic = levers_module.state_bytes(
        100, 90, 80, master="bfloat16", moments="bfloat16", rounding="stochastic", **args
    )
    assert kahan.device_optim - stochastic.device_optim == 80 * BYTES["compensation"]["kahan"]
    fp32 = levers_module.state_bytes(
        100, 90, 80, master="float32", moments="float32", rounding="kahan", **args
    )
    assert fp32.device_optim == 8 * 80  # an fp32 master rounds nothing


def test_one_figure_of_the_table_changes_every_plan_that_uses_it(monkeypatch):
    P, _, V = elements(2)
    monkeypatch.setitem(BYTES["moments"], "bfloat16", 3)
    assert plan(job(state="bfloat16"), 2, BIG, 2).optim_state == 3 * V
    monkeypatch.setitem(BYTES["master"], "bfloat16", 1)
    p = plan(job(master_dtype="bfloat16", param_dtype="bfloat16"), 2, BIG, 2)
    assert p.sharded_params == P


LEVER_JOBS = [
    job(state="bfloat16"),
    job(master_dtype="bfloat16", param_dtype="bfloat16"),
    job(state="bfloat16", master_dtype="bfloat16", param_dtype="bfloat16"),
    job(offload="optimizer", param_dtype="bfloat16"),
    job(offload="params", param_dtype="bfloat16"),
    job(offload="params", state="bfloat16", master_dtype="bfloat16", param_dtype="bfloat16"),
]


def _engine_state(rank: int, world: int, jobs: list[JobConfig]) -> list[dict]:
    """Two steps of the real engine and optimizer per job; its accounting by kind."""
    out = []
    for cfg in jobs:
        mesh = build_mesh(cfg.sharding, rank, world, local_world_size=world)
        fsdp = parallelize(
            build_model(cfg.model, device="meta"), cfg.sharding, mesh, "cpu", init_fn=initializer(0)
        )
        opt = build_optimizer(fsdp, cfg.optim)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1))
        for _ in range(2):
            s, _ = loss_sum(fsdp(tokens[:, :-1]), tokens[:, 1:])
            s.backward()
            opt.step()
            fsdp.zero_grad()
        fsdp.metrics(opt)
        out.append(dict(live=dict(fsdp.acct.live), peak=dict(fsdp.acct.peak)))
    return out


@pytest.mark.parametrize(
    "world",
    # world 3 pads every unit (UNEVEN): slow only for its 3 fresh ranks when run alone (~25 s
    # here); in a whole-suite session the ranks are shared and it costs ~2 s
    [1, 2, pytest.param(3, marks=pytest.mark.slow)],
)
def test_each_levers_state_equals_what_the_engine_allocates(world):
    ranks = (
        [_engine_state(0, 1, LEVER_JOBS)]
        if world == 1
        else run_distributed(_engine_state, world, LEVER_JOBS)
    )
    for rank, results in enumerate(ranks):
        for cfg, r in zip(LEVER_JOBS, results):
            p = plan(cfg, world, BIG, world, rank)
            live, peak = r["live"], r["peak"]
            host = live.get("host_params", 0) + peak.get("host_grads", 0)
            host += live.get("host_optim_state", 0)
            tag = f"world={world} rank={rank} {p.levers}"
            assert p.sharded_params == live["sharded_params"], tag
            assert p.optim_state == live.get("optim_state", 0), tag
            assert p.sharded_grads == peak.get("sharded_grads", 0), tag
            assert p.host_state == host, tag


# ----------------------------------------------------------------------------- PCIe per step


def test_pcie_bytes_are_the_offloads_copies_per_step():
    world = 2
    lay = layout(UNEVEN, ShardingConfig(), world, world)
    P, G = lay.shard_elements, lay.grad_elements
    assert plan(job(), world, BIG, world).pcie_bytes == 0
    opt = plan(job(offload="optimizer", param_dtype="bfloat16"), world, BIG, world)
    assert opt.pcie == {"host_to_device": 2 * P, "device_to_host": 4 * G}
    params = plan(job(offload="params", param_dtype="bfloat16"), world, BIG, world)
    # FULL_SHARD gathers every unit in forward and all but the last again in backward; each
    # gather copies in the (fp32) master slice and casts it on the device
    uses = [*lay.all_units, *lay.units[:-1]]
    assert params.pcie == {
        "host_to_device": 4 * sum(sum(u.shard) for u in uses),
        "device_to_host": 4 * G,
    }
    two = dataclasses.replace(
        job(
            offload="params",
            param_dtype="bfloat16",
            reduce_dtype="bfloat16",
            master_dtype="bfloat16",
        ),
        train=TrainConfig(global_batch_size=6, micro_batches=2),
    )
    p2 = plan(two, world, BIG, world)
    # every micro-batch gathers again, a bf16 master slice: half the bytes, twice
    assert p2.pcie["host_to_device"] == params.pcie["host_to_device"]
    assert p2.pcie["device_to_host"] == 2 * G  # one bf16 reduction per step


def test_host_memory_counts_every_worker_of_a_node_against_its_memory():
    cfg = job(offload="optimizer", snapshot_every=0)
    p = plan(cfg, 4, BIG, local_world_size=2, host_memory_bytes=TiB)
    assert p.workers_per_node == 2
    assert p.host_per_node == 2 * p.host_per_worker
    assert p.host_per_worker == (
        levers_module.HOST_BASELINE_BYTES + p.host_state + p.host_staging + p.snapshot_host
    )
    tight = plan(cfg, 4, BIG, local_world_size=2, host_memory_bytes=p.host_per_node - 1)
    assert tight.fits and not tight.fits_host and not tight.fits_all


# ----------------------------------------------------------------------------- presets, answers


def test_70b_preset_is_llama_3_70b():
    m = PRESETS["70b"]
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (
        8192,
        80,
        64,
        8,
        28672,
        128256,
    )
    assert count_params(m) == 70_553_706_496  # 70.55B, as Meta's model card


SEVENTY_B = job(model=model_config("70b"), global_batch=16, seq_len=4096, param_dtype="bfloat16")


@pytest.fixture(scope="module")
def seventy_b_options():
    return options(SEVENTY_B, 8, 80 * GiB, host_memory_bytes=TiB)


def test_70b_fits_on_8_x_80_gb_with_bf16_state_bf16_master_and_the_optimizer_on_the_host(
    seventy_b_options,
):
    best = seventy_b_options[0]
    assert best.fits
    p = best.plan
    assert p.total + p.headroom.total <= 72 * GiB  # the device bound, headroom included
    assert p.host_per_node <= TiB
    assert set(best.levers) == {
        "optim.state_dtype=bfloat16",
        "sharding.master_dtype=bfloat16",
        "sharding.offload=optimizer",
        "train.snapshot_every=0",  # 5 shard states per worker cannot fit one node's host
    }
    assert p.activation_checkpointing  # 2 x 4096 tokens of 70B activations otherwise
    # no lever at all: 16 bytes a parameter over 8 devices is 131 GiB per device
    plain = next(o for o in seventy_b_options if not o.levers)
    assert not plain.plan.fits and plain.plan.model_state / GiB > 131


def test_options_that_fit_come_first_cheapest_first(seventy_b_options):
    fits = [o.fits for o in seventy_b_options]
    assert fits == sorted(fits, reverse=True)
    fitting = [o for o in seventy_b_options if o.fits]
    overheads = [o.overhead_s for o in fitting]
    assert overheads == sorted(overheads)
    # offloading the parameters moves more over PCIe than the optimizer alone: it comes after
    by_offload = {o.plan.offload_level: o for o in best_per_levers(fitting)}
    assert by_offload["params"].plan.total < by_offload["optimizer"].plan.total  # no copy kept
    assert by_offload["params"].pcie_s > by_offload["optimizer"].pcie_s
    assert fitting.index(by_offload["optimizer"]) < fitting.index(by_offload["params"])


def test_the_step_estimate_is_compute_recompute_pcie_host_step_and_network(seventy_b_options):
    """The network term is what the step-time model (trainer/plan/steptime.py) leaves exposed:
    the communication compute did not hide, not every byte at one speed."""
    o = seventy_b_options[0]
    p, rates = o.plan, levers_module.Costs()
    assert o.pcie_s == pytest.approx(p.pcie_bytes / (rates.pcie_gbs * 1e9))
    assert o.network_s == pytest.approx(o.time.exposed_s + o.time.exchange_s)
    nvlink = default_hardware(8).intra.gbs  # 8 workers: one node, every byte over NVLink
    assert o.network_s < p.total_bytes_moved / (nvlink * 1e9)  # some of it hides
    assert o.host_step_s == pytest.approx(
        p.host_step_bytes * p.workers_per_node / (rates.host_bandwidth_gbs * 1e9)
    )
    # recomputing every block's forward: about a third of forward + backward
    assert 0.25 < o.recompute_s / o.compute_s < 1 / 3
    assert o.step_s == pytest.approx(
        o.compute_s + o.recompute_s + o.pcie_s + o.host_step_s + o.network_s
    )


def test_8b_fits_on_4_x_24_gb_by_offloading():
    cfg = job(model=model_config("8b"), global_batch=8, seq_len=2048, param_dtype="bfloat16")
    best = cheapest(cfg, 4, 24 * GiB, local_world_size=4, host_memory_bytes=256 * GiB)
    assert best is not None and best.plan.fits_all
    assert best.plan.offload_level != "none"
    assert best.plan.host_per_node <= 256 * GiB


def test_8b_on_8_x_80_gb_needs_no_lever():
    cfg = job(model=model_config("8b"), global_batch=8, seq_len=4096, param_dtype="bfloat16")
    best = cheapest(cfg, 8, 80 * GiB, host_memory_bytes=TiB)
    assert best is not None and best.levers == ()
    assert best.plan.pcie_bytes == 0


# ----------------------------------------------------------------------------- refusal, CLI


def test_a_run_that_cannot_fit_is_refused_naming_the_levers_that_would_fit():
    with pytest.raises(ConfigError) as err:
        check_fits(SEVENTY_B, 8, 80 * GiB, host_memory_bytes=TiB)
    msg = str(err.value)
    assert msg.startswith("invalid config: sharding.strategy=FULL_SHARD")
    assert "Memory levers that make it fit, cheapest first" in msg
    first = msg.split("cheapest first")[1].splitlines()[1]
    for lever in (
        "optim.state_dtype=bfloat16",
        "sharding.master_dtype=bfloat16",
        "sharding.offload=optimizer",
        "train.snapshot_every=0",
        "sharding.activation_checkpointing=true",
    ):
        assert lever in first, (lever, first)


def test_a_run_whose_host_memory_does_not_fit_is_refused_naming_the_host():
    cfg = job(offload="optimizer", snapshot_every=0)
    p = plan(cfg, 2, BIG, 2)
    with pytest.raises(ConfigError) as err:
        check_fits(cfg, 2, BIG, 2, host_memory_bytes=p.host_per_node - 1)
    msg = str(err.value)
    assert msg.startswith("invalid config: host memory: 2 workers per node")
    assert (
        "Memory levers that make it fit" in msg
        and "sharding.offload=" not in msg.split("cheapest first")[1].splitlines()[1]
    )  # the cheapest that fits keeps the state on the device
    assert check_fits(cfg, 2, BIG, 2, host_memory_bytes=p.host_per_node).fits_all  # and fits


def test_cli_lists_the_levers_and_the_cheapest_and_takes_the_host_key(capsys):
    args = ["model=tiny", "cluster.num_workers=2", "device_memory_gb=80", "--table"]
    assert plan_main(args + ["host_memory_gb=64", "pcie_gbs=12.5"]) == 0
    out = capsys.readouterr().out
    assert "Memory levers on 2 workers" in out and "PCIe 12.5 GB/s" in out
    # the one answer (issue 35) replaced 'cheapest that fits:'; its overrides, as before
    (answer,) = [line for line in out.splitlines() if line.startswith("recommended: ")]
    assert "sharding.activation_checkpointing=false" in answer
    assert "host memory per node: 2 workers x" in out
    assert plan_main(args + ["host_memory_gb=0.5"]) == 1  # 2 GiB per worker process alone
    assert "over on host" in capsys.readouterr().out
    assert plan_main(args + ["host_memory_gb=-1"]) == 2
    assert "host_memory_gb" in capsys.readouterr().err
