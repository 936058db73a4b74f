"""The model: layers, the decoder built from them, its initialisation and its counts. Pure
torch, no sharding code: the engine (trainer/fsdp) wraps any of it by itself.

    model = build_model(cfg)                       # on the meta device: nothing allocated
    logits = model(tokens)                         # or model(tokens, positions) for documents
    python -c "from trainer.config import PRESETS; from trainer.model import count_params; \
               print(count_params(PRESETS['8b']))"

    norms.py           RMSNorm
    rotary.py          rotary position embedding (Llama 3.1 scaling), tables cached, not buffers
    attention.py       grouped-query attention over document boundaries; its context; KV cache
    feedforward.py     SwiGLU
    decoder.py         the block, the output head, the Transformer
    build.py           build_model: the decoder or the vision-language model, on meta or filled
    vision.py          the image tower: patch embedding, blocks with 2-D rotary, patch merger
    multimodal.py      the vision-language model: the decoder, the tower, 3-D rotary positions
    initialization.py  every parameter from (seed, its name) alone; Linears carrying their std
    counts.py          parameters and training FLOPs per token, analytically

Model families (Llama, Qwen2, Qwen3, Mistral, the mixtures, Qwen2-VL) are options of these
layers (ModelConfig.family); their Hugging Face interchange lives in trainer/hf/.
"""

from trainer.loss import loss_sum as loss_sum  # re-exported: its home is trainer/loss.py
from trainer.loss import projected_loss_sum as projected_loss_sum

from .attention import Attention, AttentionContext, KVCache, attend, document_ids, document_mask
from .build import build_model
from .config import VisionConfig
from .counts import count_params, flops_per_token, vision_flops_per_patch, vision_params
from .decoder import OutputHead, Transformer, TransformerBlock
from .feedforward import FeedForward
from .initialization import init_parameters, initializer
from .multimodal import VisionLanguageModel, rope_index
from .norms import RMSNorm
from .rotary import Positions, RotaryEmbedding, llama3_frequencies
from .vision import VisionBlock, VisionContext, VisionTower, vision_context

__all__ = [
    "Attention",
    "AttentionContext",
    "FeedForward",
    "KVCache",
    "OutputHead",
    "Positions",
    "RMSNorm",
    "RotaryEmbedding",
    "Transformer",
    "TransformerBlock",
    "VisionBlock",
    "VisionConfig",
    "VisionContext",
    "VisionLanguageModel",
    "VisionTower",
    "attend",
    "build_model",
    "count_params",
    "document_ids",
    "document_mask",
    "flops_per_token",
    "init_parameters",
    "initializer",
    "llama3_frequencies",
    "loss_sum",
    "projected_loss_sum",
    "rope_index",
    "vision_context",
    "vision_flops_per_patch",
    "vision_params",
]
