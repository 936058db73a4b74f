"""Chat records with images (Qwen2-VL): prepared through the chat path into windows whose
micro-batches carry each image's patches and grid as transformers' Qwen2VLProcessor makes them,
placeholders expanded as it expands them, image tokens never loss tokens, documents (and their
images) whole inside one window; JSONL with paths and Parquet with bytes giving the same bytes;
the digest naming the image processor; bad input refused naming the file and the record, with
nothing left behind."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import PIL.Image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.data.vision_models import EOT, PROCESSOR, QWEN2_VL, WORDS, write_model
from tests.s3_server import s3_filesystem, s3_server, s3_uri
from trainer.config import ConfigError, DataConfig
from trainer.data import Batches, PreparedData, load_tokenizer, plan_preparation, prepare
from trainer.data.__main__ import main as data_main
from trainer.data.chat_images import IMAGE_TOKENS
from trainer.data.images import ImageProcessing
from trainer.data.window_images import has_images


def photo(height: int, width: int, seed: int) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x * y) % 256], -1)
    rgb = np.clip(base + rng.integers(-30, 30, base.shape), 0, 255).astype(np.uint8)
    return PIL.Image.fromarray(rgb)


def text(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversations(n: int, folder: Path, seed: int = 0) -> list[tuple[list[dict], list[str]]]:
    """n conversations of 0-3 images (PNG files under folder/images), text-only ones among
    them; (messages with relative image paths, the image files in render order)."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        names = []
        for k in range(rng.choice([0, 1, 1, 2, 3])):
            name = f"images/r{i}-{k}.png"
            photo(rng.randint(8, 160), rng.randint(8, 160), seed * 1000 + i * 10 + k).save(
                folder / name
            )
            names.append(name)
        first = {"role": "user", "content": f"Question {i}: {text(rng, 4)}"}
        if names:
            parts = [{"type": "image", "image": name} for name in names]
            parts.insert(rng.randint(0, len(parts)), {"type": "text", "text": first["content"]})
            first = {"role": "user", "content": parts}
        conv = [first, {"role": "assistant", "content": f"Answer {i}: {text(rng, 8)}"}]
        if rng.random() < 0.3:
            conv += [
                {"role": "user", "content": text(rng, 3)},
                {"role": "assistant", "content": text(rng, 5)},
            ]
        out.append((conv, names))
    return out


def write_jsonl(path: Path, convs) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c, _ in convs))
    return path


def chat_cfg(tmp_path, source, tok, **kw) -> DataConfig:
    base = dict(
        source=str(source),
        tokenizer=str(tok),
        kind="chat",
        seq_len=255,
        eval_fraction=0.0,
        prepared_dir=str(tmp_path / "prep"),
    )
    return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("qwen2vl"))


@pytest.fixture(scope="module")
def reference(tok):
    """transformers' Qwen2VLProcessor of the same files (its Pillow image processor; the video
    processor, which needs torchvision, is left out of its class check)."""
    from transformers import AutoImageProcessor, PreTrainedTokenizerFast  # noqa: PLC0415
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor  # noqa: PLC0415
    from transformers.processing_utils import ProcessorMixin  # noqa: PLC0415

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tok), eos_token=EOT, chat_template=QWEN2_VL)
    images = AutoImageProcessor.from_pretrained(str(tok.parent), backend="pil")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None)
        proc = Qwen2VLProcessor(image_processor=images, tokenizer=hf_tok, video_processor=None)
    return proc


def expected(reference, convs, folder: Path) -> dict[tuple, tuple]:
    """ids -> (pixel_values, image_grid_thw, assistant text) of each conversation, by
    transformers: apply_chat_template, then the processor on the text and the images."""
    out = {}
    for conv, names in convs:
        rendered = reference.tokenizer.apply_chat_template(conv, tokenize=False)
        images = [PIL.Image.open(folder / n) for n in names] or None
        got = reference(text=[rendered], images=images, return_tensors="np")
        pixels = got.get("pixel_values", np.zeros((0, 1176), np.float32))
        grid = got.get("image_grid_thw", np.zeros((0, 3), np.int64))
        replies = "".join(m["content"] + EOT for m in conv if m["role"] == "assistant")
        out[tuple(got["input_ids"][0].tolist())] = (pixels, grid, replies)
    return out


