"""The step-time model (trainer/plan/steptime.py) against published training runs: each row a
published setup given to the model, its prediction beside the published figure, and the ratio.

    python -m benchmarks.plan_vs_published       # the table, then one JSON line of every ratio

Each row is an eager PyTorch FSDP run as its source describes it: model shape, GPUs and their
links, strategy (FSDP = FULL_SHARD, HSDP = HYBRID_SHARD over a node), local batch, sequence,
activation checkpointing (full: every block's forward recomputed; selective: about half of it,
torchtitan's "op" policy recomputes every second matmul, fms-fsdp's every second block) and the
reduction dtype. The GPUs' efficiency is the model's one figure per kind (hardware.DEVICES,
from published utilisations); everything else (how the step scales with the model, the GPU
count, the strategy, checkpointing, the links) is the model's. The goal: each modelled ratio
within 25% (GOAL). Rows the model does not cover (tensor parallelism, Float8, torch.compile) are
listed with the reason and no ratio. tests/benchmarks/test_plan_vs_published.py keeps the
inputs and the ratios from drifting.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional

from trainer.config import DataConfig, ShardingConfig, TrainConfig, TrainerConfig, model_config
from trainer.model import flops_per_token
from trainer.plan.hardware import LINKS, Link, hardware
from trainer.plan.steptime import step_time

GOAL = 0.25
TORCHTITAN_H100 = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf): Grand "
    "Teton, 8 H100 a host on NVLink, 400 Gb/s RDMA a GPU; torch, torchao, torchtitan of Dec 2024"
)
TORCHTITAN_A100 = (
    "pytorch/torchtitan docs/performance.md (commit 0413364): FSDP2 on 64 A100 80GB, local "
    "batch 1 (network not stated: 200 Gb/s InfiniBand a GPU assumed)"
)
FSDP_PAPER = (
    "Zhao et al., PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel (VLDB 2023, "
    "arXiv 2304.11277) section 5.4: minGPT 175B, A100 80GB on a 2 Tb/s RoCE network (read as a "
    "node's), full sharding, prefetch, rate limiter, activation checkpointing, BF16, Adam"
)
FSDP_BLOG = (
    "pytorch.org/blog/introducing-pytorch-fully-sharded-data-parallel-api (2022-03-14): GPT "
    "175B on 128 A100-SXM4-40GB, EFA 400 Gb/s a node, fp16, SGD, parameters offloaded to the "
    "CPU, activation checkpointing"
)
FMS_FSDP = (
    "foundation-model-stack/fms-fsdp README.md (commit 4ffb9bd, Mar 2024, eager): Llama 2, seq "
    "4096, batch 2, bf16 parameters and reductions; 128 A100 80G '400Gbps', 96 H100 '800 Gbps' "
    "(read as a node's)"
)

# a 2 Tb/s RoCE network a node of 8 (the FSDP paper's cluster)
LINKS_EXTRA = {"roce-2t-node": Link("roce-2t-node", round(250 / 8 * 0.9, 1), 9.6, FSDP_PAPER)}


def shape(name: str, **fields):
    """A model of the given shape (Llama-style; a GPT's 4h GELU MLP as SwiGLU of 8h/3, the
    same parameters and FLOPs)."""
    return dataclasses.replace(model_config("tiny", **fields), name=name)


LLAMA2 = dict(vocab_size=32000, max_seq_len=4096)
MODELS = {
    "llama3-8b": model_config("8b", max_seq_len=8192),
    "llama3-70b": model_config("70b", max_seq_len=8192),
    "llama2-7b": shape("llama2-7b", dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, **LLAMA2),
    "llama2-13b": shape("llama2-13b", dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, **LLAMA2),
    "llama2-34b": shape(
        "llama2-34b", dim=8192, n_layers=48, n_heads=64, n_kv_heads=8, ffn_dim=22016, **LLAMA2
    ),
    "llama2-70b": shape(
        "llama2-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **LLAMA2
    ),
    "gpt-175b": shape(
        "gpt-175b", dim=12288, n_layers=96, n_heads=96, ffn_dim=32768, vocab_size=50000
    ),
}


@dataclass(frozen=True)
class Published:
    """One published run, as the model is given it."""

    name: str
    source: str
    model: str  # a key of MODELS
    gpus: int
    gpu: str  # hardware.DEVICES
    inter: str  # hardware.LINKS (or LINKS_EXTRA): between nodes
    strategy: str
    local_batch: int
    seq: int
    recompute: float  # of each block's forward: 1 full, 0.5 selective, 0 none
    reduce_dtype: str
    published: float
    metric: str = "tokens/s/GPU"  # or "TFLOPS/GPU": hardware FLOPs, the recomputation included
    offload: str = "none"
    modelled: bool = True
    note: str = ""
    """Why it is not modelled, or a sentence on a miss."""


def fms(model: str, gpu: str, gpus: int, strategy: str, recompute: float, value: float):
    inter = "efa-400-node" if gpu == "a100" else "eth-800-node"
    return Published(
        f"fms-fsdp {model.split('-')[1]} {gpus}x{gpu.upper()}",
        FMS_FSDP,
        model,
        gpus,
        gpu,
        inter,
        strategy,
        2,
        4096,
        recompute,
        "bfloat16",
        value,
    )


ROWS = (
    Published(
        "torchtitan 8B 8xH100",
        TORCHTITAN_H100 + "; Table 1",
        "llama3-8b",
        8,
        "h100",
        "roce-400",
        "FULL_SHARD",
        2,
        8192,
        0.5,
        "float32",
        5762,
    ),
    Published(
        "torchtitan 8B 128xH100",
        TORCHTITAN_H100 + "; Table 3",
        "llama3-8b",
        128,
        "h100",
        "roce-400",
        "FULL_SHARD",
        2,
        8192,
        0.5,
        "float32",
        5605,
    ),
    Published(
        "torchtitan 70B 256xH100 FSDP32xTP8",
        TORCHTITAN_H100 + "; Table 4 (829; 876 with async TP)",
        "llama3-70b",
        256,
        "h100",
        "roce-400",
        "FULL_SHARD",
        16,
        8192,
        1.0,
        "float32",
        829,
        modelled=False,
        note="tensor parallelism (TP 8, async or not), Float8 and torch.compile are not modelled",
    ),
    Published(
        "torchtitan 8B 64xA100",
        TORCHTITAN_A100 + "; selective op AC",
        "llama3-8b",
        64,
        "a100",
        "ib-hdr-200",
        "FULL_SHARD",
        1,
        8192,
        0.5,
        "float32",
        2973,
    ),
    Published(
        "torchtitan 70B 64xA100",
        TORCHTITAN_A100 + "; full AC",
        "llama3-70b",
        64,
        "a100",
        "ib-hdr-200",
        "FULL_SHARD",
        1,
        8192,
        1.0,
        "float32",
        331,
    ),
    Published(
        "FSDP paper 175B 128xA100 b1",
        FSDP_PAPER + "; batch 1: more than 173 TFLOPS a GPU (~55% of peak)",
        "gpt-175b",
        128,
        "a100",
        "roce-2t-node",
        "FULL_SHARD",
        1,
        2048,
        1.0,
        "bfloat16",
        173,
        metric="TFLOPS/GPU",
    ),
    Published(
        "FSDP paper 175B 512xA100 b2",
        FSDP_PAPER + "; batch 2: more than 186 TFLOPS a GPU (~60%; 128 GPUs fell short of it)",
        "gpt-175b",
        512,
        "a100",
        "roce-2t-node",
        "FULL_SHARD",
        2,
        2048,
        1.0,
        "bfloat16",
        186,
        metric="TFLOPS/GPU",
    ),
    Published(
        "FSDP blog 175B 128xA100-40 offload",
        FSDP_BLOG + ": 159 TFLOPS a GPU at batch 20 x 512 tokens",
        "gpt-175b",
        128,
        "a100-40",
        "efa-400-node",
        "FULL_SHARD",
        20,
        512,
        1.0,
        "bfloat16",
        159,
        metric="TFLOPS/GPU",
        offload="params",
    ),
    fms("llama2-7b", "a100", 128, "HYBRID_SHARD", 0.0, 3700),
    fms("llama2-13b", "a100", 128, "FULL_SHARD", 0.5, 1800),
    fms("llama2-34b", "a100", 128, "FULL_SHARD", 1.0, 700),
    fms("llama2-70b", "a100", 128, "FULL_SHARD", 1.0, 370),
    fms("llama2-7b", "h100", 96, "HYBRID_SHARD", 0.0, 7500),
    fms("llama2-13b", "h100", 96, "FULL_SHARD", 0.5, 3800),
    fms("llama2-34b", "h100", 96, "FULL_SHARD", 1.0, 1550),
    fms("llama2-70b", "h100", 96, "FULL_SHARD", 1.0, 800),
)


def job(row: Published) -> TrainerConfig:
    return TrainerConfig(
        model=MODELS[row.model],
        sharding=ShardingConfig(
            strategy=row.strategy,
            param_dtype="bfloat16",
            reduce_dtype=row.reduce_dtype,
            activation_checkpointing=row.recompute > 0,
            offload=row.offload,
        ),
        train=TrainConfig(global_batch_size=row.local_batch * row.gpus),
        data=DataConfig(seq_len=row.seq),
    )


def predict(row: Published) -> Optional[float]:
    """The model's figure for the row, in the row's metric (None when not modelled)."""
    if not row.modelled:
        return None
    inter = LINKS_EXTRA.get(row.inter) or LINKS[row.inter]
    hw = dataclasses.replace(hardware(row.gpu, 8), inter=inter)
    cfg = job(row)
    t = step_time(cfg, row.gpus, hw, recompute=row.recompute)
    if row.metric == "tokens/s/GPU":
        return t.tokens_per_s_per_gpu
    hardware_flops = flops_per_token(cfg.model, row.seq) * (1 + t.recompute_s / t.compute_s)
    return t.tflops_per_gpu(hardware_flops)


def results() -> list[dict]:
    out = []
    for row in ROWS:
        got = predict(row)
        ratio = None if got is None else got / row.published
        out.append(
            dict(
                name=row.name,
                metric=row.metric,
                published=row.published,
                predicted=None if got is None else round(got, 1),
                ratio=None if ratio is None else round(ratio, 3),
                within_goal=None if ratio is None else abs(ratio - 1) <= GOAL,
                note=row.note,
            )
        )
    return out


def table(res: list[dict]) -> str:
    head = f"{'published run':<36} {'metric':<12} {'published':>9} {'predicted':>9} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in res:
        got = "-" if r["predicted"] is None else f"{r['predicted']:,.0f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        mark = "" if r["within_goal"] in (None, True) else "  MISS"
        lines.append(
            f"{r['name']:<36} {r['metric']:<12} {r['published']:>9,.0f} {got:>9} {ratio:>6}{mark}"
        )
        if r["note"]:
            lines.append(f"    {r['note']}")
    modelled = [r for r in res if r["ratio"] is not None]
    within = sum(r["within_goal"] for r in modelled)
    lines.append(f"\n{within} of {len(modelled)} modelled rows within {GOAL:.0%} (the goal)")
    return "\n".join(lines)


def main() -> None:
    res = results()
    print(table(res))
    print("\nsources:")
    for source in dict.fromkeys(row.source.split(";")[0] for row in ROWS):
        print(f"  {source}")
    modelled = [r for r in res if r["ratio"] is not None]
    print(
        json.dumps(
            dict(
                goal=GOAL,
                rows=res,
                within_goal=sum(r["within_goal"] for r in modelled),
                modelled=len(modelled),
            )
        )
    )


if __name__ == "__main__":
    main()
