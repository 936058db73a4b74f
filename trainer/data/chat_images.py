"""Images in chat records, at preparation: found in the messages, read, decoded and resized,
kept in a local spill file until their windows are written, and the checks that refuse a record.

    vision = Vision.of(settings, tokenizer)              # per work unit
    refs = image_refs(messages, record.get("images"), where)     # in the order they render
    images = vision.load(refs, where)                    # [StoredImage], resized and spilled
    vision.check(ids, images, where)                     # one <|image_pad|> per image
    enc = vision.expand(enc)                             # each pad -> grid.prod() // merge**2

A record's images are the parts of its messages in the Hugging Face format: {"type": "image",
"image": X} where X is a path (relative to the record's file), a pyarrow.fs URI, a data: URI,
bytes (a Parquet binary field) or {"bytes": ..., "path": ...} (a `datasets` Image); a part
without X takes the next image of the record's "images" column (the layout TRL's datasets use).
A missing file, bytes Pillow cannot decode, or a count that does not match (image parts vs the
"images" column, or images vs the placeholders the template renders) refuses the preparation
with a ConfigError naming the file and the record: an image dataset with holes in it is a
mistake to fix, not a record to skip quietly.

Expansion is done on the ids, not the text: `<|image_pad|>` is a special token, so the tokens
around it do not depend on how many copies follow, and one pad id repeated N times is what
transformers' processor gets by tokenizing N copies (Qwen2VLProcessor.replace_image_token).
"""

from __future__ import annotations

import base64
import os
import tempfile
from dataclasses import dataclass
from typing import NoReturn, Optional

import numpy as np

from trainer import storage
from trainer.config import ConfigError

from .chat import Encoded
from .images import PREPROCESSOR_CONFIG, ImageError, ImageProcessing
from .sources import InputFile
from .template_files import beside

IMAGES_COLUMN = "images"
"""A record's images when its image parts do not hold them (TRL's vision datasets)."""
IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
IMAGE_TOKENS = (IMAGE_PAD, VISION_START, VISION_END)
"""Qwen2-VL's image tokens: never loss tokens."""
VALID_REF = (
    "a path (relative to the record's file), a pyarrow.fs URI, a data: URI, the image's bytes, "
    'or {"bytes": ..., "path": ...}'
)


def is_image_part(part: dict) -> bool:
    """The test Qwen2-VL's chat template makes of a content part."""
    return part.get("type") == "image" or "image" in part or "image_url" in part


def is_video_part(part: dict) -> bool:
    """The test Qwen2-VL's chat template makes of a video part."""
    return part.get("type") == "video" or "video" in part


@dataclass(frozen=True)
class Where:
    """A record, as a refusal names it."""

    file: InputFile
    record: str
    """'record 3 (line 5)' (JSONL) or 'record 3' (Parquet)."""

    def refuse(self, what: str, valid: str) -> NoReturn:
        raise ConfigError(f"invalid data: {self.file.uri}, {self.record}: {what}; valid: {valid}")


def image_refs(messages: list[dict], column, where: Where) -> list:
    """The images of a record's messages, in the order the template renders their parts."""
    every = [p for m in messages if isinstance(m.get("content"), list) for p in m["content"]]
    if any(isinstance(p, dict) and is_video_part(p) for p in every):
        where.refuse(
            "a video part (videos are not supported yet: the template would render a "
            "<|video_pad|> with no frames behind it)",
            "text and image parts",
        )
    parts = [p for p in every if isinstance(p, dict) and is_image_part(p)]
    column = list(column) if isinstance(column, (list, tuple)) else []
    refs, taken = [], 0
    for p in parts:
        ref = p.get("image", p.get("image_url"))
        if isinstance(ref, dict) and isinstance(ref.get("url"), str):
            ref = ref["url"]  # the OpenAI form {"image_url": {"url": ...}}
        if ref is None:
            if taken == len(column):
                where.refuse(
                    f"{len(parts)} image parts and {len(column)} images in its "
                    f"{IMAGES_COLUMN!r} column",
                    "one image per image part (in the part, or in the column, in order)",
                )
            ref, taken = column[taken], taken + 1
        refs.append(ref)
    if taken != len(column):
        where.refuse(
            f"{len(column)} images in its {IMAGES_COLUMN!r} column and {taken} image parts "
            "without an image of their own",
            "one image part per image of the column",
        )
    return refs


@dataclass(frozen=True)
class StoredImage:
    """A resized image in the spill file: uint8 [height, width, 3] at `offset`."""

    offset: int
    height: int
    width: int
    grid: tuple[int, int, int]
    """(t, h, w) in patches: image_grid_thw."""

    @property
    def nbytes(self) -> int:
        return self.height * self.width * 3