def documents(data: PreparedData, seq_len: int = 255) -> list[tuple]:
    """Every document of every window, read through the loader: (ids, mask, its pixels, its
    grids), images assigned to documents by their <|image_pad|> runs in token order."""
    windows = len(data.stream(0)) // data.width
    batches = Batches(data, seq_len, seed=0, global_batch=windows)
    (mb,) = batches.micro_batches(0, 0, 1, 1)
    assert sorted(mb.sample_ids.tolist()) == list(range(windows))
    pad = data.tokenizer_info()["image_token_id"]
    merge = ImageProcessing.from_json(data.manifest.settings["images"]).merge_size
    tokens, mask, positions = mb.windows.numpy(), mb.loss_mask.numpy(), mb.positions.long()
    grids, pixels = mb.image_grid.numpy(), mb.pixels.numpy()
    image, row = 0, 0
    out = []
    for t, m, p in zip(tokens, mask, positions.numpy()):
        starts = np.flatnonzero(p == 0).tolist() + [len(p)]
        for a, b in zip(starts, starts[1:]):
            ids = t[a:b]
            n_pads, mine = int((ids == pad).sum()), []
            while n_pads:  # this document's images, in order
                t_, h, w = grids[image]
                n_pads -= t_ * h * w // merge**2
                mine.append(image)
                image += 1
            assert n_pads == 0, "an image's tokens cross a document or window boundary"
            rows = sum(int(np.prod(grids[k])) for k in mine)
            out.append((tuple(ids.tolist()), m[a:b], pixels[row : row + rows], grids[mine]))
            row += rows
    assert image == len(grids) and row == len(pixels)
    return out


def test_jsonl_with_image_paths_gives_micro_batches_equal_to_transformers_processor(
    tmp_path, tok, reference
):
    convs = conversations(40, tmp_path)
    assert sum(bool(names) for _, names in convs) >= 25
    src = write_jsonl(tmp_path / "c.jsonl", convs)
    data = PreparedData.open(prepare(chat_cfg(tmp_path, src, tok)).uri)
    want = expected(reference, convs, tmp_path)
    model = load_tokenizer(str(tok)).model
    image_ids = [model.token_to_id(t) for t in IMAGE_TOKENS]
    pad = load_tokenizer(str(tok)).model.token_to_id(EOT)
    docs = [d for d in documents(data) if not (np.array(d[0]) == pad).all()]
    assert Counter(d[0] for d in docs) == Counter(want.keys())  # every conversation, whole, once
    for ids, mask, pixels, grids in docs:
        want_pixels, want_grid, replies = want[ids]
        np.testing.assert_array_equal(grids, want_grid)
        np.testing.assert_allclose(pixels, want_pixels, rtol=0, atol=1e-6)
        assert not mask[np.isin(ids, image_ids)].any()  # image tokens: never loss tokens
        assert model.decode(np.array(ids)[mask == 1].tolist(), skip_special_tokens=False) == (
            replies
        )
    assert has_images(data) and data.verify() == []
    shards = data.manifest.sources[0].splits["train"].shards
    assert len(shards) == 1 and len(shards[0].files) == 6  # mask pos count img imgs wimg
    assert len(docs) > shards[0].windows  # packed: several documents (with images) a window
    info = data.tokenizer_info()
    assert [info[k] for k in ("image_token_id", "vision_start_id", "vision_end_id")] == image_ids


def test_train_on_all_still_never_learns_image_tokens(tmp_path, tok):
    convs = conversations(6, tmp_path, seed=1)
    src = write_jsonl(tmp_path / "c.jsonl", convs)
    data = PreparedData.open(prepare(chat_cfg(tmp_path, src, tok, train_on="all")).uri)
    model = load_tokenizer(str(tok)).model
    image_ids = [model.token_to_id(t) for t in IMAGE_TOKENS]
    pad = model.token_to_id(EOT)
    for ids, mask, _, grids in documents(data):
        ids = np.array(ids)
        if (ids == pad).all():
            continue
        image = np.isin(ids, image_ids)
        assert not mask[image].any() and mask[1:][~image[1:]].all()


def parquet_parts(path: Path, convs, folder: Path) -> Path:
    """Parquet with each image's bytes in its part (a binary field of the content structs)."""
    rows = []
    for conv, names in convs:
        images = iter(names)
        messages = []
        for m in conv:
            content = m["content"]
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            parts = []
            for p in content:
                data = (folder / next(images)).read_bytes() if p["type"] == "image" else None
                parts.append({"type": p["type"], "text": p.get("text"), "image": data})
            messages.append({"role": m["role"], "content": parts})
        rows.append(messages)
    part = pa.struct([("type", pa.string()), ("text", pa.string()), ("image", pa.binary())])
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    pq.write_table(pa.table({"messages": pa.array(rows, pa.list_(message))}), path)
    return path


