"""The step-time model (trainer/plan/steptime.py): each collective priced on the links it crosses
as NCCL's tuning model prices it, the engine's schedule replayed so what hides behind compute
hides and what cannot does not, and the planner choosing among meshes by it.

Pure Python over the engine's layout on the meta device: nothing is allocated, nothing runs.
"""

from __future__ import annotations

import dataclasses

import pytest

from trainer.config import DataConfig, ShardingConfig, TrainConfig, TrainerConfig, model_config
from trainer.model import flops_per_token
from trainer.plan.hardware import BASE_LATENCY_US, Device, Hardware, Link, hardware
from trainer.plan.layout import layout
from trainer.plan.steptime import _units, collective, spread, step_time

GB = 1e9
H100 = hardware("h100")  # 360 GB/s NVLink, 45 GB/s a GPU between nodes
MID = model_config(
    "tiny", dim=512, n_layers=8, n_heads=8, ffn_dim=1536, vocab_size=8192, max_seq_len=2048
)


def job(strategy="FULL_SHARD", model=MID, world=16, rows=2, seq=256, **sh) -> TrainerConfig:
    return TrainerConfig(
        model=model,
        sharding=ShardingConfig(strategy=strategy, param_dtype="bfloat16", **sh),
        train=TrainConfig(global_batch_size=rows * world),
        data=DataConfig(seq_len=seq),
    )


def fast(hw: Hardware, factor: float) -> Hardware:
    """hw with both links `factor` x faster."""
    return dataclasses.replace(
        hw,
        intra=dataclasses.replace(hw.intra, gbs=hw.intra.gbs * factor),
        inter=dataclasses.replace(hw.inter, gbs=hw.inter.gbs * factor),
    )


# ----------------------------------------------------------------------------- collectives


def test_a_group_inside_a_node_is_on_nvlink_and_one_across_nodes_on_each_gpus_nic():
    assert spread(8, 1, 8) == (8, 1)  # a node's ranks
    assert spread(64, 1, 8) == (8, 8)  # FULL_SHARD over 8 nodes
    assert spread(16, 8, 8) == (1, 16)  # HYBRID_SHARD's replicas: one rank a node
    t = 1e9  # a 1 GB all-gather
    inside = collective("all_gather", t, 8, 1, H100)
    assert inside.links == ("intra",)
    lat = (BASE_LATENCY_US + 7 * H100.intra.step_latency_us) * 1e-6
    assert inside.seconds == pytest.approx(lat + t * 7 / 8 * 7 / 8 / (H100.intra.gbs * GB))
    # over 8 nodes a ring crosses each node boundary once: a node's 8 NICs carry S between them
    across = collective("all_gather", t, 64, 1, H100)
    assert across.links == ("intra", "inter")
    sent = t * 63 / 64
    bandwidth = max(sent * 7 / 8 / (H100.intra.gbs * GB), sent / 8 / (H100.inter.gbs * GB))
    steps = 56 * H100.intra.step_latency_us + 7 * H100.inter.step_latency_us
    assert across.seconds == pytest.approx((BASE_LATENCY_US + steps) * 1e-6 + bandwidth)
    # one rank a node: everything over its own NIC, twice for an all-reduce
    reps = collective("all_reduce", t, 16, 8, H100)
    assert reps.links == ("inter",)
    assert reps.seconds > 2 * t * 15 / 16 / (H100.inter.gbs * GB)
    assert collective("all_gather", t, 1, 1, H100) is None


def test_an_all_reduce_across_many_nodes_takes_the_tree_when_its_latency_is_lower():
    ring = (BASE_LATENCY_US + 2 * 1023 * H100.inter.step_latency_us) * 1e-6
    small = collective("all_reduce", 4, 1024, 8, H100)  # one rank a node, 1,024 nodes
    assert small.latency_s < ring / 10  # 10 tree levels, not 2,046 ring steps


# ----------------------------------------------------------------------------- the schedule


def test_with_fast_links_the_step_is_its_compute_and_what_cannot_hide():
    cfg = job(rows=32, seq=2048)
    t = step_time(cfg, 16, fast(H100, 1e6))
    tokens = 32 * 2048
    assert t.compute_s == pytest.approx(flops_per_token(MID, 2048) * tokens / H100.flops)
    assert t.recompute_s == 0 and t.pcie_s == 0 and t.host_step_s == 0
    assert 0 < t.exposed_s < 0.05 * t.compute_s  # latencies only
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_s + t.optimizer_s)
    assert t.tokens_per_s_per_gpu == pytest.approx(tokens * 16 / 16 / t.step_s)
    # tied embeddings: the output projection is the root's, and still computed
    tied = dataclasses.replace(MID, tie_embeddings=True)
    t = step_time(job(model=tied, rows=32, seq=2048), 16, fast(H100, 1e6))
    assert t.compute_s == pytest.approx(flops_per_token(tied, 2048) * tokens / H100.flops)


