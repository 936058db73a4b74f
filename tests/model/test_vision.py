"""trainer/model/vision.py and multimodal.py: the image tower and the vision-language model on
their own (transformers' parity is tests/hf/test_qwen2_vl.py): names, meta construction and
init, 3-D rotary positions per document, per-image attention, the KV cache with images, a
text-only batch still running the tower, and ModelConfig's refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.config import ConfigError, model_config
from trainer.model import (
    KVCache,
    Transformer,
    VisionConfig,
    VisionLanguageModel,
    build_model,
    count_params,
    init_parameters,
    rope_index,
    vision_context,
)

IMAGE = 256  # tiny-vl's image token


def tiny_vl(**overrides):
    return model_config("tiny-vl", n_layers=2, **overrides)


def images(*grids, seed: int = 0):
    """Random pixels of images with these (t, h, w) grids, and the grid tensor."""
    grid = torch.tensor(grids)
    n = int(grid.prod(-1).sum())
    pixels = torch.randn(n, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))
    return pixels, grid


def with_images(text: list[list[int]], runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """Token rows from `text` rows with (row, column, count) image runs written over them."""
    tokens = torch.tensor(text)
    for row, col, count in runs:
        tokens[row, col : col + count] = IMAGE
    return tokens


def text_rows(b: int, t: int, seed: int = 1) -> list[list[int]]:
    return torch.randint(0, 250, (b, t), generator=torch.Generator().manual_seed(seed)).tolist()


def test_build_on_meta_keeps_decoder_names_and_puts_the_tower_at_visual():
    cfg = tiny_vl()
    model = build_model(cfg)
    assert isinstance(model, VisionLanguageModel) and isinstance(model, Transformer)
    names = [n for n, _ in model.named_parameters()]
    qwen2 = dataclasses.replace(cfg, vision=None, family="qwen2", mrope_section=None)
    text = [n for n, _ in build_model(qwen2).named_parameters()]
    assert [n for n in names if not n.startswith("visual.")] == text
    assert {n.split(".")[1] for n in names if n.startswith("visual.")} == {
        "patch_embed", "blocks", "merger"
    }  # fmt: skip
    assert len(model.visual.blocks) == cfg.vision.depth
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)


def test_init_fills_the_tower_by_name_per_block_as_whole():
    model = build_model(tiny_vl(), "cpu", seed=3)
    block = model.visual.blocks[1]
    assert torch.equal(block.norm1.weight, torch.ones_like(block.norm1.weight))
    assert torch.equal(block.norm1.bias, torch.zeros_like(block.norm1.bias))
    assert torch.equal(block.attn.qkv.bias, torch.zeros_like(block.attn.qkv.bias))
    assert float(block.attn.qkv.weight.detach().std()) == pytest.approx(0.02, rel=0.1)
    alone = build_model(tiny_vl()).visual.blocks[1].to_empty(device="cpu")
    init_parameters(alone, 3, prefix="visual.blocks.1.")
    for (name, a), b in zip(alone.named_parameters(), block.parameters()):
        assert torch.equal(a, b), name


def test_without_images_the_model_is_the_qwen2_decoder_documents_and_cache_too():
    """Three equal positions rotate as one: the same logits as a Qwen2 model of the same
    weights, with packed documents and through a KV cache."""
    cfg = tiny_vl()
    vlm = build_model(cfg, "cpu", seed=0).eval()
    text_cfg = dataclasses.replace(cfg, vision=None, family="qwen2", mrope_section=None)
    qwen2 = build_model(text_cfg, "cpu", seed=0).eval()
    tokens = torch.tensor(text_rows(2, 12))
    positions = torch.tensor([list(range(5)) + list(range(7))] * 2)
    with torch.no_grad():
        torch.testing.assert_close(vlm(tokens), qwen2(tokens), rtol=0, atol=0)
        torch.testing.assert_close(vlm(tokens, positions), qwen2(tokens, positions), rtol=0, atol=0)
        cache = KVCache(cfg, 2, 16, "cpu", torch.float32)
        vlm(tokens[:, :8], cache=cache)
        torch.testing.assert_close(vlm(tokens[:, 8:], cache=cache), qwen2(tokens)[:, 8:])


def test_rope_index_counts_an_image_by_its_largest_side_and_restarts_per_document():
    vision = tiny_vl().vision
    # Row 0: 2 text, an image of 2 x 3 merged patches (grid 1 x 4 x 6), 2 text; then a second
    # document: 1 text, an image of 1 x 1 (grid 1 x 2 x 2), 1 text.
    tokens = with_images(text_rows(1, 15), [(0, 2, 6), (0, 11, 1)])
    positions = torch.tensor([list(range(10)) + list(range(5))])
    three = rope_index(tokens, positions, [[1, 4, 6], [1, 2, 2]], vision)
    t, h, w = three[:, 0].tolist()
    assert t == [0, 1] + [2] * 6 + [5, 6] + [0, 1] + [2] + [3, 4]
    assert h == [0, 1] + [2, 2, 2, 3, 3, 3] + [5, 6] + [0, 1, 2, 3, 4]
    assert w == [0, 1] + [2, 3, 4, 2, 3, 4] + [5, 6] + [0, 1, 2, 3, 4]
    alone = rope_index(tokens[:, 10:], None, [[1, 2, 2]], vision)  # the second document alone
    assert torch.equal(alone[:, 0], three[:, 0, 10:])


def test_rope_index_refuses_image_tokens_that_are_not_the_images():
    vision = tiny_vl().vision
    tokens = with_images(text_rows(2, 10), [(0, 2, 4)])
    with pytest.raises(ValueError, match="4 image tokens .* take 6"):
        rope_index(tokens, None, [[1, 4, 6]], vision)
    split = with_images(text_rows(1, 10), [(0, 1, 2), (0, 5, 2)])  # one image in two runs
    with pytest.raises(ValueError, match="not one run"):
        rope_index(split, None, [[1, 4, 4]], vision)
    cut = with_images(text_rows(1, 10), [(0, 2, 4)])  # a document starts inside the image
    with pytest.raises(ValueError, match="one document"):
        rope_index(cut, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]), [[1, 4, 4]], vision)


def test_each_image_attends_only_to_itself_in_the_tower():
    model = build_model(tiny_vl(), "cpu", seed=0).eval()
    pixels, grid = images([1, 4, 4], [1, 6, 4], [1, 4, 4])
    with torch.no_grad():
        whole = model.visual(pixels, grid.tolist())
        changed = pixels.clone()
        changed[16:40] += 1.0  # the second image only
        other = model.visual(changed, grid.tolist())
        first = model.visual(pixels[:16], [[1, 4, 4]])
    assert torch.equal(whole[:4], other[:4]) and torch.equal(whole[10:], other[10:])
    assert not torch.allclose(whole[4:10], other[4:10])
    torch.testing.assert_close(whole[:4], first, rtol=1e-5, atol=1e-6)


def test_vision_rotary_turns_first_half_by_row_second_by_column():
    vision = VisionConfig(dim=32, n_heads=2, image_token_id=0)  # head 16: 4 row, 4 column freqs
    ctx = vision_context(vision, [[1, 2, 4]], "cpu")
    angle = torch.atan2(ctx.sin, ctx.cos)  # patches block-major: patch 2 is row 1, column 0
    torch.testing.assert_close(angle[2, :4], torch.tensor([1.0, 0.1, 0.01, 0.001]))
    assert torch.allclose(angle[2, 4:8], torch.zeros(4)) and torch.equal(
        ctx.cos[:, :8], ctx.cos[:, 8:]
    )
    assert [len(g) if g is not None else None for _, g in ctx.groups] == [None]


def test_the_kv_cache_with_an_image_gives_the_full_forward_logits():
    cfg = tiny_vl()
    model = build_model(cfg, "cpu", seed=0).eval()
    pixels, grid = images([1, 4, 8])
    tokens = with_images(text_rows(1, 16), [(0, 3, 8)])
    with torch.no_grad():
        full = model(tokens, pixels=pixels, image_grid=grid)
        cache = KVCache(cfg, 1, 16, "cpu", torch.float32)
        prefill = model(tokens[:, :12], cache=cache, pixels=pixels, image_grid=grid)
        assert cache.rope_delta.tolist() == [4 - 8]  # 8 image tokens advancing 4 positions
        steps = [model(tokens[:, i : i + 1], cache=cache) for i in range(12, 16)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # without the delta the decoding steps are elsewhere
        cache.length, cache.rope_delta = 12, None
        assert not torch.allclose(model(tokens[:, 12:13], cache=cache), full[:, 12:13], atol=1e-4)


def test_an_image_changes_its_own_and_later_logits_only():
    model = build_model(tiny_vl(), "cpu", seed=0).eval()
    pixels, grid = images([1, 4, 4], [1, 4, 4])
    tokens = with_images(text_rows(1, 20), [(0, 2, 4), (0, 10, 4)])
    changed = pixels.clone()
    changed[16:] *= -1.0  # the second image
    with torch.no_grad():
        a = model(tokens, pixels=pixels, image_grid=grid)
        b = model(tokens, pixels=changed, image_grid=grid)
    assert torch.equal(a[:, :10], b[:, :10]) and not torch.allclose(a[:, 10:], b[:, 10:])


def test_a_batch_without_images_still_runs_every_tower_unit():
    """Every rank of the engine must run the same units: a text-only micro-batch runs the tower
    on no patches, so every tower parameter gets a (zero) gradient, never None."""
    model = build_model(tiny_vl(), "cpu", seed=0)
    tokens = torch.tensor(text_rows(2, 8))
    loss, count = model(tokens, targets=tokens)
    loss.backward()
    for name, p in model.visual.named_parameters():
        assert p.grad is not None and not p.grad.any(), name
    with pytest.raises(ValueError, match="2 image tokens"):  # image tokens need their images
        model(with_images(text_rows(1, 8), [(0, 0, 2)]))


def test_packed_documents_with_images_equal_each_document_alone():
    model = build_model(tiny_vl(), "cpu", seed=0).eval()
    (pa, ga), (pb, gb) = images([1, 4, 4], seed=1), images([1, 4, 6], seed=2)
    doc_a = with_images(text_rows(1, 9, seed=3), [(0, 2, 4)])
    doc_b = with_images(text_rows(1, 11, seed=4), [(0, 3, 6)])
    packed = torch.cat([doc_a, doc_b], dim=1)
    positions = torch.tensor([list(range(9)) + list(range(11))])
    with torch.no_grad():
        both = model(packed, positions, pixels=torch.cat([pa, pb]), image_grid=torch.cat([ga, gb]))
        alone_a = model(doc_a, pixels=pa, image_grid=ga)
        alone_b = model(doc_b, pixels=pb, image_grid=gb)
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b], dim=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides,key,says",
    [
        (
            dict(mrope_section=[8, 12, 13]),
            "model.mrope_section",
            "adding up to head_size // 2 = 32",
        ),
        (dict(mrope_section=None), "model.mrope_section", "three positive integers"),
        (dict(moe_experts=4, moe_ffn_dim=64), "model.moe_experts", "0 with model.vision"),
        (dict(family="qwen2"), "model.family", "qwen2_vl with model.vision"),
        (dict(vision=None), "model.vision", "an image tower"),
    ],
)
def test_validate_refuses_what_a_vision_language_model_cannot_be(overrides, key, says):
    with pytest.raises(ConfigError, match=rf"{key}=.*{says}"):
        tiny_vl(**overrides)


def test_validate_refuses_a_bad_tower_and_mrope_without_one():
    bad_heads = dataclasses.replace(tiny_vl().vision, n_heads=32)  # heads of 2: not 4 x k
    with pytest.raises(ConfigError, match="model.vision.n_heads=32"):
        tiny_vl(vision=bad_heads)
    no_image = dataclasses.replace(tiny_vl().vision, image_token_id=None)
    with pytest.raises(ConfigError, match="model.vision.image_token_id"):
        tiny_vl(vision=no_image)
    with pytest.raises(ConfigError, match="model.mrope_section=.*null without model.vision"):
        model_config("tiny", mrope_section=[8, 12, 12])


def test_a_checkpoint_state_dict_rebuilds_the_tower_config():
    cfg = tiny_vl()
    again = type(cfg)(**dataclasses.asdict(cfg))
    assert again == cfg and isinstance(again.vision, VisionConfig)