def parquet_column(path: Path, convs, folder: Path) -> Path:
    """Parquet as TRL's vision datasets hold it: {"type": "image"} parts, the images' bytes in
    an "images" column of {bytes, path} structs."""
    rows, images = [], []
    for conv, names in convs:
        messages = []
        for m in conv:
            c = m["content"]
            parts = [{"type": "text", "text": c}] if isinstance(c, str) else c
            parts = [{"type": p["type"], "text": p.get("text")} for p in parts]
            messages.append({"role": m["role"], "content": parts})
        rows.append(messages)
        images.append([{"bytes": (folder / n).read_bytes(), "path": n} for n in names])
    pq.write_table(pa.table({"messages": rows, "images": images}), path)
    return path


def shard_bytes(uri: str) -> dict[str, bytes]:
    """The prepared files by kind (their names carry the digest)."""
    return {p.name.split("-train")[-1]: p.read_bytes() for p in Path(uri).glob("*-train*.bin")}


def test_parquet_with_image_bytes_prepares_the_same_bytes_as_jsonl_with_paths(tmp_path, tok):
    convs = conversations(16, tmp_path, seed=2)
    a = prepare(chat_cfg(tmp_path, write_jsonl(tmp_path / "c.jsonl", convs), tok))
    for writer in (parquet_parts, parquet_column):
        path = writer(tmp_path / f"{writer.__name__}.parquet", convs, tmp_path)
        b = prepare(chat_cfg(tmp_path, path, tok))
        assert a.digest != b.digest
        want, got = shard_bytes(a.uri), shard_bytes(b.uri)
        assert sorted(got) == sorted(want) and len(got) == 7
        for kind in want:
            assert got[kind] == want[kind], (writer.__name__, kind)


def test_micro_batches_of_any_world_size_hold_the_images_of_their_own_rows(tmp_path, tok):
    convs = conversations(30, tmp_path, seed=3)
    src = write_jsonl(tmp_path / "c.jsonl", convs)
    data = PreparedData.open(prepare(chat_cfg(tmp_path, src, tok)).uri)
    batches = Batches(data, 255, seed=0, global_batch=5)
    (whole,) = batches.micro_batches(1, 0, 1, 1)
    for world in (2, 3):
        parts = [mb for r in range(world) for mb in batches.micro_batches(1, r, world, 2)]
        parts = [mb for mb in parts if mb.weight]
        assert torch.equal(torch.cat([mb.pixels for mb in parts]), whole.pixels)
        assert torch.equal(torch.cat([mb.image_grid for mb in parts]), whole.image_grid)
        for mb in parts:  # each micro-batch: its rows' pad runs match its own grids
            pads = int((mb.windows == data.tokenizer_info()["image_token_id"]).sum())
            assert pads == int(mb.image_grid.prod(dim=1).sum()) // 4
            assert mb.pixels.shape == (int(mb.image_grid.prod(dim=1).sum()), 1176)
    moved = whole.to("cpu")
    assert moved.pixels.dtype == torch.float32 and moved.image_grid.dtype == torch.int64
    assert torch.equal(moved.pixels, whole.pixels)


def test_text_only_chat_data_has_no_pixels(tmp_path, tok):
    convs = [(c, []) for c, names in conversations(12, tmp_path, seed=4) if not names]
    src = write_jsonl(tmp_path / "c.jsonl", convs)
    data = PreparedData.open(prepare(chat_cfg(tmp_path, src, tok)).uri)
    assert not has_images(data)
    (mb,) = Batches(data, 255, seed=0, global_batch=2).micro_batches(0, 0, 1, 1)
    assert mb.pixels is None and mb.image_grid is None


def test_the_digest_names_the_image_processor_settings(tmp_path):
    src = tmp_path / "c.jsonl"
    write_jsonl(src, conversations(3, tmp_path, seed=5))
    digests = []
    for i, change in enumerate(
        [{}, {}, {"max_pixels": 28 * 28 * 16}, {"image_mean": [0.5, 0.5, 0.5]}, {"resample": 2}]
    ):
        tok = write_model(tmp_path / f"m{i}", {**PROCESSOR, **change})
        plan = plan_preparation(chat_cfg(tmp_path, src, tok))
        assert plan.settings["images"] == plan.images.to_json()
        digests.append(plan.digest)
    assert digests[0] == digests[1] and len(set(digests)) == 4
    text_model = write_model(tmp_path / "text", processor=None)  # no processor: no images key
    assert "images" not in plan_preparation(chat_cfg(tmp_path, src, text_model)).settings


