"""Generation with images: `python -m trainer.generate PATH --chat TEXT --image PICTURE` from a
tiny random Qwen2-VL folder (tests/cluster/vision_task.py) and from our checkpoint imported from
it gives transformers' greedy ids (its generate with the image processor's pixels and the M-RoPE
positions); the refusals name the value and what is valid; and the eval samples of a vision run
carry their prompts' images, on one process and on every rank of the engine."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.cluster.vision_task import QUESTIONS, picture, write_vlm_folder
from tests.gpu.threaded_ranks import run_threaded
from trainer.config import ShardingConfig, model_config
from trainer.data.images import ImageProcessing
from trainer.data.loader import MicroBatch
from trainer.fsdp import build_mesh, parallelize
from trainer.generate import eval_prompts, generate_ids, sample_text
from trainer.generate.__main__ import main as generate_main
from trainer.generate.text import Text
from trainer.generate.weights import open_source
from trainer.hf import import_hf
from trainer.model import build_model, initializer

transformers = pytest.importorskip("transformers")

NEW = 12
QUESTION = QUESTIONS[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The model folder, and two pictures beside it (a red and a blue one)."""
    root = tmp_path_factory.mktemp("vlm")
    write_vlm_folder(root / "model")
    picture(root / "red.png", "red", random.Random(1))
    picture(root / "blue.png", "blue", random.Random(2))
    return root


@pytest.fixture(scope="module")
def hf(folder):
    """transformers' model, tokenizer and (Pillow) image processor of the folder."""
    path = folder / "model"
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    return model, tokenizer, processor


