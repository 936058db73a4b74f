"""A micro-batch as the training step takes it: (inputs, targets, weight, positions[, real[,
images]]); `images` (a vision-language model's data) is the model's image keywords, a dict of
pixels and image_grid (trainer/model/multimodal.py), `real` None before it when not needed.

yield model_inputs(mb.to(device, non_blocking=True), pad_id)   # trainer/loop.py, evaluate
"""

from __future__ import annotations

from typing import Optional

import torch


def model_inputs(mb, pad_id: Optional[int] = None) -> tuple:
    """(inputs, targets, weight, positions[, real]) of a micro-batch on its device, as train_step
    takes them: the per-token loss weights when the data has a loss mask, else the number weight.
    `pad_id` (a mixture of experts' run): the non-padding tokens too, what its routing
    statistics count (transformers leaves padding out of the load-balancing loss)."""
    weights = mb.loss_weights
    out = (mb.inputs, mb.targets, mb.weight if weights is None else weights, mb.input_positions)
    images = image_inputs(mb)
    if pad_id is None:
        return out if images is None else (*out, None, images)
    if mb.weight == 0:  # a placeholder (so collectives pair up): its tokens count nowhere
        real = torch.zeros(mb.inputs.shape, dtype=torch.bool, device=mb.inputs.device)
    else:
        real = real_tokens(mb.inputs, mb.input_positions, pad_id)
    return (*out, real) if images is None else (*out, real, images)


def image_inputs(mb) -> Optional[dict]:
    """The model's image keywords of a micro-batch whose samples hold images: {"pixels": [N,
    patch] float, "image_grid": [n, 3] (t, h, w)}; None for text (or a micro-batch without any
    image: the tower then does not run, and holds no gradient to wait for)."""
    pixels = getattr(mb, "pixels", None)
    if pixels is None or pixels.shape[0] == 0:
        return None
    return {"pixels": pixels, "image_grid": mb.image_grid}


def real_tokens(
    inputs: torch.Tensor, positions: Optional[torch.Tensor], pad_id: int
) -> Optional[torch.Tensor]:
    """[B, T] bool: False on the padding that fills a packed window after its last document
    (trainer/data/packing.py: pad ids, positions restarting at 0, a last segment of nothing
    but pad ids); None (every token real) for plain pre-training windows."""
    if positions is None:
        return None
    doc = torch.cumsum((positions == 0).to(torch.int32), dim=1)
    last = doc == doc[:, -1:]
    pad = last & (inputs == pad_id)
    padded = (pad == last).all(dim=1, keepdim=True)  # the last segment is all padding
    return ~(pad & padded)
