"""The model's configuration: `ModelConfig` (the decoder's shape and family), `VisionConfig` (a
vision-language model's image tower, ModelConfig.vision) and the presets.

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
class VisionConfig:
    """The image tower of a vision-language model (trainer/model/vision.py; Qwen2-VL's ViT):
    patches of `temporal_patch_size` x `patch_size` x `patch_size` pixels embedded to `dim`,
    `depth` pre-norm blocks (LayerNorm, full attention inside each image with 2-D rotary
    positions, a QuickGELU MLP), then each `spatial_merge_size` x `spatial_merge_size` square of
    patches merged into one token of the decoder's width (ModelConfig.dim). The defaults, token ids
    aside, are the `tiny-vl` preset's."""

    depth: int = 2
    """Vision blocks (visual.blocks.<i>; one engine unit each)."""
    dim: int = 64
    """Width of the tower (Hugging Face's vision_config.embed_dim)."""
    n_heads: int = 4
    """Attention heads of each vision block (their width dim // n_heads, a multiple of 4: half
    of each head rotates by the patch's row, half by its column)."""
    ffn_dim: int = 256
    """Hidden size of each block's MLP (Qwen2-VL: embed_dim x mlp_ratio)."""
    patch_size: int = 14
    """Pixels of a patch's side."""
    temporal_patch_size: int = 2
    """Frames in a patch (an image is repeated to fill them, as the image processor does)."""
    spatial_merge_size: int = 2
    """Patches merged into one decoder token along each side (2: a 2x2 square, 4 patches)."""
    in_channels: int = 3
    """Colour channels of a pixel."""
    norm_eps: float = 1e-6
    """LayerNorm epsilon of the blocks and the merger."""
    rope_theta: float = 10000.0
    """Base of the tower's 2-D rotary embedding."""
    image_token_id: Optional[int] = None
    """The token that stands for one merged patch in the decoder's input (Qwen2-VL:
    <|image_pad|>, 151655): an image of grid (t, h, w) is a run of t*h*w / merge**2 of them."""
    vision_start_token_id: Optional[int] = None
    """The token before each image's run (<|vision_start|>, 151652): for the data and the chat
    template; the model itself finds images by image_token_id."""
    vision_end_token_id: Optional[int] = None
    """The token after each image's run (<|vision_end|>, 151653)."""
    video_token_id: Optional[int] = None
    """The video placeholder (<|video_pad|>): videos are not trained here; kept so that an
    export's config.json names it as the source did."""

    def validate(self, decoder_dim: int, vocab_size: int) -> None:
        keys = ("depth", "dim", "n_heads", "ffn_dim", "patch_size", "temporal_patch_size")
        for key in keys + ("spatial_merge_size", "in_channels"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                fail(f"model.vision.{key}", v, "a positive integer")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            fail(
                "model.vision.n_heads",
                self.n_heads,
                f"a divisor of model.vision.dim={self.dim} giving heads of a multiple of 4 "
                "(the 2-D rotary embedding rotates pairs by row and by column)",
            )
        for key in ("norm_eps", "rope_theta"):
            if not positive(getattr(self, key)):
                fail(f"model.vision.{key}", getattr(self, key), "a finite positive number")
        if self.image_token_id is None:
            fail("model.vision.image_token_id", None, "the id of the image placeholder token")
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or not 0 <= v < vocab_size):
                fail(f"model.vision.{key}", v, f"a token id in 0..{vocab_size - 1} or null")

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def merge_tokens(self) -> int:
        """Patches merged into one decoder token (spatial_merge_size squared)."""
        return self.spatial_merge_size**2

    @property
    def patch_features(self) -> int:
        """Numbers per patch in pixel_values: channels x frames x pixels of a patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


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
    mrope_section: Optional[list[int]] = None
    """Multimodal rotary embedding (Qwen2-VL's rope mrope_section, e.g. [16, 24, 24]): the
    head's rotary frequencies, in order, in three sections rotated by a token's temporal, row
    and column position (trainer/model/multimodal.py); they add up to head_size // 2. Text
    tokens have the three equal, so a text-only sequence is rotated as without it. Needs
    `vision`; None: one position per token."""
    vision: Optional[VisionConfig] = None
    """The image tower of a vision-language model (family qwen2_vl); None: a text-only decoder.
    build_model then builds trainer/model/multimodal.py's VisionLanguageModel."""
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
        self._validate_vision()
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

    def _validate_vision(self) -> None:
        if self.vision is None:
            if self.family in VISION_FAMILIES:
                fail("model.vision", None, f"an image tower (model.family={self.family!r})")
            if self.mrope_section is not None:
                fail("model.mrope_section", self.mrope_section, "null without model.vision")
            return
        if self.family not in VISION_FAMILIES:
            fail("model.family", self.family, f"{', '.join(VISION_FAMILIES)} with model.vision")
        if self.moe_experts:
            fail(
                "model.moe_experts",
                self.moe_experts,
                "0 with model.vision (a vision-language model with experts is not implemented)",
            )
        self.vision.validate(self.dim, self.vocab_size)
        half, sections = self.head_size // 2, self.mrope_section
        ok = isinstance(sections, list) and len(sections) == 3
        ok = ok and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sections)
        if not ok or sum(sections) != half:
            fail(
                "model.mrope_section",
                sections,
                f"three positive integers adding up to head_size // 2 = {half} (the temporal, "
                "row and column sections of the rotary frequencies)",
            )

    def __post_init__(self) -> None:
        # A checkpoint's state and dataclasses.asdict give the tower as a dict.
        if isinstance(self.vision, dict):
            self.vision = VisionConfig(**self.vision)

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


FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "qwen2_vl")
"""model.family's values (trainer/hf/ maps each to and from its Hugging Face config)."""
VISION_FAMILIES = ("qwen2_vl",)
"""The families with an image tower (model.vision)."""