def refused(tmp_path, cfg, match: str) -> None:
    """prepare(cfg) refuses with `match`, and leaves nothing of the preparation behind."""
    digest = plan_preparation(cfg).digest
    with pytest.raises(ConfigError, match=match):
        prepare(cfg)
    assert not (Path(cfg.prepared_dir) / digest[:16]).exists()
    assert list(Path(cfg.prepared_dir).glob("*/*")) == []


def test_a_missing_or_undecodable_image_is_refused_naming_the_record_and_the_file(tmp_path, tok):
    folder = tmp_path / "src"
    convs = conversations(8, folder, seed=6)
    write_jsonl(folder / "a.jsonl", convs)  # a good unit is committed first, then removed
    image = {"role": "user", "content": [{"type": "image", "image": "images/nope.png"}]}
    reply = {"role": "assistant", "content": "yes"}
    bad = [(convs[0][0], []), ([image, reply], [])]
    write_jsonl(folder / "b.jsonl", bad)
    missing = str(folder / "images" / "nope.png")
    refused(
        tmp_path,
        chat_cfg(tmp_path, folder / "*.jsonl", tok),
        rf"invalid data: {folder}/b.jsonl, record 1 \(line 2\): image 1 of 1 \({missing}\): no "
        "such file",
    )
    (folder / "images" / "nope.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    refused(
        tmp_path,
        chat_cfg(tmp_path, folder / "*.jsonl", tok),
        rf"b.jsonl, record 1 \(line 2\): image 1 of 1 \({missing}\): not a readable image",
    )
    user = {"role": "user", "content": [{"type": "image", "image": b"not an image"}]}
    parquet_messages(tmp_path / "bad.parquet", [[user, reply]])
    refused(
        tmp_path,
        chat_cfg(tmp_path, tmp_path / "bad.parquet", tok),
        r"bad.parquet, record 0: image 1 of 1 \(bytes in the record\): not a readable image",
    )


def parquet_messages(path: Path, rows: list[list[dict]], images: list | None = None) -> Path:
    """Parquet of message lists whose content is always a list of {type, text, image} parts
    (a string content becomes one text part), and optionally an "images" column."""
    part = pa.struct([("type", pa.string()), ("text", pa.string()), ("image", pa.binary())])
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    fixed = []
    for row in rows:
        messages = []
        for m in row:
            c = m["content"]
            parts = [{"type": "text", "text": c}] if isinstance(c, str) else c
            messages.append({"role": m["role"], "content": parts})
        fixed.append(messages)
    columns = {"messages": pa.array(fixed, pa.list_(message))}
    if images is not None:
        columns["images"] = images
    pq.write_table(pa.table(columns), path)
    return path


def test_a_count_that_does_not_match_the_placeholders_is_refused(tmp_path, tok):
    convs = conversations(4, tmp_path, seed=7)
    with_image = next(c for c, names in convs if len(names) == 1)
    written = {"type": "text", "text": "<|image_pad|>"}  # typed by a user, rendered as is
    extra = [{**with_image[0], "content": with_image[0]["content"] + [written]}, *with_image[1:]]
    src = write_jsonl(tmp_path / "c.jsonl", [(convs[0][0], []), (extra, [])])
    refused(
        tmp_path,
        chat_cfg(tmp_path, src, tok),
        r"c.jsonl, record 1 \(line 2\): 1 image\(s\), and the chat template renders 2 "
        r"<\|image_pad\|> placeholder\(s\)",
    )
    png = (tmp_path / next(n for _, names in convs for n in names)).read_bytes()
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}
    row = [user, {"role": "assistant", "content": "ok"}]
    parquet_messages(tmp_path / "t.parquet", [row], [[{"bytes": png}, {"bytes": png}]])
    refused(
        tmp_path,
        chat_cfg(tmp_path, tmp_path / "t.parquet", tok),
        r"t.parquet, record 0: 2 images in its 'images' column and 1 image parts",
    )
    video = {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}
    refused(
        tmp_path,
        chat_cfg(tmp_path, write_jsonl(tmp_path / "v.jsonl", [([video, row[1]], [])]), tok),
        r"v.jsonl, record 0 \(line 1\): a video part \(videos are not supported yet",
    )
    no_processor = write_model(tmp_path / "text-model", processor=None)
    refused(
        tmp_path,
        chat_cfg(tmp_path, write_jsonl(tmp_path / "d.jsonl", [(with_image, [])]), no_processor),
        r"record 0 \(line 1\): 1 image\(s\), and there is no preprocessor_config.json beside",
    )


