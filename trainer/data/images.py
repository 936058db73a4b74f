"""Qwen2-VL's image processor, in Pillow and numpy: an image -> patches and its grid.

    proc = ImageProcessing.from_dir("/models/Qwen2-VL-2B-Instruct")   # preprocessor_config.json
    pixels = proc.resized(PIL.Image.open(path))    # uint8 [H, W, 3]: what preparation stores
    patches, grid = proc.patches(pixels), proc.grid(pixels)   # float32 [n, 1176], (1, h, w)
    proc.tokens(grid)                              # <|image_pad|> copies: h * w // merge_size**2

It is transformers' Qwen2VLImageProcessor (its Pillow backend) step for step, so the patches
equal its `pixel_values` and the grid its `image_grid_thw`: convert to RGB (transparency
composited onto white), resize with Pillow (bicubic by default) to `smart_resize`'s size (sides
multiples of patch_size x merge_size, area within [min_pixels, max_pixels], the aspect ratio
kept as closely as that allows), rescale (x * 1/255 in float64, then float32), normalise
((x - mean) / std in float32) and patchify (merge_size x merge_size groups of patches in a row,
each patch repeated temporal_patch_size times, channel-major).

The split between `resized` and `patches` is where preparation stops: the resized uint8 image is
stored (3 bytes a pixel), and the loader turns it into float32 patches (4 x 2 x 3 bytes a pixel
once the temporal repeat is counted) when a micro-batch is made (benchmarks/images.py measures why).
"""

from __future__ import annotations

import functools
import io
import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:  # Pillow is imported where images are decoded: trainer.data imports this
    import PIL.Image  # module, and the GPU check's bare machine has no Pillow

from trainer import storage
from trainer.config import ConfigError, fail

from .template_files import beside

PREPROCESSOR_CONFIG = "preprocessor_config.json"
BICUBIC = 3
"""PIL.Image.Resampling.BICUBIC: Qwen2VLImageProcessor's default resample."""
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
"""image_processor_type values read as this processor (Qwen2-VL's and Qwen2.5-VL's)."""
MAX_ASPECT = 200
"""transformers refuses an image whose longer side is more than this many times the shorter."""


class ImageError(ValueError):
    """An image that cannot be processed (not decodable, too extreme an aspect ratio)."""


