"""trainer/data/images.py: Qwen2-VL's image processor in Pillow and numpy gives transformers'
pixel_values and image_grid_thw (its Pillow backend, the reference) to fp32 1e-6 on images of
every shape the resize rule has a branch for, and reads preprocessor_config.json as
transformers does."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import PIL.Image
import pytest
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from trainer.config import ConfigError
from trainer.data.images import ImageError, ImageProcessing, smart_resize

SMALL = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
"""A budget that small images cross both ways (64 merged tokens at most)."""


def photo(height: int, width: int, mode: str = "RGB", seed: int = 0) -> PIL.Image.Image:
    """Smooth gradients and noise (resampling filters differ most on edges and noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) % 256], -1)
    noise = rng.integers(-40, 40, (height, width, 3))
    rgb = np.clip(base + noise, 0, 255).astype(np.uint8)
    image = PIL.Image.fromarray(rgb)
    if mode == "RGBA":
        alpha = rng.integers(0, 256, (height, width), dtype=np.uint8)
        image = PIL.Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    elif mode != "RGB":
        image = image.convert(mode)
    return image


CASES = {
    "tiny, upscaled to min_pixels": (9, 13, "RGB"),
    "wide": (40, 300, "RGB"),
    "tall, grayscale": (300, 40, "L"),
    "transparent, onto white": (70, 90, "RGBA"),
    "palette": (57, 85, "P"),
    "above max_pixels": (600, 800, "RGB"),
    "sides already multiples of 28": (112, 224, "RGB"),
}


@pytest.mark.parametrize("case", CASES)
def test_patches_and_grid_equal_transformers_qwen2vl_processor(case):
    height, width, mode = CASES[case]
    image = photo(height, width, mode)
    ref = Qwen2VLImageProcessorPil(**SMALL)(images=[image], return_tensors="np")
    ours = ImageProcessing(**SMALL)
    patches, grid = ours.process(image)
    assert grid == tuple(ref["image_grid_thw"][0]) and patches.dtype == np.float32
    np.testing.assert_allclose(patches, ref["pixel_values"], rtol=0, atol=1e-6)
    assert patches.shape == (grid[1] * grid[2], 1176)
    assert ours.tokens(grid) == grid[1] * grid[2] // 4
    t, h, w = grid
    area = h * w * 14 * 14
    if case.startswith("tiny"):
        assert area >= SMALL["min_pixels"] and area > height * width
    if case == "above max_pixels":
        assert area <= SMALL["max_pixels"] < height * width


def test_a_different_filter_or_normalisation_is_caught_at_this_tolerance():
    """The 1e-6 comparison can fail: bilinear instead of bicubic, or another mean, is far off."""
    image = photo(70, 90)
    ref = Qwen2VLImageProcessorPil(**SMALL)(images=[image], return_tensors="np")["pixel_values"]
    bilinear = ImageProcessing(**SMALL, resample=int(PIL.Image.Resampling.BILINEAR))
    assert np.abs(bilinear.process(image)[0] - ref).max() > 1e-2
    mean = ImageProcessing(**SMALL, image_mean=(0.5, 0.5, 0.5))
    assert np.abs(mean.process(image)[0] - ref).max() > 1e-2


def test_smart_resize_equals_transformers_on_random_sizes():
    rng = random.Random(0)
    for _ in range(2000):
        h, w = rng.randint(1, 3000), rng.randint(1, 3000)
        if max(h, w) / min(h, w) > 200:
            continue
        low = rng.choice([56 * 56, 128 * 28 * 28])
        high = rng.choice([28 * 28 * 256, 28 * 28 * 1280, 12845056])
        assert smart_resize(h, w, 28, low, high) == hf_smart_resize(h, w, 28, low, high), (h, w)


def write_config(folder, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return folder


QWEN2_VL_CONFIG = {  # Qwen2-VL-7B-Instruct's preprocessor_config.json, max_pixels made small
    "min_pixels": 3136,
    "max_pixels": 28 * 28 * 100,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}


@pytest.mark.parametrize(
    "config",
    [
        QWEN2_VL_CONFIG,
        # transformers 5 saves the budget as size; a resample and mean of its own
        {
            "size": {"shortest_edge": 28 * 28 * 8, "longest_edge": 28 * 28 * 40},
            "resample": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "image_processor_type": "Qwen2VLImageProcessor",
        },
    ],
)
def test_settings_are_read_from_preprocessor_config_as_transformers_reads_them(tmp_path, config):
    folder = write_config(tmp_path / "model", config)
    ours = ImageProcessing.from_dir(str(folder))
    ref = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    assert type(ref).__name__ == "Qwen2VLImageProcessorPil"
    assert (ours.min_pixels, ours.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge)
    for image in (photo(300, 500), photo(20, 30, seed=1), photo(400, 90, "L", seed=2)):
        patches, grid = ours.process(image)
        want = ref(images=[image], return_tensors="np")
        assert grid == tuple(want["image_grid_thw"][0])
        np.testing.assert_allclose(patches, want["pixel_values"], rtol=0, atol=1e-6)
    # beside a tokenizer.json (how preparation finds it), and absent for a text model
    assert ImageProcessing.beside(str(folder / "tokenizer.json")) == ours
    assert ImageProcessing.beside(str(tmp_path / "tokenizer.json")) is None
    assert ImageProcessing.from_json(ours.to_json()) == ours


def test_bad_settings_and_bad_images_are_refused_with_what_is_valid(tmp_path):
    bad = write_config(tmp_path / "a", {**QWEN2_VL_CONFIG, "min_pixels": 10**7})
    with pytest.raises(ConfigError, match=r"min_pixels=10000000; valid: <= max_pixels 78400"):
        ImageProcessing.from_dir(str(bad))
    other = write_config(tmp_path / "b", {"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(ConfigError, match=r"image_processor_type='CLIPImageProcessor'; valid"):
        ImageProcessing.from_dir(str(other))
    with pytest.raises(ConfigError, match=r"valid: a folder holding a preprocessor_config"):
        ImageProcessing.from_dir(str(tmp_path / "none"))
    proc = ImageProcessing()
    with pytest.raises(ImageError, match="not a readable image"):
        proc.decode(b"\x89PNG not really")
    with pytest.raises(ImageError, match="aspect ratio above 200"):
        proc.resized(photo(2, 500))
    buffer = io.BytesIO()
    photo(30, 40).save(buffer, "PNG")
    assert proc.resized(proc.decode(buffer.getvalue())).shape == (56, 84, 3)  # 28 x 56 < min