def test_activation_checkpointing_recomputes_each_blocks_forward():
    on = step_time(job(activation_checkpointing=True), 16, fast(H100, 1e6))
    head = 6 * MID.vocab_size * MID.dim
    blocks = (flops_per_token(MID, 256) - head) / flops_per_token(MID, 256)
    assert on.recompute_s == pytest.approx(on.compute_s * blocks / 3)
    half = step_time(job(activation_checkpointing=True), 16, fast(H100, 1e6), recompute=0.5)
    assert half.recompute_s == pytest.approx(on.recompute_s / 2)


def test_gathers_hide_behind_compute_until_the_links_are_slower_than_it():
    cfg = job(rows=32, seq=2048)
    quick = step_time(cfg, 16, H100)
    slow = step_time(cfg, 16, fast(H100, 1e-3))
    assert quick.exposed_s < 0.2 * quick.compute_s
    # 1,000x slower links: the network is the step, and busy nearly all of it
    assert slow.exposed_s > 10 * slow.compute_s
    assert slow.link_busy_s["inter"] > 0.9 * slow.step_s
    assert slow.first_gather_s > 0 and slow.tail_s > 0


def test_hybrid_keeps_the_gathers_in_the_node_and_sends_only_shards_between_nodes():
    world = 64
    links = {}
    for strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        cfg = job(strategy, world=world)
        lay = layout(MID, cfg.sharding, world, 8)
        blocks = [u for u, lu in zip(_units(lay, cfg, H100, 0.0), (lay.root, *lay.units))
                  if lu.kind == "block"]  # fmt: skip
        ((rs, ar),) = blocks[0].reductions
        links[strategy] = (blocks[0].gathers[0].links, rs.links, ar.links if ar else ())
    assert links["FULL_SHARD"] == (("intra", "inter"), ("intra", "inter"), ())
    assert links["HYBRID_SHARD"] == (("intra",), ("intra",), ("inter",))
    full = step_time(job(world=world, rows=32, seq=2048), world, H100)
    hybrid = step_time(job("HYBRID_SHARD", world=world, rows=32, seq=2048), world, H100)
    assert hybrid.step_s <= full.step_s


def test_cpu_workers_add_their_collectives_to_the_compute():
    cpu = Device("cpu", 0.05, 1.0, 20.0, 0.0, overlap=False)
    gloo = Link("gloo", 0.5, 0.0)
    hw = Hardware(cpu, 2, gloo, gloo, base_latency_us=500)
    cfg = job(world=2)
    t = step_time(cfg, 2, hw)
    hidden = step_time(
        cfg, 2, dataclasses.replace(hw, device=dataclasses.replace(cpu, overlap=True))
    )
    assert t.exposed_s == pytest.approx(t.link_busy_s["intra"] + 2 * 500e-6, rel=1e-6)
    assert hidden.exposed_s < t.exposed_s


def test_offloading_adds_its_pcie_copies_and_the_hosts_optimizer_step():
    on_device = step_time(job(), 16, H100)
    offloaded = step_time(job(offload="optimizer"), 16, H100)
    assert on_device.pcie_s == 0 and offloaded.pcie_s > 0 and offloaded.host_step_s > 0
    assert offloaded.optimizer_s == 0 and on_device.optimizer_s > 0
    assert offloaded.step_s > on_device.step_s


# ----------------------------------------------------------------------------- the choice


def test_the_planner_tries_hybrid_shard_groups_of_a_node_times_powers_of_two(capsys):
    from cluster.plan import compose_job, main
    from trainer.plan.choose import hybrid_groups

    args = ["model=8b", "cluster.num_workers=64", "train.global_batch_size=64"]
    args += ["data.seq_len=4096", "sharding.param_dtype=bfloat16"]
    assert hybrid_groups(compose_job(args), 64, 8) == [8, 16, 32]  # 64 would be FULL_SHARD
    assert main(args) == 0
    out = capsys.readouterr().out
    (why,) = [line for line in out.splitlines() if line.startswith("why: ")]
    assert "tokens/s a GPU" in why and "tokens/s at 64 GPUs" in why
    (goodput,) = [line for line in out.splitlines() if line.startswith("goodput: ")]
    assert "one every" in goodput and "Young/Daly" in goodput and "tokens a day" in goodput