def _llama3(name: str, **shape) -> ModelConfig:
    """A Llama 3 shape: its 128k vocabulary, 8 key/value heads, 8k context and rope theta."""
    return ModelConfig(
        name=name, vocab_size=128256, n_kv_heads=8, max_seq_len=8192, rope_theta=500000.0, **shape
    )


def _qwen2_vl(name: str, **shape) -> ModelConfig:
    """A published Qwen2-VL shape: its decoder's context, norms and rotary sections, and the
    tower all sizes share (32 blocks of 1280, 14-pixel patches merged 2 x 2)."""
    vision = VisionConfig(
        depth=32, dim=1280, n_heads=16, ffn_dim=5120, image_token_id=151655,
        vision_start_token_id=151652, vision_end_token_id=151653, video_token_id=151656,
    )  # fmt: skip
    return ModelConfig(
        name=name, family="qwen2_vl", qkv_bias=True, max_seq_len=32768, norm_eps=1e-6,
        rope_theta=1e6, mrope_section=[16, 24, 24], vision=vision, **shape,
    )  # fmt: skip


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
    # A vision-language model for tests and CPU runs: the tiny decoder (bytes and four special
    # tokens after them) with a 2-block image tower (3.85M parameters, 0.31M in the tower).
    "tiny-vl": ModelConfig(
        name="tiny-vl",
        family="qwen2_vl",
        vocab_size=260,
        qkv_bias=True,
        mrope_section=[8, 12, 12],
        vision=VisionConfig(
            image_token_id=256,
            vision_start_token_id=257,
            vision_end_token_id=258,
            video_token_id=259,
        ),
    ),  # fmt: skip
    # Qwen2-VL-2B (huggingface.co/Qwen/Qwen2-VL-2B-Instruct config.json): the Qwen2-1.5B decoder
    # (tied) and a 32-block, 1280-wide tower (665M with its merger); 2.21B parameters.
    "qwen2-vl-2b": _qwen2_vl(
        "qwen2-vl-2b",
        vocab_size=151936,
        dim=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        ffn_dim=8960,
        tie_embeddings=True,
    ),  # fmt: skip
    # Qwen2-VL-7B (huggingface.co/Qwen/Qwen2-VL-7B-Instruct config.json): 8.29B parameters.
    "qwen2-vl-7b": _qwen2_vl(
        "qwen2-vl-7b",
        vocab_size=152064,
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
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
