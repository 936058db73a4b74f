"""What a prepared image costs on disk and in the loader: the storage choice of trainer/data
(window_images.py) measured against the alternatives.

    python -m benchmarks.images             # 24 photo-sized JPEGs, Qwen2-VL's default budget
    python -m benchmarks.images --quick     # 6 images

The images: synthetic photographs (smooth random fields of a few octaves with fine texture and
sensor noise, so JPEG compresses them as it does photos, not as flat test patterns), sized as
datasets hold them (640x480 to 1280x960), saved as JPEG quality 90. The processor: Qwen2-VL's
class defaults (min_pixels 3,136, max_pixels 1,003,520: up to 1,280 tokens an image).

Options, each image's stored form and what the loader does with it per micro-batch:

- patches: float32 patches as pixel_values (with the temporal repeat): read, view.
- resized (the choice): uint8 RGB after resize, 3 bytes a pixel: read, rescale, normalise,
  patchify (images.py `patches`).
- resized-png: the same pixels PNG-compressed (lossless): read, PNG decode, then as resized.
- encoded: the source JPEG as given: read, decode, convert, resize, then as resized.

Loader time: the median over --reps of making one micro-batch of --per-batch images (positional
reads from one file per option, in the page cache: the CPU cost, which is what a loader thread
adds per step; a cold object store adds the bytes / bandwidth on top, in favour of the smaller
forms). Then `loader` times trainer/data's real path: a JSONL of these images prepared with
data.kind=chat, Batches.micro_batches of windows holding --per-batch images.

Measured (this machine: 2 cores shared with other work; 24 images, 871 tokens each on average):

    stored as       KiB/image  vs resized  loader ms / micro-batch of 4
    patches           15997.7       8.00x      3.7
    resized            1999.7       1.00x     18.6   <- chosen
    resized-png         873.2       0.44x     91.6
    encoded             170.1       0.09x     67.8
    trainer/data loader: 30.6 ms a micro-batch of 4.8 images; preparation 23.9 ms an image

Why resized: (1) the float pixels of a sample are then a function of the prepared bytes and
numpy's IEEE arithmetic only, the same on every worker, where from encoded bytes they would
depend on each worker's Pillow and libjpeg build (decoder and resampler: DESIGN.md invariant 2
wants a sample to be a pure function of the prepared data); (2) every image was decoded once,
at preparation, so a broken one stops the preparation (naming the record), never a run at step
40,000; (3) the least CPU of the forms that are not float patches: 3.6x less than decoding the
JPEG per step (at 1,280 x 960 and above, what a 12.8-megapixel budget keeps, decoding grows
with the source, resized with the budget); (4) 8x smaller than float patches, whose 64 MiB a
micro-batch would take 0.3 s to read at 200 MB/s. The cost: 12x the bytes of the source JPEGs
(at 200 MB/s, 8 MiB a micro-batch is 40 ms of reading, overlapped with compute by the
loader's thread); where storage matters more than CPU, resized-png keeps the determinism at
0.44x the bytes for 5x the loader CPU (not implemented: one more stored form to test).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import PIL.Image

from tests.data.vision_models import write_model  # a tiny Qwen2-VL tokenizer folder
from trainer.config import DataConfig
from trainer.data import Batches, PreparedData, prepare
from trainer.data.images import ImageProcessing

SIZES = [(480, 640), (600, 800), (720, 1280), (768, 1024), (960, 1280)]


def synthetic_photo(height: int, width: int, rng: np.random.Generator) -> PIL.Image.Image:
    """Octaves of smooth noise (upsampled random grids), colour-mixed, plus texture and noise."""
    out = np.zeros((height, width, 3))
    for cells, weight in ((4, 90.0), (16, 40.0), (64, 15.0)):
        grid = rng.normal(size=(cells, cells * width // height + 1, 3))
        layer = PIL.Image.fromarray(((grid - grid.min()) / np.ptp(grid) * 255).astype(np.uint8))
        out += (np.asarray(layer.resize((width, height), PIL.Image.BICUBIC)) - 128) * weight / 128
    out += 128 + rng.normal(0, 6, out.shape)
    return PIL.Image.fromarray(np.clip(out, 0, 255).astype(np.uint8))


def stored_forms(jpeg: bytes, proc: ImageProcessing) -> dict[str, bytes]:
    pixels = proc.resized(proc.decode(jpeg))
    png = io.BytesIO()
    PIL.Image.fromarray(pixels).save(png, "PNG")
    return {
        "patches": proc.patches(pixels).tobytes(),
        "resized": pixels.tobytes(),
        "resized-png": png.getvalue(),
        "encoded": jpeg,
    }


def loader_step(option: str, fd: int, spans, shapes, proc: ImageProcessing) -> int:
    """One micro-batch of images in `option`'s form: float32 patches of each; their rows."""
    rows = 0
    for (offset, size), (h, w) in zip(spans, shapes):
        data = os.pread(fd, size, offset)
        if option == "patches":
            out = np.frombuffer(data, np.float32).reshape(-1, proc.patch_dim)
        elif option == "resized":
            out = proc.patches(np.frombuffer(data, np.uint8).reshape(h, w, 3))
        elif option == "resized-png":
            out = proc.patches(np.asarray(PIL.Image.open(io.BytesIO(data))))
        else:
            out = proc.patches(proc.resized(proc.decode(data)))
        rows += len(out)
    return rows


