"""Qwen2-VL against transformers itself: a tiny random Qwen2VLForConditionalGeneration (fp32,
two decoder layers, a two-block tower), imported with `python -m trainer.hf import` and through
HFWeights (model=hf), gives transformers' logits with three images of three sizes between
text, with packed documents the logits transformers gives each document alone, and its greedy
generation with images; exported, transformers loads it bitwise with config.json's vision and
rotary fields as they were and the image processor's file beside it. Both config.json layouts
and both tensor layouts are read; what the model cannot be is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.hf.tiny import (
    IMAGE,
    VL_GRIDS,
    VL_ROWS,
    assert_logits_equal,
    hf_vl_model,
    ours_from_hf,
    transformers_vl_logits,
    vl_batch,
)
from trainer.checkpoint import CheckpointReader
from trainer.config import ConfigError, ModelConfig
from trainer.generate import generate_ids
from trainer.hf import config_from_hf, config_to_hf, read_hf_config
from trainer.hf.__main__ import main as hf_main
from trainer.model import build_model, rope_index

transformers = pytest.importorskip("transformers")
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2}
KINDS = {"untied": dict(seed=2), "tied": dict(seed=3, tied=True)}


@pytest.fixture(scope="module")
def models():
    """The transformers models, built once."""
    return {kind: hf_vl_model(**kw) for kind, kw in KINDS.items()}


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    """Each saved by save_pretrained, with an image processor's preprocessor_config.json."""
    out = {}
    for kind, model in models.items():
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
        out[kind] = path
    return out


@pytest.fixture(scope="module")
def imported(saved, tmp_path_factory):
    """Each imported with the command: kind -> its step-0 checkpoint."""
    out = {}
    for kind, src in saved.items():
        dest = tmp_path_factory.mktemp(f"ckpt_{kind}") / "checkpoints"
        assert hf_main(["import", str(src), str(dest)]) == 0
        (step,) = sorted(dest.glob("step_*"))
        out[kind] = str(step)
    return out


def from_checkpoint(path: str):
    reader = CheckpointReader(path)
    model = build_model(ModelConfig(**reader.state["model_config"]), "cpu")
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            p.copy_(reader.read_full(f"model/{fqn}").view(p.shape))
    return model.eval()


def ours_logits(model, tokens, pixels, image_grid, positions=None):
    with torch.no_grad():
        return model(tokens, positions, pixels=pixels, image_grid=image_grid)


@pytest.mark.parametrize("kind", list(KINDS))
def test_imported_model_gives_transformers_logits_with_images(models, saved, imported, kind):
    batch = vl_batch()
    theirs = transformers_vl_logits(models[kind], **batch)
    cfg, ours = ours_from_hf(saved[kind])  # model=hf: through HFWeights
    assert cfg.family == "qwen2_vl" and cfg.tie_embeddings == (kind == "tied")
    assert cfg.mrope_section == [2, 3, 3] and cfg.vision.image_token_id == IMAGE
    assert_logits_equal(ours_logits(ours, **batch), theirs)
    assert_logits_equal(ours_logits(from_checkpoint(imported[kind]), **batch), theirs)


def test_one_dimensional_positions_would_fail_the_logits_test(models, saved, monkeypatch):
    """The tolerance above sees the 3-D positions: with plain ones the logits are far off."""
    batch = vl_batch()
    theirs = transformers_vl_logits(models["untied"], **batch)
    _, ours = ours_from_hf(saved["untied"])

    def plain(tokens, positions, grid, vision):
        return torch.arange(tokens.shape[1]).expand(3, *tokens.shape)

    monkeypatch.setattr("trainer.model.multimodal.rope_index", plain)
    assert (ours_logits(ours, **batch) - theirs).abs().max() > 1e-3 * theirs.abs().max()


def test_rope_index_equals_transformers_get_rope_index(models):
    batch = vl_batch()
    tokens, grid = batch["tokens"], batch["image_grid"]
    want, deltas = models["untied"].model.get_rope_index(
        tokens, (tokens == IMAGE).int(), image_grid_thw=grid
    )
    cfg = config_from_hf(models["untied"].config.to_dict())
    got = rope_index(tokens, None, grid.tolist(), cfg.vision)
    assert torch.equal(got, want)
    assert (got.amax(dim=(0, 2)) + 1 - tokens.shape[1]).tolist() == deltas.view(-1).tolist()


def test_packed_documents_equal_transformers_on_each_document(models, saved):
    """The two rows of the batch packed into one, positions restarting: each document's logits
    are those transformers gives that document alone."""
    batch = vl_batch()
    model = models["untied"]
    row0 = transformers_vl_logits(
        model, batch["tokens"][:1], batch["pixels"][:40], batch["image_grid"][:2]
    )
    row1 = transformers_vl_logits(
        model, batch["tokens"][1:], batch["pixels"][40:], batch["image_grid"][2:]
    )
    packed = batch["tokens"].reshape(1, -1)
    positions = torch.arange(len(VL_ROWS[0])).repeat(2)[None]
    _, ours = ours_from_hf(saved["untied"])
    got = ours_logits(ours, packed, batch["pixels"], batch["image_grid"], positions)
    assert_logits_equal(got, torch.cat([row0, row1], dim=1))