def test_an_overlong_conversation_is_truncated_only_when_its_images_stay_whole(tmp_path, tok):
    convs = conversations(3, tmp_path, seed=8)
    name = next(n for _, names in convs for n in names)

    def reply(content: str) -> dict:
        return {"role": "assistant", "content": content}

    long_reply = reply(" ".join(["dog"] * 200))
    early = [{"role": "user", "content": [{"type": "image", "image": name}]}, long_reply]
    cats = {"type": "text", "text": " ".join(["cat"] * 200)}
    late = [
        {"role": "user", "content": [cats, {"type": "image", "image": name}]},
        {"role": "assistant", "content": "red"},
    ]
    short = [{"role": "user", "content": [{"type": "image", "image": name}]}, reply("sky")]
    src = write_jsonl(tmp_path / "c.jsonl", [(early, []), (late, []), (short, [])])
    info = prepare(chat_cfg(tmp_path, src, tok, seq_len=127))
    assert info.skipped == {"overlong_truncated": 1, "overlong_image_dropped": 1}
    pad = load_tokenizer(str(tok)).model.token_to_id(EOT)
    docs = [d for d in documents(PreparedData.open(info.uri), 127) if d[0][0] != pad]
    assert sorted((len(d[0]), len(d[3])) for d in docs)[-1] == (128, 1)  # cut, its image whole
    assert len(docs) == 2 and all(len(d[3]) == 1 for d in docs)
    info = prepare(chat_cfg(tmp_path, src, tok, seq_len=127, overlong="drop"))
    assert info.skipped == {"overlong_dropped": 2}


def test_python_m_trainer_data_prepares_and_inspects_image_data(tmp_path, tok, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", conversations(10, tmp_path, seed=9))
    prep = tmp_path / "cli"
    args = [f"data.source={src}", f"data.tokenizer={tok}", f"data.prepared_dir={prep}"]
    assert data_main(["prepare", "data=chat", "data.seq_len=255", *args]) == 0
    assert data_main(["inspect", str(prep), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "'images': {'min_pixels': 3136" in out and "every shard's crc32 matches" in out
    assert re.search(r"images: +\d+ in the windows of 1 shard", out)
    assert re.search(r"<\|vision_start\|><\|image_pad\|> x \d+<\|vision_end\|>", out)


def test_jsonl_and_images_on_s3_prepare_the_same_bytes_as_local_files(tmp_path, tok):
    convs = conversations(8, tmp_path, seed=10)
    local = prepare(chat_cfg(tmp_path, write_jsonl(tmp_path / "c.jsonl", convs), tok))
    index, name = next((i, names[0]) for i, (_, names) in enumerate(convs) if len(names) == 1)
    uploads = {f"images/{p.name}": p for p in (tmp_path / "images").iterdir()}
    uploads.update({f"model/{p.name}": p for p in tok.parent.iterdir()})
    with s3_server("vlm") as endpoint:
        fs = s3_filesystem(endpoint)
        # one image named by its URI, the others by paths relative to the JSONL
        remote_convs = json.loads(json.dumps(convs))
        user = remote_convs[index][0][0]
        user["content"] = [
            {**p, "image": s3_uri(endpoint, "vlm", name)} if p.get("image") else p
            for p in user["content"]
        ]
        uploads["c.jsonl"] = write_jsonl(tmp_path / "remote.jsonl", remote_convs)
        for key, path in uploads.items():
            with fs.open_output_stream(f"vlm/{key}") as f:
                f.write(path.read_bytes())
        remote = chat_cfg(
            tmp_path,
            s3_uri(endpoint, "vlm", "c.jsonl"),
            s3_uri(endpoint, "vlm", "model/tokenizer.json"),
            prepared_dir=s3_uri(endpoint, "vlm", "prepared"),
        )
        info = prepare(remote)
        data = PreparedData.open(info.uri)
        assert has_images(data) and data.verify() == []
        (shard,) = data.manifest.sources[0].splits["train"].shards
        got = {}
        for f in [{"name": shard.name}, *shard.files.values()]:
            with fs.open_input_stream(f"vlm/prepared/{info.digest[:16]}/{f['name']}") as h:
                got[f["name"].split("-train")[-1]] = h.read()
    assert got == shard_bytes(local.uri)
