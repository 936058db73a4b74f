"""The planner with frozen units, per-module strategies and a vision tower (issue 38).

- A frozen unit costs no gradient shard, no optimizer state and no reduce-scatter (or
  all-reduce), exactly its elements' worth; its weights are still held and gathered. Each unit
  is priced by its own strategy (sharding.modules): a frozen NO_SHARD unit keeps its whole
  master and sends nothing.
- The layout lists a vision-language model's units in forward order (the tower first) and says
  which units' backward runs: none of a frozen tower's, nor of leading frozen decoder units.
- The tower's activations are traced whole with its freezing (trainer/plan/tower.py): frozen it
  keeps only the pixels; a trainable merger keeps its inputs; a trainable tower keeps every
  block's (its inputs alone under activation checkpointing); they are alive in every decoder
  phase of the step.
- The Qwen2-VL-7B preset has the published model's 8,291,375,616 parameters (the tower's
  675,759,104), and its plans on 8 x 24 GiB and 8 x 80 GiB (tower frozen, every token an image
  token at 4096) come out as docs/planner.md states them.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest

from tests.fsdp.scaffold import tiny
from trainer.config import ShardingConfig, TrainerConfig, model_config
from trainer.model import count_params
from trainer.plan import layout, plan
from trainer.plan.tower import tower_profile
from trainer.plan.traffic import bytes_per_step

GiB = 2**30
FULL = ShardingConfig(strategy="FULL_SHARD")
BF16 = dict(strategy="FULL_SHARD", param_dtype="bfloat16")
TOWER = ("visual.*",)
# stage 1 of Qwen2-VL's recipe: only the merger (the projector) trains
MERGER_ONLY = (
    "visual.patch_embed",
    "visual.blocks.*",
    "tok_embeddings",
    "layers.*",
    "norm",
    "output",
)


def _unit(lay, name):
    return next(u for u in lay.all_units if u.name == name)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_a_frozen_unit_costs_no_gradient_no_optimizer_state_and_no_reduction(strategy):
    """layers.0 frozen at world 4, under its own strategy (the rest FULL_SHARD): exactly its
    shard's gradient (4 bytes an element) and AdamW state (8) go, and its reduction's bytes."""
    sh = ShardingConfig(strategy="FULL_SHARD", modules={"layers.0": strategy})
    base = layout(tiny(), sh, 4, 4)
    frozen = layout(tiny(), sh, 4, 4, freeze=("layers.0",))
    u = _unit(base, "layers.0")
    (padded,), (shard,) = u.padded, u.shard
    assert _unit(frozen, "layers.0").trainable == (False,)
    assert base.sharded_grads - frozen.sharded_grads == 4 * shard
    assert base.optim_state - frozen.optim_state == 8 * u.opt_numel
    assert frozen.sharded_params == base.sharded_params  # the weights are held all the same
    sent, sent_frozen = bytes_per_step(base, sh, 1), bytes_per_step(frozen, sh, 1)
    assert sent_frozen["all_gather"] == sent["all_gather"]  # and gathered to compute
    if strategy == "NO_SHARD":  # replicated: its whole master, its gradient all-reduced
        assert shard == padded == u.opt_numel
        assert sent["all_reduce"] - sent_frozen["all_reduce"] == 2 * padded * 4 * 3 // 4
        assert sent_frozen["reduce_scatter"] == sent["reduce_scatter"]
    else:
        assert sent["reduce_scatter"] - sent_frozen["reduce_scatter"] == padded * 4 * 3 // 4
    assert frozen.frozen_elements == 25_250  # one block of tests/fsdp/scaffold.py's model


def test_only_units_a_gradient_reaches_run_a_backward():
    def runs(model, freeze):
        return {u.name: u.backward for u in layout(model, FULL, 2, 2, freeze=freeze).units}

    dense = runs(tiny(), ("tok_embeddings", "layers.0"))
    assert not dense["tok_embeddings"] and not dense["layers.0"]
    assert dense["layers.1"] and dense["norm+output"]
    middle = runs(tiny(), ("layers.1",))  # a gradient passes through it to layers.0
    assert all(middle.values())
    vl = model_config("tiny-vl")
    frozen_tower = runs(vl, TOWER)
    assert not any(v for k, v in frozen_tower.items() if k.startswith("visual."))
    assert frozen_tower["tok_embeddings"] and frozen_tower["layers.0"]
    merger = runs(vl, MERGER_ONLY)  # the decoder's backward runs to reach the merger's
    assert merger["visual.merger"] and merger["layers.0"] and not merger["tok_embeddings"]
    assert not any(v for k, v in merger.items() if k.startswith("visual.blocks"))


def test_the_tower_comes_first_in_the_layout_s_forward_order():
    lay = layout(model_config("tiny-vl"), FULL, 2, 2)
    kinds = [u.kind for u in lay.units]
    assert kinds == ["vision_block"] * 2 + ["vision_merger", "embedding"] + ["block"] * 4 + ["head"]
    assert lay.root.padded  # the patch embedding


@lru_cache(maxsize=None)
def tower(freeze: tuple, checkpointing: bool, patches: int = 4 * 256):
    return tower_profile(model_config("tiny-vl"), patches, "float32", checkpointing, freeze)


def test_a_frozen_tower_keeps_only_the_pixels_and_a_trainable_one_keeps_its_blocks():
    vl = model_config("tiny-vl")
    pixels = 4 * 256 * vl.vision.patch_features * 4  # fp32, held by the step
    frozen = tower(TOWER, False)
    assert frozen.retained == pixels and frozen.backward_peak == 0
    assert frozen.forward_peak > pixels  # its forward's temporaries, gone after it
    merger = tower(MERGER_ONLY, False)
    trainable = tower((), False)
    checkpointed = tower((), True)
    assert pixels < merger.retained < checkpointed.retained < trainable.retained
    # checkpointed, each block keeps its input: [patches, dim] fp32
    blocks = vl.vision.depth * 4 * 256 * vl.vision.dim * 4
    assert checkpointed.retained - merger.retained >= blocks
    assert trainable.retained > 4 * blocks  # a block keeps many times its input
    assert trainable.backward_peak > 0 and merger.backward_peak > 0


def vl_job(freeze=(), seq=256, **sharding) -> TrainerConfig:
    cfg = TrainerConfig(model=model_config("tiny-vl"), sharding=ShardingConfig(**sharding))
    cfg.train.freeze, cfg.data.seq_len, cfg.train.global_batch_size = list(freeze), seq, 2
    cfg.train.snapshot_every = 0
    return cfg.validate()


def test_the_tower_s_activations_are_alive_in_every_decoder_phase():
    """One sequence of 256 tokens a worker, all image tokens: 1024 patches, the tower's trace
    above; without images the same job holds exactly that less in each decoder phase."""
    cfg = vl_job()
    p = plan(cfg, 2, 80 * GiB)
    text = plan(cfg, 2, 80 * GiB, image_tokens=0)
    assert p.image_patches == 4 * 256 and text.image_patches == 0
    assert p.tower_activations == tower((), False).retained
    for a, b in zip(p.timeline.phases, text.timeline.phases):
        if a.name.startswith(("forward of block", "backward of block", "loss and head")):
            assert a.root_activations - b.root_activations == p.tower_activations, a.name
        if a.name == "embedding backward":  # the tower's own forward and backward run here
            assert a.root_activations >= p.tower_activations
    frozen = plan(vl_job(TOWER), 2, 80 * GiB)
    assert frozen.tower_activations == tower(TOWER, False).retained
    assert frozen.total < p.total and frozen.frozen_params == _tower_params("tiny-vl")


def _tower_params(preset: str) -> int:
    m = model_config(preset)
    text = dataclasses.replace(m, vision=None, family="qwen2", mrope_section=None)
    return count_params(m) - count_params(text)


# ---- Qwen2-VL-7B ---------------------------------------------------------------------------

# Published (huggingface.co/Qwen/Qwen2-VL-7B-Instruct): 8.29B parameters. By hand from its
# config.json: the tower's patch embedding 1280 x 3 x 2 x 14 x 14, 32 blocks of 19,677,440 (two
# LayerNorms, qkv 1280 -> 3840 and proj with biases, MLP 1280 -> 5120 -> 1280 with biases) and the
# merger 44,575,744 (LayerNorm 1280, 5120 -> 5120 -> 3584 with biases); the decoder Qwen2-7B's.
TOWER_7B = 1280 * 3 * 2 * 14 * 14 + 32 * 19_677_440 + 44_575_744
PARAMS_7B = 8_291_375_616


def vl7b(freeze=TOWER, checkpointing=False, state="float32", modules=None) -> TrainerConfig:
    cfg = TrainerConfig(
        model=model_config("qwen2-vl-7b"),
        sharding=ShardingConfig(
            **BF16, activation_checkpointing=checkpointing, modules=dict(modules or ())
        ),
    )
    cfg.train.freeze, cfg.train.global_batch_size, cfg.data.seq_len = list(freeze), 8, 4096
    cfg.optim.state_dtype, cfg.train.snapshot_every = state, 0
    return cfg.validate()


@lru_cache(maxsize=None)
def plan_7b(gib: int, **kw):
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
    return plan(vl7b(**kw), 8, gib * GiB)


def test_the_7b_vision_language_preset_has_the_published_shapes():
    m = model_config("qwen2-vl-7b")
    assert count_params(m) == PARAMS_7B
    assert _tower_params("qwen2-vl-7b") == TOWER_7B == 675_759_104
    assert (m.dim, m.n_layers, m.n_heads, m.kv_heads, m.ffn_dim) == (3584, 28, 28, 4, 18944)
    assert (m.vocab_size, m.tie_embeddings) == (152064, False)
    v = m.vision
    assert (v.depth, v.dim, v.n_heads, v.ffn_dim, v.patch_size) == (32, 1280, 16, 5120, 14)
    assert (v.temporal_patch_size, v.spatial_merge_size) == (2, 2)


def test_the_7b_plans_on_8_x_80_and_8_x_24_gib():
    frozen = plan_7b(80)
    trained = plan_7b(80, freeze=())
    assert frozen.frozen_params == TOWER_7B and frozen.image_patches == 4 * 4096
    # the tower's shards: no AdamW state, no gradient (rank 0's 1/8, its unit's padding aside)
    saved = trained.optim_state - frozen.optim_state
    assert abs(saved - 8 * TOWER_7B / 8) < 8 * 8 * 40  # < 8 elements of padding a unit
    assert trained.sharded_grads - frozen.sharded_grads == pytest.approx(saved / 2, abs=2048)
    assert frozen.bytes_moved["reduce_scatter"] == pytest.approx(
        (PARAMS_7B - TOWER_7B) * 4 * 7 / 8, rel=1e-4
    )
    assert frozen.fits and trained.fits  # 8 x 80 GiB: as configured, no lever
    on_24 = plan_7b(24)
    assert not on_24.fits  # as configured: the decoder's activations alone are 26 GiB
    assert plan_7b(24, checkpointing=True, state="bfloat16").fits
    # the frozen tower replicated: no gathers for it, its whole master and compute copy held
    replicated = plan_7b(24, checkpointing=True, modules=(("visual.*", "NO_SHARD"),))
    assert (
        replicated.bytes_moved["all_gather"]
        < plan_7b(24, checkpointing=True).bytes_moved["all_gather"]
    )
    assert replicated.sharded_params > on_24.sharded_params