def theirs(hf, pictures: list[Path], question: str) -> list[int]:
    """transformers' greedy new ids: the images as parts before the text, each <|image_pad|>
    expanded as Qwen2VLProcessor does, mm_token_type_ids given (without them transformers 5
    falls back to text positions for the image tokens: no M-RoPE)."""
    from PIL import Image

    model, tokenizer, processor = hf
    pixels = processor(images=[Image.open(p) for p in pictures], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    parts = [{"type": "image"}] * len(pictures) + [{"type": "text", "text": question}]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    counts, expanded = iter((grid.prod(-1) // 4).tolist()), []
    for i in ids:
        expanded += [pad] * next(counts) if i == pad else [i]
    x = torch.tensor([expanded])
    with torch.no_grad():
        out = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == pad).int(),
            pixel_values=pixels["pixel_values"], image_grid_thw=grid,
            max_new_tokens=NEW, do_sample=False,
        )  # fmt: skip
    return out[0, x.shape[1] :].tolist()


def command(capsys, path, *args) -> dict:
    capsys.readouterr()
    rc = generate_main([str(path), *map(str, args), "--max-new-tokens", str(NEW), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def images_args(folder: Path, *names: str) -> list[str]:
    return [a for n in names for a in ("--image", str(folder / f"{n}.png"))]


# ----------------------------------------------------------------------------- the command


def test_chat_with_images_from_an_hf_folder_gives_transformers_greedy_ids(folder, hf, capsys):
    model = folder / "model"
    red = command(capsys, model, "--chat", QUESTION, *images_args(folder, "red"))
    assert red["ids"] == theirs(hf, [folder / "red.png"], QUESTION)
    blue = command(capsys, model, "--chat", QUESTION, *images_args(folder, "blue"))
    assert blue["ids"] == theirs(hf, [folder / "blue.png"], QUESTION)
    assert red["ids"] != blue["ids"]  # the picture is read: another one, another answer
    both = command(capsys, model, "--chat", QUESTION, *images_args(folder, "red", "blue"))
    assert both["ids"] == theirs(hf, [folder / "red.png", folder / "blue.png"], QUESTION)
    assert red["text"] == hf[1].decode(red["ids"])


def test_chat_with_an_image_from_our_imported_checkpoint_gives_the_same_ids(
    folder, hf, tmp_path, capsys
):
    checkpoint = import_hf(str(folder / "model"), str(tmp_path), log=lambda *_: None)
    assert open_source(checkpoint, log=lambda *_: None).kind == "checkpoint"
    out = command(capsys, checkpoint, "--chat", QUESTION, *images_args(folder, "blue"))
    assert out["ids"] == theirs(hf, [folder / "blue.png"], QUESTION)


def text_model(folder: Path, tmp_path: Path) -> Path:
    """A tiny text Qwen2 with the VLM's tokenizer files beside it."""
    model = folder / "model"
    vocab = json.loads((model / "config.json").read_text())["text_config"]["vocab_size"]
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "text")
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(model / name, tmp_path / "text" / name)
    return tmp_path / "text"


def without_processor(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "no_processor"
    shutil.copytree(folder / "model", out)
    (out / "preprocessor_config.json").unlink()
    return out


@pytest.mark.parametrize(
    "case, match",
    [
        ("text model", r"--image='.*red\.png'; valid: only with a vision-language model.*text"),
        ("missing", r"--image='.*nowhere\.png'; valid: an image file .*no such file"),
        ("not an image", r"--image='.*notes\.png'; valid: an image file .*not a readable image"),
        ("no processor", r"no preprocessor_config\.json \(looked for: .*no_processor"),
        ("pad in text", r"--image given 1 time\(s\), and the chat template renders 2"),
        ("no chat", r"--image='.*red\.png'; valid: only with --chat"),
    ],
)
def test_bad_images_are_one_line_refusals_naming_the_value(folder, tmp_path, capsys, case, match):
    model, chat, image = folder / "model", ["--chat", QUESTION], str(folder / "red.png")
    if case == "text model":
        model = text_model(folder, tmp_path)
    elif case == "missing":
        image = str(tmp_path / "nowhere.png")
    elif case == "not an image":
        image = str(tmp_path / "notes.png")
        Path(image).write_text("a picture of a cat")
    elif case == "no processor":
        model = without_processor(folder, tmp_path)
    elif case == "pad in text":
        chat = ["--chat", "what is <|image_pad|> here?"]
    elif case == "no chat":
        chat = ["--prompt", "what"]
    capsys.readouterr()
    assert generate_main([str(model), *chat, "--image", image]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert __import__("re").search(match, err), err


# ----------------------------------------------------------------------------- eval samples


class Batches:
    """An eval split of one micro-batch, with trainer.data's Images' pad id and merge size."""

    def __init__(self, mb: MicroBatch, pad_id: int):
        self.mb = mb
        self.images = SimpleNamespace(pad_id=pad_id, processing=SimpleNamespace(merge_size=2))

    def fixed_micro_batches(self, count, rank, world, rows):
        assert (rank, world) == (0, 1)  # every rank reads the eval windows as a world of one
        return [self.mb]


def micro_batch(rows: list[list[tuple[list[int], list[int]]]], pixels, grid, eod: int):
    """A MicroBatch of windows made of documents (ids, loss mask), padded with `eod` to one
    width, as the loader gives them (int32 ids, uint8 mask, positions per document)."""
    width = max(sum(len(ids) for ids, _ in docs) for docs in rows) + 1
    tokens, masks, positions = [], [], []
    for docs in rows:
        docs = [*docs, ([eod] * (width - sum(len(ids) for ids, _ in docs)), None)]
        tokens.append([i for ids, _ in docs for i in ids])
        masks.append([m for ids, mask in docs for m in (mask or [0] * len(ids))])
        positions.append([p for ids, _ in docs for p in range(len(ids))])
    return MicroBatch(
        torch.tensor(tokens, dtype=torch.int32), 1.0, torch.arange(len(rows)).numpy(),
        torch.zeros(len(rows)).numpy(), torch.tensor(masks, dtype=torch.uint8),
        torch.tensor(positions, dtype=torch.int32), pixels, grid,
    )  # fmt: skip


def chat(text: Text, proc: ImageProcessing, pictures, answer: str, pad: int, loss: bool = True):
    """(ids, loss mask) of one conversation about `pictures` (uint8 resized), its patches and
    grids: the rendered prompt with each pad expanded, then the answer and the end of turn."""
    ids = text.chat_ids(QUESTION, images=len(pictures))
    grids = [proc.grid(p) for p in pictures]
    counts, prompt = iter([proc.tokens(g) for g in grids]), []
    for i in ids:
        prompt += [pad] * next(counts) if i == pad else [i]
    reply = text.encode(answer) + text.stop_ids[:1]
    mask = [0] * len(prompt) + [int(loss)] * len(reply)
    return (prompt + reply, mask), [proc.patches(p) for p in pictures], grids


def test_eval_samples_carry_their_prompts_images_and_answer_as_the_command_does(folder, capsys):
    """Row 0: a conversation about the red picture. Row 1: a text-only conversation, then a
    second document about the red one again (not in the row's prompt). Row 2: the blue picture
    without loss tokens, its prompt cut by max_prompt inside the image (completed), its image
    the third of the micro-batch (an image of an earlier row taken instead is another one)."""
    import numpy as np
    from PIL import Image

    source = open_source(str(folder / "model"), log=lambda *_: None)
    text, model = source.text, source.load("cpu", torch.float32)
    pad = source.cfg.vision.image_token_id
    proc = ImageProcessing.from_dir(str(folder / "model"))
    red, blue = (proc.resized(Image.open(folder / f"{c}.png")) for c in ("red", "blue"))
    doc0, p0, g0 = chat(text, proc, [red], "red", pad)
    hello, said_red = text.chat_ids("hello"), text.encode("red")
    plain = (hello + said_red, [0] * len(hello) + [1] * len(said_red))
    doc1, p1, g1 = chat(text, proc, [red], "red", pad)
    doc2, p2, g2 = chat(text, proc, [blue], "blue", pad, loss=False)
    pixels = torch.from_numpy(np.concatenate(p0 + p1 + p2))
    grid = torch.tensor(g0 + g1 + g2)
    eod = text.stop_ids[0]
    mb = micro_batch([[doc0], [plain, doc1], [doc2]], pixels, grid, eod)
    first_pad = doc2[0].index(pad)
    prompts = eval_prompts(Batches(mb, pad), 3, max_prompt=first_pad + 2)

    n0, n2 = proc.tokens(g0[0]), proc.tokens(g2[0])
    assert prompts[0] == doc0[0][: doc0[1].index(1)]
    assert torch.equal(prompts[0].image_grid, grid[:1])
    assert torch.equal(prompts[0].pixels, torch.from_numpy(p0[0]))
    assert prompts[1] == hello and prompts[1].images == {}
    assert prompts[2] == doc2[0][: first_pad + n2]  # completed to the image's end
    assert torch.equal(prompts[2].pixels, torch.from_numpy(p2[0]))
    assert torch.equal(prompts[2].image_grid, grid[2:])
    # Without its pixels the prompt cannot be generated from: why samples carry them.
    with pytest.raises(ValueError, match="no image is given"):
        generate_ids(model, list(prompts[0]), NEW, text.stop_ids)

    samples = sample_text(model, text, prompts, NEW, step=5)
    args = ["--chat", QUESTION, *images_args(folder, "red")]
    said = command(capsys, folder / "model", *args)["text"]
    assert f"### prompt ({len(prompts[0])} tokens, 1 image(s))" in samples
    assert f"<|image_pad|>x{n0}" in samples and "<|image_pad|><|image_pad|>" not in samples
    assert samples.split("## sample 2")[0].endswith(said + "\n\n"), samples
    assert f"### prompt ({len(prompts[1])} tokens)\n" in samples


# ----------------------------------------------------------------------------- on the engine

SEED, IMAGE, START, END = 3, 256, 257, 258


def tiny_vl():
    return model_config("tiny-vl", n_layers=2, max_seq_len=96, init_std=0.5)


def random_batch():
    """Two windows: one whose prompt holds an image of grid (1, 4, 6), one without an image."""
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 250, (40,), generator=g).tolist()
    image = [START] + [IMAGE] * 6 + [END]
    row0 = (words[:3] + image + words[3:8] + words[8:12], [0] * 16 + [1] * 4)
    row1 = (words[12:30], [0] * 10 + [1] * 8)
    pixels = torch.randn(24, tiny_vl().vision.patch_features, generator=g)
    return micro_batch([[row0], [row1]], pixels, torch.tensor([[1, 4, 6]]), 0)


def _engine_samples(rank: int, world: int, prompts) -> str:
    sharding = ShardingConfig(modules={"visual*": "NO_SHARD"})  # as a vision run shards it
    mesh = build_mesh(sharding, rank, world, world)
    fsdp = parallelize(build_model(tiny_vl()), sharding, mesh, "cpu", init_fn=initializer(SEED))
    return sample_text(fsdp, Text(None), prompts, NEW, world=world, step=1)


def test_samples_with_images_are_the_single_process_ones_on_every_rank_of_the_engine():
    prompts = eval_prompts(Batches(random_batch(), IMAGE), 2)
    assert len(prompts[0].images) == 2 and prompts[1].images == {}
    single = build_model(tiny_vl(), "cpu", seed=SEED).eval()
    expected = sample_text(single, Text(None), prompts, NEW, step=1)
    other = {**prompts[0].images, "pixels": prompts[0].pixels.flip(0)}  # another picture
    assert generate_ids(single, prompts[0], NEW, **other) != generate_ids(
        single, prompts[0], NEW, **prompts[0].images
    )  # the pixels are read: other ones, other ids
    assert run_threaded(_engine_samples, 2, prompts) == [expected, expected]