@dataclass(frozen=True)
class ImageProcessing:
    """The settings of a Qwen2-VL image processor (preprocessor_config.json), with the class's
    defaults; they go into the preparation's digest and manifest (DESIGN.md invariant 2)."""

    min_pixels: int = 56 * 56
    """Least area of a resized image (transformers: size.shortest_edge or min_pixels)."""
    max_pixels: int = 28 * 28 * 1280
    """Largest area of a resized image (size.longest_edge or max_pixels)."""
    patch_size: int = 14
    """Side of a vision patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch: an image is repeated this many times."""
    merge_size: int = 2
    """Patches merged into one language-model token per side: tokens = patches / merge_size**2."""
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    """Per-channel mean subtracted after rescaling."""
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    """Per-channel standard deviation divided by after the mean."""
    rescale_factor: float = 1 / 255
    """uint8 -> [0, 1]."""
    resample: int = BICUBIC
    """Pillow's resampling filter (3 = bicubic, transformers' default for Qwen2-VL)."""
    do_resize: bool = True
    """Resize to smart_resize's size (false: the image's sides must be multiples already)."""
    do_rescale: bool = True
    """Multiply by rescale_factor."""
    do_normalize: bool = True
    """Subtract image_mean, divide by image_std."""
    do_convert_rgb: bool = True
    """Convert to RGB (transparency onto white) before anything else."""
    origin: str = field(default="defaults", compare=False)
    """Where the settings were read (not part of their identity)."""

    @classmethod
    def from_config(cls, config: dict, origin: str) -> "ImageProcessing":
        """From a preprocessor_config.json's dict: min/max_pixels win over size, as in
        transformers; keys it does not use are ignored. ConfigError naming what is wrong."""
        kind = config.get("image_processor_type", "Qwen2VLImageProcessor")
        if kind not in PROCESSOR_TYPES:
            fail(f"{origin}: image_processor_type", kind, ", ".join(PROCESSOR_TYPES))
        size = config.get("size") or {}
        kw = {}
        for key in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if config.get(key) is not None:
                kw[key] = int(config[key])
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(key) is not None:
                kw[key] = bool(config[key])
        if config.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(config["rescale_factor"])
        for key in ("image_mean", "image_std"):
            if config.get(key) is not None:
                value = config[key]
                value = value if isinstance(value, list) else [value] * 3
                kw[key] = tuple(float(v) for v in value)
        low = config.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
        high = config.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
        if low is not None:
            kw["min_pixels"] = int(low)
        if high is not None:
            kw["max_pixels"] = int(high)
        out = cls(**kw, origin=origin)
        out.validate()
        return out

    @classmethod
    def from_dir(cls, folder: str) -> "ImageProcessing":
        """The preprocessor_config.json in a model folder (path or URI); ConfigError if absent."""
        found = cls.beside(f"{folder.rstrip('/')}/{PREPROCESSOR_CONFIG}")
        if found is None:
            fail("image processor", folder, f"a folder holding a {PREPROCESSOR_CONFIG}")
        return found

    @classmethod
    def beside(cls, tokenizer: str) -> Optional["ImageProcessing"]:
        """The preprocessor_config.json in the folder of `tokenizer` (data.tokenizer: the model's
        tokenizer.json); None when there is none (a text model)."""
        if tokenizer == "byte":
            return None
        where = beside(tokenizer, PREPROCESSOR_CONFIG)
        try:
            data = storage.read_bytes(storage.resolve(where))
        except (FileNotFoundError, storage.StorageError, OSError):
            return None
        try:
            config = json.loads(data)
        except ValueError as e:
            raise ConfigError(
                f"invalid config: {where} is not JSON ({e}); valid: a {PREPROCESSOR_CONFIG} as "
                "Hugging Face writes it, or none"
            ) from None
        if not isinstance(config, dict):
            fail(where, type(config).__name__, "a JSON object")
        return cls.from_config(config, where)

    def validate(self) -> None:
        for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            if getattr(self, key) <= 0:
                fail(f"{self.origin}: {key}", getattr(self, key), "a positive integer")
        if self.min_pixels > self.max_pixels:
            fail(f"{self.origin}: min_pixels", self.min_pixels, f"<= max_pixels {self.max_pixels}")
        for key in ("image_mean", "image_std"):
            if len(getattr(self, key)) != 3:
                fail(f"{self.origin}: {key}", list(getattr(self, key)), "three numbers (RGB)")

    def to_json(self) -> dict:
        """The settings as the digest and the manifest hold them (origin left out)."""
        out = asdict(self)
        out.pop("origin")
        out["image_mean"], out["image_std"] = list(self.image_mean), list(self.image_std)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "ImageProcessing":
        mean, std = tuple(d["image_mean"]), tuple(d["image_std"])
        return cls(**{**d, "image_mean": mean, "image_std": std})

    @property
    def patch_dim(self) -> int:
        """Values per patch row: 3 x temporal_patch_size x patch_size**2 (1176 for Qwen2-VL)."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    # ------------------------------------------------------------------------- the steps

    def size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' smart_resize: (height, width) after resizing."""
        return smart_resize(
            height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels
        )

    def decode(self, data: bytes) -> PIL.Image.Image:
        """An encoded image (any format Pillow reads), fully loaded; ImageError if it is not."""
        import PIL.Image  # noqa: PLC0415 -- Pillow only where images are (see the imports)

        try:
            image = PIL.Image.open(io.BytesIO(data))
            image.load()
        except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
            raise ImageError(f"not a readable image ({type(e).__name__}: {e})") from None
        return image

    def resized(self, image: PIL.Image.Image) -> np.ndarray:
        """uint8 [H, W, 3]: converted to RGB and resized, as transformers does before rescaling."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        if image.mode != "RGB":
            raise ImageError(f"mode {image.mode} (not RGB) with do_convert_rgb=false")
        if self.do_resize:
            width, height = image.size
            if max(height, width) / min(height, width) > MAX_ASPECT:
                raise ImageError(
                    f"{width}x{height}: an aspect ratio above {MAX_ASPECT}, which the processor "
                    "refuses"
                )
            h, w = self.size(height, width)
            image = image.resize((w, h), resample=self.resample)
        out = np.asarray(image, dtype=np.uint8)
        factor = self.patch_size * self.merge_size
        if out.shape[0] % factor or out.shape[1] % factor:
            raise ImageError(f"{out.shape[1]}x{out.shape[0]}: sides not multiples of {factor}")
        return out

    def grid(self, pixels: np.ndarray) -> tuple[int, int, int]:
        """(t, h, w) in patches of a resized image: image_grid_thw."""
        return 1, pixels.shape[0] // self.patch_size, pixels.shape[1] // self.patch_size

    def tokens(self, grid) -> int:
        """<|image_pad|> tokens of an image of this grid (processing_qwen2_vl's count)."""
        t, h, w = (int(v) for v in grid)
        return t * h * w // self.merge_size**2

    @functools.cached_property
    def values(self) -> np.ndarray:
        """float32 [256, 3]: each uint8 value of each channel rescaled and normalised as
        transformers does it per pixel (x * factor in float64, then float32; (x - mean) / std
        in float32). Elementwise IEEE arithmetic, so a lookup in it is bit for bit the same, at
        a fraction of the cost of doing it for every pixel."""
        x = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, np.float32)
            std = np.asarray(self.image_std, np.float32)
            x = (x - mean) / std
        return x

    def patches(self, pixels: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """float32 [h * w, patch_dim] of a resized uint8 [H, W, 3] image: pixel_values. `out`:
        a C-contiguous float32 array of that shape to fill (a micro-batch's rows, no copy)."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = pixels.shape[0] // p, pixels.shape[1] // p
        x = pixels.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
        x = np.ascontiguousarray(x.transpose(1, 4, 2, 5, 0, 3, 6))  # (gh/m, gw/m, m, m, C, p, p)
        if out is None:
            out = np.empty((gh * gw, self.patch_dim), np.float32)
        view = out.reshape(*x.shape[:5], t, p, p)
        for c in range(3):  # rescaled and normalised by lookup, into the first frame
            np.take(self.values[:, c], x[:, :, :, :, c], out=view[:, :, :, :, c, 0])
        view[:, :, :, :, :, 1:] = view[:, :, :, :, :, :1]  # the image repeated over time
        return out

    def process(self, image: PIL.Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(patches, grid) of an image: the whole processor at once (what tests compare)."""
        pixels = self.resized(image)
        return self.patches(pixels), self.grid(pixels)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Sides that are multiples of `factor`, an area within [min_pixels, max_pixels], the aspect
    ratio kept as closely as that allows (transformers' function, line for line)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB, transparency composited onto white (transformers' convert_to_rgb)."""
    import PIL.Image  # noqa: PLC0415 -- Pillow only where images are (see the imports)

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")