def test_greedy_generation_with_images_equals_transformers_generate(models, saved):
    batch = vl_batch()
    prompt, pixels, grid = batch["tokens"][:1], batch["pixels"][:40], batch["image_grid"][:2]
    out = models["untied"].generate(
        input_ids=prompt,
        pixel_values=pixels,
        image_grid_thw=grid,
        mm_token_type_ids=(prompt == IMAGE).int(),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
    )
    theirs = out[0, prompt.shape[1] :].tolist()
    _, ours = ours_from_hf(saved["untied"])
    args = dict(stop_ids=[2], pixels=pixels, image_grid=grid)
    got = generate_ids(ours, prompt[0].tolist(), 8, **args)
    assert got == theirs and len(set(got)) >= 4  # not one token repeated: positions matter
    assert generate_ids(ours, prompt[0].tolist(), 8, use_cache=False, **args) == theirs


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_loads_in_transformers_bitwise_with_its_config(models, saved, imported, kind):
    out = saved[kind].parent / f"export_{kind}"
    assert hf_main(["export", imported[kind], str(out)]) == 0
    original = models[kind]
    loaded = transformers.Qwen2VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    theirs, ours = original.state_dict(), loaded.state_dict()
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name
    source = json.loads((saved[kind] / "config.json").read_text())
    written = json.loads((out / "config.json").read_text())
    assert written["vision_config"] == source["vision_config"]
    assert written["text_config"]["rope_parameters"] == source["text_config"]["rope_parameters"]
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert written[key] == source[key]
    assert written["tie_word_embeddings"] == (kind == "tied")
    differ = diff(original.config.to_dict(), loaded.config.to_dict())
    # What differs is the dtype transformers was given and an unused sliding-window field.
    assert differ <= {"_name_or_path", "text_config.dtype", "vision_config.dtype"} | {
        "text_config.max_window_layers"
    }
    assert (out / "preprocessor_config.json").read_text() == json.dumps(PROCESSOR)


def diff(a: dict, b: dict, prefix: str = "") -> set[str]:
    """The keys (dotted into nested dicts) whose values differ."""
    out = set()
    for key in set(a) | set(b):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out |= diff(x, y, f"{prefix}{key}.")
        elif x != y:
            out.add(prefix + key)
    return out


def test_transformers_in_memory_tensor_names_are_read_too(models, saved, tmp_path):
    """A folder holding transformers 5's own names (model.language_model.*, model.visual.*)."""
    model = models["untied"]
    shutil.copy(saved["untied"] / "config.json", tmp_path / "config.json")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.startswith("model.language_model.") for k in tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _, ours = ours_from_hf(tmp_path)
    batch = vl_batch()
    assert_logits_equal(ours_logits(ours, **batch), transformers_vl_logits(model, **batch))


def flat_config(nested: dict) -> dict:
    """transformers 4's layout of a config.json (the published Qwen2-VL files')."""
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    vision = dict(nested["vision_config"], in_chans=nested["vision_config"]["in_channels"])
    del vision["in_channels"], vision["rope_parameters"]
    flat = {k: v for k, v in nested.items() if k not in ("text_config", "vision_config")}
    section = rope["mrope_section"]
    rope_scaling = {"type": "mrope", "mrope_section": section}
    return {**flat, **text, "rope_theta": rope["rope_theta"], "rope_scaling": rope_scaling,
            "vision_config": vision, "model_type": "qwen2_vl"}  # fmt: skip


def test_transformers_4_flat_config_reads_as_the_nested_one(saved):
    nested = read_hf_config(str(saved["untied"]))
    flat = flat_config(nested)
    assert "text_config" not in flat and flat["rope_scaling"]["type"] == "mrope"
    assert config_from_hf(flat) == config_from_hf(nested)
    theirs = transformers.Qwen2VLConfig(**flat)  # transformers reads it as the same model
    assert theirs.text_config.rope_parameters["mrope_section"] == [2, 3, 3]


@pytest.mark.parametrize(
    "change,says",
    [
        (lambda c: c["vision_config"].update(hidden_act="gelu"), "vision_config: hidden_act"),
        (lambda c: c["vision_config"].update(hidden_size=32), "vision_config: hidden_size"),
        (
            lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"),
            "rope_parameters.rope_type='yarn'",
        ),
        (
            lambda c: c["text_config"].update(use_sliding_window=True, sliding_window=8),
            "use_sliding_window=True",
        ),
        (
            lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 3, 4]),
            "model.mrope_section=",
        ),
    ],
)
def test_what_the_model_cannot_be_is_refused_by_name(saved, change, says):
    config = read_hf_config(str(saved["untied"]))
    change(config)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf(config)


def test_export_of_a_model_transformers_cannot_hold_is_refused(imported, tmp_path):
    state = CheckpointReader(imported["untied"]).state["model_config"]
    cfg = ModelConfig(**state)
    cfg.vision.ffn_dim = cfg.vision.dim * 2 + 1
    with pytest.raises(ConfigError, match="model.vision.ffn_dim=65.*mlp_ratio"):
        config_to_hf(cfg, torch.float32)


def test_images_are_read_where_the_grid_says(saved):
    """The grid's order is the runs' order: swapping two images' grids is refused."""
    _, ours = ours_from_hf(saved["untied"])
    batch = vl_batch()
    swapped = batch["image_grid"][[1, 0, 2]]
    with pytest.raises(ValueError, match="not one run"):
        ours_logits(ours, batch["tokens"], batch["pixels"], swapped)
    assert VL_GRIDS[0] != VL_GRIDS[1]
