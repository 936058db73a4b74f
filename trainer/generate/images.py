"""Images in a --chat prompt: read, processed as the model's image processor does, and each
image's placeholder expanded to the tokens its patches take.

    python -m trainer.generate /models/Qwen2-VL-2B-Instruct --chat "What colour?" --image a.png

    images = prompt_images(["a.png"], source, text)     # refuses a text model, a bad file
    ids = images.expand(text.chat_ids(question, images=images.count))
    generate_ids(model, ids, 32, stops, **images.inputs)

The image processor is the preprocessor_config.json beside the tokenizer the command resolved
(a trained checkpoint's run tokenizer, an imported checkpoint's folder, --tokenizer's), else the
Hugging Face folder's own: the file preparation reads beside data.tokenizer, so an image is
processed at generation as it was in training. The chat template renders one <|image_pad|> per
{"type": "image"} part; each becomes grid.prod() // merge_size**2 copies (as transformers'
Qwen2VLProcessor does), and the images' pixels and grids go with the prompt into the prefill.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from trainer import storage
from trainer.config import ConfigError, ModelConfig, fail
from trainer.data.images import PREPROCESSOR_CONFIG, ImageError, ImageProcessing
from trainer.data.template_files import beside
from trainer.data.tokenizer import BYTE
from trainer.generate.text import TOKENIZER_JSON, Text
from trainer.generate.weights import Source

VALID_IMAGE = "an image file Pillow decodes (PNG, JPEG, WebP, ...): a path or a pyarrow.fs URI"


@dataclass
class PromptImages:
    """The images of one prompt, as the vision-language model's forward takes them."""

    pixels: torch.Tensor
    """float32 [N, patch_dim]: every image's patches in turn (pixel_values)."""
    grid: torch.Tensor
    """int64 [n, 3]: each image's (t, h, w) in patches (image_grid_thw)."""
    tokens: list[int]
    """The image tokens each image takes in the prompt."""
    image_token_id: int
    """The model's image token (vision.image_token_id)."""

    @property
    def count(self) -> int:
        return len(self.tokens)

    @property
    def inputs(self) -> dict:
        """generate_ids' keywords: pixels and image_grid."""
        return {"pixels": self.pixels, "image_grid": self.grid}

    def expand(self, ids: list[int]) -> list[int]:
        """`ids` with the k-th image token repeated for the k-th image; a ConfigError unless
        the template rendered exactly one per image."""
        pads = [k for k, i in enumerate(ids) if i == self.image_token_id]
        if len(pads) != self.count:
            raise ConfigError(
                f"invalid config: --image given {self.count} time(s), and the chat template "
                f"renders {len(pads)} image token(s) (id {self.image_token_id}, the model's "
                "vision.image_token_id) for them; valid: the model's own chat template and "
                "tokenizer (Qwen2-VL's: one <|image_pad|> per image part), and no "
                "<|image_pad|> written in --chat's text"
            )
        out, start = [], 0
        for at, n in zip(pads, self.tokens):
            out += ids[start:at] + [self.image_token_id] * n
            start = at + 1
        return out + ids[start:]


def prompt_images(paths: list[str], source: Source, text: Text) -> PromptImages:
    """The images at `paths` (--image, in order), processed for the model of `source`; a
    ConfigError naming the value and what is valid for a text model, a model without an image
    processor, a missing or undecodable file."""
    cfg = source.cfg
    if cfg.vision is None or cfg.vision.image_token_id is None:
        fail(
            "--image",
            paths[0],
            f"only with a vision-language model (Qwen2-VL); PATH={source.path!r} is a text "
            f"model ({cfg.name}: no vision tower in its config)",
        )
    processing = image_processing(source, text)
    check_matches(processing, cfg)
    patches, grids = [], []
    for path in paths:
        pixels = resized(path, processing)
        patches.append(processing.patches(pixels))
        grids.append(processing.grid(pixels))
    return PromptImages(
        torch.from_numpy(np.concatenate(patches)),
        torch.tensor(grids, dtype=torch.int64),
        [processing.tokens(g) for g in grids],
        cfg.vision.image_token_id,
    )


def image_processing(source: Source, text: Text) -> ImageProcessing:
    """The preprocessor_config.json beside the resolved tokenizer, else in the Hugging Face
    folder; a ConfigError saying where it looked when neither has one."""
    tokenizers = [text.tokenizer] if text.tokenizer and text.tokenizer != BYTE else []
    if source.kind == "hf":
        tokenizers.append(str(storage.resolve(source.path).child(TOKENIZER_JSON)))
    for tokenizer in tokenizers:
        found = ImageProcessing.beside(tokenizer)
        if found is not None:
            return found
    looked = ", ".join(dict.fromkeys(beside(t, PREPROCESSOR_CONFIG) for t in tokenizers))
    raise ConfigError(
        f"invalid config: --image needs the model's image processor, and PATH={source.path!r} "
        f"has no {PREPROCESSOR_CONFIG} (looked for: {looked or 'no tokenizer is named'}); "
        f"valid: a vision-language model folder holding its {PREPROCESSOR_CONFIG} (a checkpoint: "
        "beside its run's tokenizer.json), or --tokenizer PATH with one beside it"
    )


def check_matches(processing: ImageProcessing, cfg: ModelConfig) -> None:
    """The processor cuts patches the tower was built for (else the forward fails obscurely)."""
    vision = cfg.vision
    for ours, theirs in (
        ("patch_size", "patch_size"),
        ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "spatial_merge_size"),
    ):
        if getattr(processing, ours) != getattr(vision, theirs):
            fail(
                f"{processing.origin}: {ours}",
                getattr(processing, ours),
                f"the model's vision.{theirs}={getattr(vision, theirs)} (the processor of "
                "the same model)",
            )


def resized(path: str, processing: ImageProcessing) -> np.ndarray:
    """The image at `path`, decoded and resized (uint8 [H, W, 3]); a ConfigError naming it when
    it is missing, not an image, or of an aspect ratio the processor refuses."""
    try:
        data = storage.read_bytes(storage.resolve(path))
    except FileNotFoundError:
        fail("--image", path, f"{VALID_IMAGE}; there is no such file")
    except (storage.StorageError, OSError, ValueError) as e:
        fail("--image", path, f"{VALID_IMAGE}; it cannot be read ({e})")
    try:
        return processing.resized(processing.decode(data))
    except ImageError as e:  # Pillow names the BytesIO it was handed: no help to anyone
        said = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e))
        fail("--image", path, f"{VALID_IMAGE}; this one: {said}")
