"""`build_model(cfg)`: the decoder (decoder.py), or with cfg.vision the vision-language model
(multimodal.py, which extends the decoder), built on the meta device and, on a real one,
filled by name (initialization.py). Its own module because it names both models: in
decoder.py it would import the module that imports decoder.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import ModelConfig
from .decoder import Transformer
from .initialization import init_parameters
from .multimodal import VisionLanguageModel


def build_model(cfg: ModelConfig, device="meta", seed: Optional[int] = None) -> Transformer:
    """The model on `device`; on meta (the default) nothing is allocated, even for 8B. With
    cfg.vision, the vision-language model (multimodal.py: this decoder and an image tower).

    On a real device the model is built on meta, materialised with `to_empty` and filled by
    `init_parameters(model, seed or 0)`: torch's default per-layer init is never run (it would
    be wasted work, and not keyed by name).
    """
    with torch.device("meta"):
        model = VisionLanguageModel(cfg) if cfg.vision is not None else Transformer(cfg)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        init_parameters(model, 0 if seed is None else seed)
    return model
