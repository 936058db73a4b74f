"""A synthetic image task for fine-tuning a vision-language model end to end: pictures made with
Pillow, each a field of one of four colours with noise and a smaller square of another colour,
asked "what colour is the picture?", answered with the field's colour. Text alone cannot answer
it (every question reads the same); only the image's features can.

`write_vlm_folder` writes a tiny random Qwen2-VL in transformers' layout beside a small BPE
tokenizer with Qwen2-VL's special tokens, its published chat template and a
preprocessor_config.json with a small pixel budget (4-12 image tokens a picture), as a user's
downloaded checkpoint folder would hold them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import AddedToken

from tests.data.vision_models import EOT, PROCESSOR, QWEN2_VL, SPECIAL
from trainer.data import train_tokenizer

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 210, 30),
}
QUESTIONS = ["what colour is the picture?", "which colour is this?", "the colour here?"]
WORDS = [*COLOURS, *" ".join(QUESTIONS).replace("?", " ").split(), "you are a helpful assistant"]


def picture(path: Path, colour: str, rng: random.Random) -> None:
    """A noisy field of `colour` with a square of another colour on it, of a random size."""
    w, h = rng.randint(40, 90), rng.randint(40, 90)
    base = COLOURS[colour]
    noise = np.random.default_rng(rng.randrange(2**32)).integers(-25, 26, (h, w, 3))
    img = Image.fromarray(np.clip(np.array(base) + noise, 0, 255).astype(np.uint8))
    other = COLOURS[rng.choice([c for c in COLOURS if c != colour])]
    side = min(w, h) // 3
    x, y = rng.randint(0, w - side), rng.randint(0, h - side)
    img.paste(Image.new("RGB", (side, side), other), (x, y))
    img.save(path)


def write_records(folder: Path, n: int, seed: int) -> list[tuple[str, str]]:
    """`n` chat records in folder/records.jsonl, their pictures beside it (paths relative to
    the JSONL); returns (picture path, colour) of each."""
    rng = random.Random(seed)
    (folder / "pictures").mkdir(parents=True, exist_ok=True)
    out = []
    with open(folder / "records.jsonl", "w") as f:
        for i in range(n):
            colour = rng.choice(sorted(COLOURS))
            name = f"pictures/{i}.png"
            picture(folder / name, colour, rng)
            user = [
                {"type": "image", "image": name},
                {"type": "text", "text": rng.choice(QUESTIONS)},
            ]
            record = {"messages": [{"role": "user", "content": user},
                                   {"role": "assistant", "content": colour}]}  # fmt: skip
            f.write(json.dumps(record) + "\n")
            out.append((str(folder / name), colour))
    return out


def write_vlm_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL checkpoint folder (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json with the template, preprocessor_config.json); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer([" ".join(WORDS)] * 8, 300)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    (folder / "tokenizer.json").write_text(tok.to_str())
    config = {"chat_template": QWEN2_VL, "eos_token": EOT, "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    ids = {
        "image_token_id": tok.token_to_id("<|image_pad|>"),
        "video_token_id": tok.token_to_id("<|video_pad|>"),
        "vision_start_token_id": tok.token_to_id("<|vision_start|>"),
        "vision_end_token_id": tok.token_to_id("<|vision_end|>"),
    }
    text = dict(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
        bos_token_id=None, eos_token_id=tok.token_to_id(EOT),
    )  # fmt: skip
    vision = dict(
        depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
        temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
    )  # fmt: skip
    cfg = transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **ids
    )
    torch.manual_seed(seed)
    transformers.Qwen2VLForConditionalGeneration(cfg).save_pretrained(folder)
    return folder


def answer(model, tokenizer, processor, path: str, question: str) -> str:
    """The greedy reply of a transformers Qwen2-VL to `question` about the picture at `path`
    (the prompt's one <|image_pad|> expanded to the image's tokens, as its processor does)."""
    image = Image.open(path)
    pixels = processor(images=[image], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    n = int(grid.prod()) // 4
    expanded = []
    for i in ids:
        expanded += [pad] * n if i == pad else [i]
    input_ids = torch.tensor([expanded])
    with torch.no_grad():  # mm_token_type_ids: its processor's output, else 1-D positions
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            pixel_values=pixels["pixel_values"], image_grid_thw=grid,
            mm_token_type_ids=(input_ids == pad).int(), max_new_tokens=6, do_sample=False,
        )  # fmt: skip
    new = out[0, input_ids.shape[1] :].tolist()
    eos = tokenizer.convert_tokens_to_ids(EOT)
    return tokenizer.decode(new[: new.index(eos)] if eos in new else new).strip()