def measure_forms(images: list[bytes], proc: ImageProcessing, per_batch: int, reps: int, tmp):
    forms = [stored_forms(j, proc) for j in images]
    shapes = [proc.resized(proc.decode(j)).shape[:2] for j in images]
    out = {}
    for option in forms[0]:
        path = Path(tmp) / f"{option}.bin"
        spans, at = [], 0
        with open(path, "wb") as f:
            for form in forms:
                f.write(form[option])
                spans.append((at, len(form[option])))
                at += len(form[option])
        fd = os.open(path, os.O_RDONLY)
        try:
            times = []
            for r in range(reps):
                pick = [(r * per_batch + k) % len(images) for k in range(per_batch)]
                start = time.perf_counter()
                loader_step(option, fd, [spans[i] for i in pick], [shapes[i] for i in pick], proc)
                times.append(time.perf_counter() - start)
        finally:
            os.close(fd)
        out[option] = {
            "bytes_per_image": at / len(images),
            "ms_per_micro_batch": statistics.median(times) * 1e3,
        }
    return out


def measure_loader(jpegs: list[bytes], proc, per_batch: int, reps: int, tmp) -> dict:
    """trainer/data's own path: prepared with data.kind=chat, read by Batches."""
    root = Path(tmp) / "loader"
    tok = write_model(root / "model", {"image_processor_type": "Qwen2VLImageProcessor"})
    (root / "images").mkdir()
    lines = []
    for i, jpeg in enumerate(jpegs):
        (root / "images" / f"{i}.jpg").write_bytes(jpeg)
        user = [{"type": "image", "image": f"images/{i}.jpg"}, {"type": "text", "text": "what"}]
        conv = [{"role": "user", "content": user}, {"role": "assistant", "content": "a cat"}]
        lines.append(json.dumps({"messages": conv}) + "\n")
    (root / "c.jsonl").write_text("".join(lines))
    seq_len = 1300 * per_batch  # about one image of up to 1,280 tokens per conversation
    cfg = DataConfig(
        source=str(root / "c.jsonl"),
        tokenizer=str(tok),
        kind="chat",
        seq_len=seq_len - 1,
        prepared_dir=str(root / "prep"),
    )
    start = time.perf_counter()
    data = PreparedData.open(prepare(cfg, log=lambda *_: None).uri)
    prepare_s = time.perf_counter() - start
    batches = Batches(data, seq_len - 1, seed=0, global_batch=1)
    times, images = [], []
    for step in range(reps):
        start = time.perf_counter()
        (mb,) = batches.micro_batches(step, 0, 1, 1)
        times.append(time.perf_counter() - start)
        images.append(len(mb.image_grid))
    return {
        "prepare_ms_per_image": prepare_s * 1e3 / len(jpegs),
        "ms_per_micro_batch": statistics.median(times) * 1e3,
        "images_per_micro_batch": statistics.mean(images),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.images", description=__doc__)
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--per-batch", type=int, default=4, help="images in one micro-batch")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.reps = 6, 5
    rng = np.random.default_rng(0)
    proc = ImageProcessing()
    jpegs = []
    for i in range(args.images):
        buf = io.BytesIO()
        synthetic_photo(*SIZES[i % len(SIZES)], rng).save(buf, "JPEG", quality=90)
        jpegs.append(buf.getvalue())
    with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        forms = measure_forms(jpegs, proc, args.per_batch, args.reps, tmp)
        loader = measure_loader(jpegs, proc, args.per_batch, args.reps, tmp)
    tokens = statistics.mean(proc.tokens(proc.grid(proc.resized(proc.decode(j)))) for j in jpegs)
    print(
        f"{args.images} JPEGs (q90, {SIZES[0][1]}x{SIZES[0][0]} to 1280x960), {tokens:.0f} "
        f"image tokens each on average; micro-batch of {args.per_batch} images"
    )
    print(f"{'stored as':<14}{'KiB/image':>12}{'vs resized':>12}{'loader ms/mb':>14}")
    for option, m in forms.items():
        ratio = m["bytes_per_image"] / forms["resized"]["bytes_per_image"]
        mark = "  <- chosen" if option == "resized" else ""
        print(
            f"{option:<14}{m['bytes_per_image'] / 1024:>12.1f}{ratio:>11.2f}x"
            f"{m['ms_per_micro_batch']:>14.1f}{mark}"
        )
    print(
        f"trainer/data loader (Batches.micro_batches, {loader['images_per_micro_batch']:.1f} "
        f"images/mb): {loader['ms_per_micro_batch']:.1f} ms/mb; preparation "
        f"{loader['prepare_ms_per_image']:.1f} ms/image"
    )
    print(
        json.dumps(
            {
                "benchmark": "images",
                "tokens_per_image": tokens,
                "forms": forms,
                "loader": loader,
                "per_batch": args.per_batch,
                "images": args.images,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
