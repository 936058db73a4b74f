"""The Mixtral family (MixtralForCausalLM, Mixtral-8x7B): Mistral's attention and, in every
layer, a mixture of experts: a router [E, D] and E SwiGLU experts of width intermediate_size,
the top-k routing weights always renormalised and combined in fp32 (transformers' order).

Published checkpoints name the block `block_sparse_moe` (router `gate`, experts `w1` gate, `w3`
up, `w2` down, per expert); transformers 5 holds it as `mlp` with fused experts. Both are read
(trainer/hf/stacked.py); an export writes the published names, per expert. A sliding window and
router jitter (noise on the hidden states in training) are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import ModelConfig, fail
from trainer.hf.family import Family, refuse
from trainer.hf.llama import FULL_CONTEXT, NAMES, EosIds, decoder_fields, decoder_to_hf, shapes
from trainer.hf.names import NameMap
from trainer.hf.stacked import Stacked, StackedNames

ROUTER = [
    ("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.moe.router.weight"),
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.moe.router.weight"),
]
EXPERTS = StackedNames(
    [
        Stacked(
            "layers.{i}.moe.experts.w1",
            (
                "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
                "model.layers.{i}.mlp.experts.{e}.w1.weight",
            ),
            "model.layers.{i}.mlp.experts.gate_up_proj",
            part=0,
            parts=2,
        ),
        Stacked(
            "layers.{i}.moe.experts.w3",
            (
                "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
                "model.layers.{i}.mlp.experts.{e}.w3.weight",
            ),
            "model.layers.{i}.mlp.experts.gate_up_proj",
            part=1,
            parts=2,
        ),
        Stacked(
            "layers.{i}.moe.experts.w2",
            (
                "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
                "model.layers.{i}.mlp.experts.{e}.w2.weight",
            ),
            "model.layers.{i}.mlp.experts.down_proj",
        ),
    ]
)


def from_hf(hf: dict, where: str) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face Mixtral config."""
    if hf.get("sliding_window") is not None:
        fail(f"{where}: sliding_window", hf["sliding_window"], f"null ({FULL_CONTEXT})")
    if hf.get("router_jitter_noise"):
        refuse(hf, where, "router_jitter_noise", "0.0 (no noise on the routed hidden states)")
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if experts <= 0:
        refuse(hf, where, "num_local_experts", "a positive number of experts")
    return dict(
        decoder_fields(hf, where, "mixtral"),
        qkv_bias=False,
        qk_norm=False,
        moe_experts=experts,
        moe_top_k=int(hf.get("num_experts_per_tok", 2)),
        moe_ffn_dim=int(hf["intermediate_size"]),
        moe_norm_topk=True,
        moe_weights_fp32=True,
        moe_layers=None,
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def to_hf(cfg: ModelConfig, dtype: torch.dtype, eos_id: EosIds = None, bos_id=None) -> dict:
    """transformers' MixtralConfig fields (intermediate_size is the experts' width)."""
    out = decoder_to_hf(cfg, dtype, eos_id, bos_id, "MixtralForCausalLM", "mixtral")
    return {
        **out,
        "intermediate_size": cfg.moe_ffn_dim,
        "num_local_experts": cfg.moe_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
    }


MIXTRAL = Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    title="Mixtral",
    names=NameMap(NAMES + ROUTER),
    from_hf=from_hf,
    to_hf=to_hf,
    shapes=shapes,
    stacked=EXPERTS,
)
