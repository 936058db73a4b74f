"""A vision-language model's image tower, measured: its whole forward and backward traced on fake
tensors, as train.freeze and activation checkpointing leave it.

    tower_profile(PRESETS["qwen2-vl-7b"], patches=16384, param_dtype="bfloat16",
                  checkpointing=True, freeze=("visual.*",))     # TowerProfile, nothing allocated

The tower (trainer/model/vision.py) runs first in a forward: the patch embedding (a root
parameter), its blocks (a unit each, checkpointed with the decoder's under
sharding.activation_checkpointing) and the merger (a unit), on every patch of the micro-batch's
images at once. Unlike a decoder block it is traced whole, every unit with its own flats as the
engine built them with train.freeze, so what autograd keeps follows the freezing exactly: a
frozen tower keeps nothing (no input of it needs a gradient), a frozen tower under a trainable
merger keeps the merger's inputs only, a trainable one keeps every block's. The micro-batch's
float32 pixels are counted with it: the step holds them until it ends.

How many patches: the planner does not know the images, so it takes the most a window holds,
every token an image token (`merge**2` patches each), unless told (trainer.plan.profile's
`image_tokens`). The images are traced as frames of Qwen2-VL's default largest image (1280
merged tokens, 5120 patches): attention runs inside each frame with the flash kernel, whose
memory grows with the patches, not with how they are split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainer.config import DType, ModelConfig, ShardingConfig
from trainer.fsdp import virtual_mesh

from .activations import ActivationProfile, AllocationTracker, _bind_flat_views, _nbytes
from .layout import frozen_model, meta_engine, thawed_model

FRAME_PATCHES = 64 * 80
"""Patches of the traced frames: Qwen2-VL's default max_pixels (28 * 28 * 1280) at 14 pixels a
patch, 1280 merged tokens."""


@dataclass(frozen=True)
class TowerProfile:
    """The tower over one micro-batch's `patches`."""

    patches: int
    retained: int
    """Kept from its forward to its backward, which runs after the decoder's and the
    embedding's: every decoder phase holds it. The pixels included; 0 besides them when nothing
    in the tower trains."""
    forward_peak: int
    """Peak of its forward above the level before it (the pixels, what it keeps, its features)."""
    backward_peak: int
    """Peak of its backward above the level where it starts (0: it has none)."""


def tower_profile(
    model: ModelConfig,
    patches: int,
    param_dtype: str,
    checkpointing: bool,
    freeze: tuple[str, ...] = (),
) -> Optional[TowerProfile]:
    """The tower's profile over `patches` patches (a multiple of merge**2); None for a model
    without one."""
    if getattr(model, "vision", None) is None or patches <= 0:
        return None
    key = frozen_model(model)
    return _tower(key, patches, str(param_dtype), bool(checkpointing), tuple(freeze))


@lru_cache(maxsize=32)
def _tower(model_key, patches: int, param_dtype: str, checkpointing: bool, freeze: tuple):
    model = thawed_model(model_key)
    sharding = ShardingConfig(
        strategy="NO_SHARD", param_dtype=param_dtype, activation_checkpointing=checkpointing
    )
    fsdp = meta_engine(model, sharding, virtual_mesh(sharding, 0, 1), freeze)
    dtype = DType.parse(param_dtype, "sharding.param_dtype").torch
    units = [u for u in fsdp.units if u.name.startswith("visual.")]

    with FakeTensorMode():
        fulls = _bind_flat_views(fsdp.root, dtype)  # the patch embedding
        for u in units:
            for m in u.modules:  # this throwaway engine's own hooks must not run in the trace
                m._forward_pre_hooks.clear()
                m._forward_hooks.clear()
            fulls += _bind_flat_views(u, dtype)
        tracker = AllocationTracker()
        with tracker:
            pixels = torch.empty(patches, model.vision.patch_features)  # fp32, as the loader's
            features = fsdp.module.visual(pixels, frames(patches))
            forward_peak = tracker.restart_peak()
            retained = tracker.current - _nbytes(features)
            backward_peak = 0
            if features.requires_grad:
                grad = torch.empty_like(features)
                start = tracker.current
                tracker.restart_peak()
                features.backward(grad)
                backward_peak = tracker.restart_peak() - start
        del fulls
    return TowerProfile(patches, retained, forward_peak, backward_peak)


def frames(patches: int) -> list[list[int]]:
    """Grids (t, h, w) of images holding `patches` patches: frames of FRAME_PATCHES, the rest
    in one more (a multiple of 4 patches: merged squares)."""
    full, rest = divmod(patches, FRAME_PATCHES)
    grid = [[1, 64, 80]] * full
    return grid + ([[1, 2, rest // 2]] if rest else [])


def with_tower(acts: ActivationProfile, tower: Optional[TowerProfile]) -> ActivationProfile:
    """The decoder's profile with the tower's activations where the step holds them (the
    timeline composes them, trainer/plan/timeline.py): what the tower keeps is alive from
    before the first block's forward to after the embedding's backward (`shared`, and the
    embedding backward's phase), and the tower's own forward and backward, which run outside
    the decoder's, are that last phase's peak when larger."""
    if tower is None:
        return acts
    root = acts.root
    outside = max(
        tower.retained + max(root.embedding_backward_peak, tower.backward_peak),
        tower.forward_peak,
    )
    return dataclasses.replace(
        acts,
        shared=acts.shared + tower.retained,
        root=dataclasses.replace(root, embedding_backward_peak=outside),
        tower=tower,
    )
