"""Tiny random Hugging Face models of every family we import, built with transformers itself
(nothing is downloaded), with random biases and norm weights, so that a bias or a norm loaded
in the wrong row order changes the logits."""

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