class Spill:
    """A local temporary file holding a unit's resized images until its windows are written
    (a unit's images would not fit in memory; the file is gone when closed)."""

    def __init__(self):
        self._file = None
        self.size = 0

    def add(self, pixels: np.ndarray) -> int:
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="efsdp-images-", buffering=0)
        offset, data = self.size, pixels.tobytes()
        self._file.write(data)
        self.size += len(data)
        return offset

    def read(self, image: StoredImage) -> np.ndarray:
        data = os.pread(self._file.fileno(), image.nbytes, image.offset)
        return np.frombuffer(data, np.uint8)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Vision:
    """A work unit's image handling: the processor (None without a preprocessor_config.json
    beside the tokenizer), the image token ids, the spill file."""

    def __init__(self, processing: Optional[ImageProcessing], token_ids: dict, tokenizer: str):
        self.processing, self.token_ids, self.tokenizer = processing, token_ids, tokenizer
        self.image_ids = np.array([i for i in token_ids.values() if i is not None], np.int64)
        self.spill = Spill()

    @classmethod
    def of(cls, settings: dict, tok) -> "Vision":
        """From a unit's settings (their "images": the processor's, when the plan found one)."""
        got = settings.get("images")
        processing = ImageProcessing.from_json(got) if got else None
        ids = {t: tok.model.token_to_id(t) for t in IMAGE_TOKENS}
        return cls(processing, ids, tok.name)

    def load(self, refs: list, where: Where) -> list[StoredImage]:
        """Each image read, decoded, resized and spilled; refusals name the record and file."""
        if not refs:
            return []
        self._require(len(refs), where)
        out = []
        for k, ref in enumerate(refs):
            data, name = self._read(ref, where, f"image {k + 1} of {len(refs)}")
            try:
                pixels = self.processing.resized(self.processing.decode(data))
            except ImageError as e:
                where.refuse(f"image {k + 1} of {len(refs)} ({name}): {e}", "a PNG, JPEG, ...")
            h, w = pixels.shape[:2]
            offset = self.spill.add(pixels)
            out.append(StoredImage(offset, h, w, self.processing.grid(pixels)))
        return out

    def _require(self, n: int, where: Where) -> None:
        if self.processing is None:
            where.refuse(
                f"{n} image(s), and there is no {PREPROCESSOR_CONFIG} beside data.tokenizer "
                f"({beside(self.tokenizer, PREPROCESSOR_CONFIG)})",
                "the tokenizer.json of a vision-language model whose folder holds its "
                f"{PREPROCESSOR_CONFIG} (Qwen2-VL's)",
            )
        missing = [t for t, i in self.token_ids.items() if i is None]
        if missing:
            where.refuse(
                f"{n} image(s), and data.tokenizer={self.tokenizer!r} has no "
                f"{', '.join(missing)} token",
                "the tokenizer of a vision-language model (Qwen2-VL's has them)",
            )

    def _read(self, ref, where: Where, which: str) -> tuple[bytes, str]:
        """(encoded bytes, how to name the image) of an image reference."""
        if isinstance(ref, dict):
            ref = ref.get("bytes") if ref.get("bytes") is not None else ref.get("path")
        if isinstance(ref, (bytes, bytearray, memoryview)):
            return bytes(ref), "bytes in the record"
        if not isinstance(ref, str) or not ref:
            where.refuse(f"{which} is {type(ref).__name__} {str(ref)[:60]!r}", VALID_REF)
        if ref.startswith("data:"):
            try:
                return base64.b64decode(ref.partition(",")[2], validate=True), "a data: URI"
            except ValueError:
                where.refuse(f"{which}: a data: URI that is not base64", VALID_REF)
        if ref.split("://")[0] in ("http", "https"):
            where.refuse(f"{which} ({ref}): a web address (preparation reads no web)", VALID_REF)
        uri = ref
        if "://" not in ref and not os.path.isabs(ref):
            uri = beside(where.file.uri, ref)  # relative to the record's file
        try:
            return storage.read_bytes(storage.resolve(uri)), uri
        except FileNotFoundError:
            where.refuse(f"{which} ({uri}): no such file", VALID_REF)
        except (storage.StorageError, OSError) as e:
            where.refuse(f"{which} ({uri}): cannot be read ({e})", VALID_REF)

    def check(self, ids, images: list[StoredImage], where: Where) -> None:
        """The rendered conversation holds exactly one <|image_pad|> per image."""
        pad = self.token_ids[IMAGE_PAD]
        found = int((np.asarray(ids) == pad).sum()) if pad is not None else 0
        if found != len(images):
            where.refuse(
                f"{len(images)} image(s), and the chat template renders {found} {IMAGE_PAD} "
                "placeholder(s) for it",
                f"one image part per image, and no {IMAGE_PAD} written in the text",
            )

    def expand(self, enc: Encoded, images: list[StoredImage]):
        """Each <|image_pad|> repeated for its image's tokens; image tokens never loss tokens.
        'no_loss_tokens' when none is left."""
        ids, mask = enc.ids, enc.mask
        if len(self.image_ids):
            if images:
                repeat = np.ones(len(ids), np.int64)
                pads = np.flatnonzero(ids == self.token_ids[IMAGE_PAD])
                repeat[pads] = [self.processing.tokens(im.grid) for im in images]
                ids, mask = np.repeat(ids, repeat), np.repeat(mask, repeat)
            mask = np.where(np.isin(ids, self.image_ids), 0, mask).astype(np.uint8)
        if not mask.any():
            return "no_loss_tokens"
        return Encoded(ids, mask, enc.text, images)

    def fits(self, enc: Encoded, width: int) -> bool:
        """Whether truncating to `width` keeps every image token among the window's inputs
        (the first width - 1 tokens): an image is all in a window with its pixels, or dropped."""
        if not enc.images:
            return True
        return int(np.flatnonzero(np.isin(enc.ids, self.image_ids)).max()) < width - 1

    def close(self) -> None:
        self.spill.close()
