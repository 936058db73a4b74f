"""Decoding: a prompt's next tokens, on a plain model or on every rank of the sharded engine.

    ids = generate_ids(model, [1, 2, 3], max_new_tokens=16, stop_ids=[2])          # greedy
    ids = generate_ids(fsdp, prompt, 16, stop_ids, world=world)                    # all ranks
    ids = generate_ids(vlm, prompt, 16, pixels=pixel_values, image_grid=image_grid_thw)

Prefill the prompt into a KVCache, then one token per forward. The engine all-gathers each
unit's parameters inside every forward, so every rank must run the same forwards with the same
shapes: rank 0 chooses each token and broadcasts it, so all ranks feed the same token and stop
at the same step. The ids returned are the new tokens only, the stop token included when one
ended the generation (as transformers' generate returns them).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import ModelConfig
from trainer.model import KVCache


@torch.no_grad()
def generate_ids(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
    cfg: Optional[ModelConfig] = None,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
    world: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
    use_cache: bool = True,
    pixels: Optional[torch.Tensor] = None,
    image_grid: Optional[torch.Tensor] = None,
) -> list[int]:
    """Up to `max_new_tokens` new ids after `prompt_ids` (fewer where the model's max_seq_len
    ends first), stopping after the first of `stop_ids`. Greedy at temperature 0, else sampled
    from softmax(logits / temperature) cut to the top-p nucleus with `generator` (CPU), on rank 0.

    `model`: a Transformer or the engine wrapping one (cfg, device and the compute dtype are
    read from it when not given). With world > 1 every rank must call this with the same
    prompt and arguments. `use_cache=False` recomputes the whole sequence at every step (the
    reference the cache is tested against).

    A vision-language model's prompt may hold images: `pixels` and `image_grid` as its forward
    takes them (the image processor's pixel_values and image_grid_thw), read with the prompt;
    the new tokens' rotary positions continue after the prompt's (the KV cache's rope_delta)."""
    cfg = cfg or model_config(model)
    device = torch.device(device) if device is not None else model_device(model)
    dtype = dtype or compute_dtype(model)
    prompt = [int(i) for i in prompt_ids]
    if not prompt:
        raise ValueError("generate_ids: the prompt is empty; valid: at least one token id")
    if len(prompt) > cfg.max_seq_len:
        raise ValueError(
            f"generate_ids: the prompt has {len(prompt)} tokens; valid: at most "
            f"model.max_seq_len={cfg.max_seq_len}"
        )
    budget = min(max_new_tokens, cfg.max_seq_len - len(prompt))
    stops = {int(i) for i in stop_ids}
    # The last new token is never fed back: the cache holds the prompt and all new tokens but it.
    room = len(prompt) + max(budget - 1, 0)
    cache = KVCache(cfg, 1, room, device, dtype) if use_cache else None
    sequence = torch.tensor([prompt], dtype=torch.long, device=device)
    feed, new = sequence, []
    images = {} if pixels is None else {"pixels": pixels.to(device), "image_grid": image_grid}
    for _ in range(budget):
        if cache is not None:  # the images go with the prompt, into the cache
            logits = model(feed, cache=cache, **(images if cache.length == 0 else {}))
        else:
            logits = model(sequence, **images)
        token = next_token(logits[0, -1], temperature, top_p, generator, world)
        new.append(int(token))
        if new[-1] in stops:
            break
        feed = token.view(1, 1)
        if cache is None:
            sequence = torch.cat([sequence, feed], dim=1)
    return new


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: Optional[torch.Generator],
    world: int = 1,
) -> torch.Tensor:
    """The next token (a 1-element LongTensor on the logits' device), chosen on rank 0 and
    broadcast to the others, so every rank feeds the same one."""
    if world > 1 and dist.get_rank() != 0:
        token = torch.empty(1, dtype=torch.long, device=logits.device)
    elif temperature <= 0:
        token = logits.argmax().view(1)
    else:
        token = sample(logits, temperature, top_p, generator).to(logits.device)
    if world > 1:
        dist.broadcast(token, src=0)
    return token


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator]
) -> torch.Tensor:
    """One id from softmax(logits / temperature) restricted to the smallest set of most likely
    tokens whose mass reaches top_p (the most likely one always stays). On the CPU in fp32, so
    a seed gives the same tokens on any device."""
    probs = torch.softmax(logits.detach().float().cpu() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    outside = (sorted_probs.cumsum(0) - sorted_probs) >= top_p  # the mass before it is enough
    outside[0] = False
    sorted_probs[outside] = 0.0
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return order[choice]


def model_config(model: nn.Module) -> ModelConfig:
    """The ModelConfig of a Transformer, or of the one the engine wraps (`.module`)."""
    cfg = getattr(model, "cfg", None) or getattr(getattr(model, "module", None), "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"generate_ids: {type(model).__name__} has no ModelConfig; pass cfg=")
    return cfg


def model_device(model: nn.Module) -> torch.device:
    """The engine's device, or a plain model's (that of its first parameter)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype forwards compute in: the engine's param_dtype (its parameters are fp32
    shards), or a plain model's parameter dtype."""
    dtype = getattr(model, "param_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(model.parameters()).dtype
