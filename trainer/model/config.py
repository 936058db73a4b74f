"""The model's configuration: `ModelConfig` (the decoder's shape and family) and its presets.

Model presets (`model=8b` on the command line) have one home: `PRESETS` below. The training
job (trainer/config.py) holds a `ModelConfig` as its `model` section and re-exports these names,
as it does the engine's `ShardingConfig` (trainer/fsdp/config.py); `validate()` raises
`ConfigError` naming the key, the value given and what would be valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from trainer.fsdp.config import ConfigError, fail
from trainer.numbers import positive


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder (trainer/model/). The defaults are the `tiny` preset."""

    name: str = "tiny"
    """Preset name, for the record (tiny, 125m, 1b, 8b, 70b, hf)."""
    family: str = "llama"
    """The decoder family, as Hugging Face names it: llama, qwen2 (Qwen2/2.5: biases on the
    query, key and value projections), qwen3 (RMSNorm on each query and key head) or mistral
    (Llama-shaped). Set from config.json's model_type with model.hf_path."""
    vocab_size: int = 256
    """Vocabulary size: at least the tokenizer's (byte-level data: 256)."""
    dim: int = 256
    """Model width (hidden size)."""
    n_layers: int = 4
    """Number of transformer blocks (one engine unit each)."""
    n_heads: int = 4
    """Attention heads."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; None means n_heads."""
    ffn_dim: int = 768
    """Hidden size of the SwiGLU feed-forward."""
    head_dim: Optional[int] = None
    """Width of one attention head; None means dim // n_heads (Qwen3 decouples it)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2/2.5)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before the rotary embedding (Qwen3)."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables are built for."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_scaling: Optional[str] = None
    """None, or 'llama3': Llama 3.1's frequency-dependent scaling of the rotary frequencies, with
    the four rope_* fields below."""
    rope_factor: float = 8.0
    """llama3 scaling: low frequencies are divided by this."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_max_seq_len / this are scaled fully."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_max_seq_len / this are not scaled."""
    rope_original_max_seq_len: int = 8192
    """llama3 scaling: the context length the model was pretrained with."""
    tie_embeddings: bool = False
    """The output projection is the token embedding matrix (no separate output weight)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of matrices."""
    moe_experts: int = 0
    """Experts of the mixture-of-experts feed-forward (trainer/model/moe.py); 0: a dense model.
    The sparse layers (moe_layers) hold a router and these experts instead of the SwiGLU."""
    moe_top_k: int = 2
    """Experts each token is routed to (num_experts_per_tok)."""
    moe_ffn_dim: int = 0
    """Hidden size of each expert's SwiGLU (Qwen3-MoE moe_intermediate_size; Mixtral's
    intermediate_size). ffn_dim stays the dense layers' width."""
    moe_norm_topk: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Qwen3-MoE norm_topk_prob; Mixtral
    always does)."""
    moe_weights_fp32: bool = False
    """Combine the experts' outputs with fp32 routing weights (Mixtral) rather than weights cast
    to the compute dtype (Qwen3-MoE)."""
    moe_layers: Optional[list[int]] = None
    """The sparse layers' indices; None: every layer (with moe_experts > 0). Qwen3-MoE's
    decoder_sparse_step and mlp_only_layers resolve to this list at import."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss added to the training loss (transformers' aux loss,
    over the global batch's routing statistics: trainer/model/moe.py)."""
    hf_path: Optional[str] = None
    """A Hugging Face Llama checkpoint (a folder or pyarrow.fs URI holding config.json and
    model.safetensors or model.safetensors.index.json): the shape above comes from its config.json
    and a run with nothing to resume starts from its weights (trainer/hf/). model=hf sets it."""

    def validate(self) -> None:
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, key)
            if not isinstance(v, int) or v <= 0:
                fail(f"model.{key}", v, "a positive integer")
        if self.family not in FAMILY_NAMES:
            fail("model.family", self.family, ", ".join(FAMILY_NAMES))
        if self.head_dim is None and self.dim % self.n_heads:
            fail("model.n_heads", self.n_heads, f"a divisor of model.dim={self.dim}")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim <= 0):
            fail("model.head_dim", self.head_dim, "null (dim // n_heads) or a positive integer")
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            fail("model.n_kv_heads", self.n_kv_heads, f"a divisor of model.n_heads={self.n_heads}")
        if self.head_size % 2:
            key, v = (
                ("model.head_dim", self.head_dim)
                if self.head_dim
                else ("model.n_heads", self.n_heads)
            )
            fail(key, v, "a value giving an even head dim (rotary pairs)")
        if self.rope_scaling not in (None, "llama3"):
            fail("model.rope_scaling", self.rope_scaling, "null or llama3")
        if self.rope_scaling and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            fail(
                "model.rope_high_freq_factor",
                self.rope_high_freq_factor,
                f"more than model.rope_low_freq_factor={self.rope_low_freq_factor}",
            )
        for key in ("norm_eps", "rope_theta", "init_std", "rope_factor"):
            if not positive(getattr(self, key)):
                fail(f"model.{key}", getattr(self, key), "a finite positive number")
        for key in ("rope_low_freq_factor", "rope_high_freq_factor"):
            if not positive(getattr(self, key)):
                fail(f"model.{key}", getattr(self, key), "a finite positive number")
        self._validate_moe()
        if self.name == "hf" and self.hf_path == "":  # model=hf without model.hf_path
            fail(
                "model.hf_path",
                self.hf_path,
                "the folder or URI of a Hugging Face Llama "
                "checkpoint (config.json and model*.safetensors)",
            )

    def _validate_moe(self) -> None:
        if not isinstance(self.moe_experts, int) or self.moe_experts < 0:
            fail("model.moe_experts", self.moe_experts, "0 (a dense model) or a positive integer")
        if not self.moe_experts:
            return
        if not isinstance(self.moe_top_k, int) or not 1 <= self.moe_top_k <= self.moe_experts:
            fail("model.moe_top_k", self.moe_top_k, f"1 to model.moe_experts={self.moe_experts}")
        if not isinstance(self.moe_ffn_dim, int) or self.moe_ffn_dim <= 0:
            fail("model.moe_ffn_dim", self.moe_ffn_dim, "a positive integer (each expert's width)")
        bad = [i for i in self.moe_layers or () if not 0 <= i < self.n_layers]
        if bad:
            fail("model.moe_layers", self.moe_layers, f"layer indices in 0..{self.n_layers - 1}")
        if not (positive(self.router_aux_loss_coef) or self.router_aux_loss_coef == 0):
            fail("model.router_aux_loss_coef", self.router_aux_loss_coef, "a finite number >= 0")

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward is the mixture of experts (none for a dense model)."""
        if not self.moe_experts:
            return ()
        if self.moe_layers is None:
            return tuple(range(self.n_layers))
        return tuple(sorted(set(self.moe_layers)))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """Width of one attention head: head_dim, or dim // n_heads."""
        return self.head_dim or self.dim // self.n_heads


FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")
"""model.family's values (trainer/hf/ maps each to and from its Hugging Face config)."""


def _llama3(name: str, **shape) -> ModelConfig:
    """A Llama 3 shape: its 128k vocabulary, 8 key/value heads, 8k context and rope theta."""
    return ModelConfig(
        name=name, vocab_size=128256, n_kv_heads=8, max_seq_len=8192, rope_theta=500000.0, **shape
    )


PRESETS: dict[str, ModelConfig] = {
    # ~3.5M parameters: tests and CPU runs.
    "tiny": ModelConfig(),
    # GPT-2 small widths with a Llama block (~134M: 85M in blocks, untied 32k embeddings).
    "125m": ModelConfig(
        name="125m", vocab_size=32000, dim=768, n_layers=12, n_heads=12, ffn_dim=2048
    ),
    # Llama 3.2 1B shapes (embeddings untied here, so ~1.50B rather than Meta's tied 1.24B).
    "1b": _llama3("1b", dim=2048, n_layers=16, n_heads=32, ffn_dim=8192),
    # Llama 3 8B shapes (8.03B parameters).
    "8b": _llama3("8b", dim=4096, n_layers=32, n_heads=32, ffn_dim=14336),
    # Llama 3 70B shapes (70.6B parameters): `python -m cluster.plan model=70b` before renting.
    "70b": _llama3("70b", dim=8192, n_layers=80, n_heads=64, ffn_dim=28672),
    # Qwen3-30B-A3B (huggingface.co/Qwen/Qwen3-30B-A3B config.json): 48 sparse layers of 128
    # experts, 8 a token, 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b",
        family="qwen3_moe",
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=6144,
        qk_norm=True,
        max_seq_len=40960,
        norm_eps=1e-6,
        rope_theta=1e6,
        moe_experts=128,
        moe_top_k=8,
        moe_ffn_dim=768,
        moe_norm_topk=True,
        router_aux_loss_coef=0.001,
    ),  # fmt: skip
    # Mixtral-8x7B (huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json): 32 sparse layers of
    # 8 experts, 2 a token, 46.7B parameters, 12.9B active.
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b",
        family="mixtral",
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=32768,
        norm_eps=1e-5,
        rope_theta=1e6,
        moe_experts=8,
        moe_top_k=2,
        moe_ffn_dim=14336,
        moe_norm_topk=True,
        moe_weights_fp32=True,
        router_aux_loss_coef=0.02,
    ),  # fmt: skip
    # A Hugging Face Llama checkpoint: model=hf model.hf_path=... (the shape is its config.json's).
    "hf": ModelConfig(name="hf", hf_path=""),
}
"""The model presets, the only place their shapes are written: Hydra's `model` group
(cluster/config.py registers each under its name) and `model_config` read them."""


def model_config(name: str, **overrides) -> ModelConfig:
    """A validated ModelConfig from a preset, with any fields overridden."""
    if name not in PRESETS:
        fail("model.name", name, ", ".join(PRESETS))
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(
            f"invalid config: model.{unknown[0]}={overrides[unknown[0]]!r}; "
            f"valid keys: {', '.join(f.name for f in dataclasses.fields(ModelConfig))}"
        )
    cfg = dataclasses.replace(PRESETS[name], **overrides)
    cfg.validate()
    return cfg
