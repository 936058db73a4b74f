"""The Qwen3-MoE family (Qwen3MoeForCausalLM, Qwen3-30B-A3B): Qwen3's attention (a query/key
RMSNorm on every head, no biases) and, in its sparse layers, a mixture of experts (a router
`mlp.gate` [E, D] and E SwiGLU experts of width moe_intermediate_size); the other layers
(mlp_only_layers, or those decoder_sparse_step skips) keep a SwiGLU of intermediate_size.

A layer i is sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
(transformers' rule). The routing weights are renormalised over the top-k only with
norm_topk_prob (Qwen3-30B-A3B: true) and combined in the compute dtype. head_dim defaults to
hidden_size / num_attention_heads here (not Qwen3's 128); transformers 5 writes the expert count
as num_local_experts, published configs as num_experts: both are read. The experts are read in
either layout (trainer/hf/stacked.py) and exported per expert, under the published names.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import ModelConfig
from trainer.hf.family import Family, refuse
from trainer.hf.llama import NAMES, EosIds, decoder_fields, decoder_to_hf, shapes
from trainer.hf.names import NameMap
from trainer.hf.qwen2 import qwen_to_hf, refuse_sliding_window
from trainer.hf.qwen3 import NORMS
from trainer.hf.stacked import Stacked, StackedNames

ROUTER = [("model.layers.{i}.mlp.gate.weight", "layers.{i}.moe.router.weight")]
EXPERTS = StackedNames(
    [
        Stacked(
            "layers.{i}.moe.experts.w1",
            ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",),
            "model.layers.{i}.mlp.experts.gate_up_proj",
            part=0,
            parts=2,
        ),
        Stacked(
            "layers.{i}.moe.experts.w3",
            ("model.layers.{i}.mlp.experts.{e}.up_proj.weight",),
            "model.layers.{i}.mlp.experts.gate_up_proj",
            part=1,
            parts=2,
        ),
        Stacked(
            "layers.{i}.moe.experts.w2",
            ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",),
            "model.layers.{i}.mlp.experts.down_proj",
        ),
    ]
)


def experts_of(hf: dict) -> int:
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def sparse_layers(hf: dict) -> list[int]:
    """transformers' rule for which layers are a mixture of experts."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [
        i
        for i in range(hf["num_hidden_layers"])
        if i not in dense and experts_of(hf) > 0 and (i + 1) % step == 0
    ]


def from_hf(hf: dict, where: str) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face Qwen3-MoE config."""
    if hf.get("attention_bias"):
        refuse(hf, where, "attention_bias", "false (the model has no biases)")
    refuse_sliding_window(hf, where)
    if experts_of(hf) <= 0:
        refuse(hf, where, "num_experts", "a positive number of experts")
    fields = decoder_fields(hf, where, "qwen3_moe")
    return dict(
        fields,
        qkv_bias=False,
        qk_norm=True,
        moe_experts=experts_of(hf),
        moe_top_k=int(hf.get("num_experts_per_tok", 8)),
        moe_ffn_dim=int(hf["moe_intermediate_size"]),
        moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
        moe_weights_fp32=False,
        moe_layers=sparse_layers(hf),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def to_hf(cfg: ModelConfig, dtype: torch.dtype, eos_id: EosIds = None, bos_id=None) -> dict:
    """transformers' Qwen3MoeConfig fields: num_experts (read by transformers 4 and 5), the
    sparse layers as decoder_sparse_step 1 and mlp_only_layers = the dense ones."""
    out = decoder_to_hf(cfg, dtype, eos_id, bos_id, "Qwen3MoeForCausalLM", "qwen3_moe")
    sparse = set(cfg.sparse_layers)
    return {
        **out,
        **qwen_to_hf(cfg),
        "attention_bias": False,
        "num_experts": cfg.moe_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "norm_topk_prob": cfg.moe_norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.n_layers) if i not in sparse],
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }


QWEN3_MOE = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    title="Qwen3-MoE",
    names=NameMap(NAMES + NORMS + ROUTER),
    from_hf=from_hf,
    to_hf=to_hf,
    shapes=shapes,
    stacked=EXPERTS,
)
