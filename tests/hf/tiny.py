"""Tiny random Hugging Face models of every family we import, built with transformers itself
(nothing is downloaded), with random biases and norm weights, so that a bias or a norm loaded
in the wrong row order changes the logits. `hf_vl_model` is a Qwen2-VL (the decoder of BASE,
3-D rotary sections [2, 3, 3], a 2-block tower of 4-pixel patches) and `vl_batch` its input:
two rows holding three images of three sizes between text."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from trainer.hf import HFWeights, config_from_hf, read_hf_config
from trainer.model import build_model

VOCAB = 128
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (transformers family, config fields beyond BASE)
MODELS = {
    "llama3_rope": ("Llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama_head_dim": ("Llama", dict(head_dim=24)),
    "qwen2_tied": ("Qwen2", dict(tie_word_embeddings=True, sliding_window=4096)),
    "qwen2_untied": ("Qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3", dict(head_dim=24, tie_word_embeddings=True)),
    "mistral": ("Mistral", dict(sliding_window=None)),
    "mistral_nemo": ("Mistral", dict(sliding_window=None, head_dim=24)),
}
FAMILY = {"Llama": "llama", "Qwen2": "qwen2", "Qwen3": "qwen3", "Mistral": "mistral"}


def hf_model(name: str, seed: int = 0, **fields):
    """The model `name` of MODELS; `fields` override its config (vocab_size=300 for byte data)."""
    family, extra = MODELS[name]
    config = getattr(transformers, f"{family}Config")(**{**BASE, **extra, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.3)
    return model


def save(name: str, path: Path, dtype: torch.dtype = torch.float32, fields=None, **kw) -> Path:
    hf_model(name, **(fields or {})).to(dtype).save_pretrained(path, **kw)
    return path


def ours_from_hf(path: Path):
    """Our model filled through HFWeights.read (what model=hf does on every rank)."""
    cfg = config_from_hf(read_hf_config(str(path)), hf_path=str(path))
    weights = HFWeights(str(path), cfg)
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            p.copy_(weights.read(fqn, 0, p.numel()).view(p.shape))
    return cfg, model.eval()


TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))


def assert_logits_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """fp32 logits the same to 1e-5 relative to their largest."""
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))


def transformers_logits(path: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def transformers_first_loss(cfg) -> float:
    """transformers' loss on the first micro-batch a run of `cfg` trains (cfg.model.hf_path's
    weights, fp32): what our first step's loss equals when it really started from them."""
    from trainer.data import Batches, PreparedData, find_dataset  # noqa: PLC0415

    batches = Batches(
        PreparedData.open(find_dataset(cfg.data.prepared_dir)),
        cfg.data.seq_len,
        cfg.data.seed,
        cfg.train.global_batch_size,
    )
    mb = batches.micro_batches(0, 0, 1, 1)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        cfg.model.hf_path, dtype=torch.float32
    )
    with torch.no_grad():
        logits = model(mb.inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb.targets.reshape(-1)))


VL_IDS = dict(
    image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123
)
IMAGE, START, END = 120, 122, 123
VL_VISION = dict(
    depth=2,
    embed_dim=32,
    hidden_size=BASE["hidden_size"],
    num_heads=4,
    mlp_ratio=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    in_channels=3,
)
VL_ROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6}


def hf_vl_model(seed: int = 0, tied: bool = False, sharp: float = 8.0):
    """A tiny random Qwen2VLForConditionalGeneration (fp32), norms and biases random too; the
    decoder's projections `sharp` times their init (greedy decoding of a model at init repeats
    one token, which would not show a position off)."""
    text = {k: v for k, v in BASE.items() if k != "tie_word_embeddings"}
    config = transformers.Qwen2VLConfig(
        text_config={**text, "rope_parameters": dict(VL_ROPE)},
        vision_config=dict(VL_VISION),
        tie_word_embeddings=tied,
        **VL_IDS,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.3)
            elif n.endswith("weight") and ("norm" in n or "ln_q" in n):
                p.uniform_(0.5, 1.5)
            elif "language_model.layers" in n and n.endswith("proj.weight"):
                p.mul_(sharp)
    return model


def image_tokens(grid: list[int]) -> list[int]:
    """<|vision_start|>, an image's run of image tokens, <|vision_end|>."""
    t, h, w = grid
    return [START] + [IMAGE] * (t * h * w // 4) + [END]


VL_GRIDS = [[1, 4, 4], [1, 6, 4], [1, 4, 8]]
"""The images of vl_batch, in order: 4, 6 and 8 tokens."""
VL_ROWS = [
    [5, 9] + image_tokens(VL_GRIDS[0]) + [7, 8] + image_tokens(VL_GRIDS[1]) + [11, 12, 13],
    [30, 31, 32] + image_tokens(VL_GRIDS[2]) + [40, 41, 42, 43, 44, 45, 46, 47],
]


def vl_batch(seed: int = 0) -> dict:
    """tokens [2, 23], pixels [72, 96] and image_grid [3, 3]: row 0 two images, row 1 one."""
    grid = torch.tensor(VL_GRIDS)
    n = int(grid.prod(-1).sum())
    pixels = torch.randn(n, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))
    return {"tokens": torch.tensor(VL_ROWS), "pixels": pixels, "image_grid": grid}


def transformers_vl_logits(model, tokens, pixels, image_grid) -> torch.Tensor:
    with torch.no_grad():
        return model(
            input_ids=tokens,
            pixel_values=pixels,
            image_grid_thw=image_grid,
            mm_token_type_ids=(tokens == IMAGE).int(),
        ).logits
