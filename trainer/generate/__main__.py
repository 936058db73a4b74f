"""Command line: generate from one of our checkpoints or a Hugging Face folder.

    python -m trainer.generate runs/sft/checkpoints/step_000001000 --chat "Summarise FSDP."
    python -m trainer.generate PATH --prompt "Once upon a time" --max-new-tokens 32
    python -m trainer.generate PATH --prompt-ids 1,2,3 --json     # {"ids": [...], "text": "..."}
    python -m trainer.generate /models/Qwen2-VL-2B-Instruct --chat "What colour?" --image a.png
    python -m trainer.generate PATH --chat TEXT --system TEXT --temperature 0.7 --top-p 0.9 \
        --seed 0 --device cuda --dtype bfloat16 --tokenizer other/tokenizer.json

Greedy unless --temperature > 0; stops at any of the model's stop ids (every eos id). Prints
the new text (or, with --json, one line: the new ids, the stop token included when one ended
it, and their text without it). Exit codes: 0 fine, 2 bad input (one line `error: ...` on
stderr, no traceback). --image (repeatable, with --chat, for a vision-language model): each image
goes in the user turn as a {"type": "image"} part before the text (trainer/generate/images.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

from trainer.checkpoint.format import CheckpointError
from trainer.config import ConfigError, fail
from trainer.generate.decode import generate_ids
from trainer.generate.images import PromptImages, prompt_images
from trainer.generate.text import Text, with_tokenizer
from trainer.generate.weights import open_source

DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer.generate", description=__doc__.split("\n")[0]
    )
    p.add_argument("path", help="a checkpoint step (or a folder of them), or a Hugging Face folder")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="text, encoded as is (no template)")
    given.add_argument("--chat", help="a user message, rendered with the chat template")
    given.add_argument("--prompt-ids", help="token ids, comma separated: 1,2,3")
    p.add_argument("--system", help="a system message before --chat")
    p.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image in --chat's user turn, before its text (repeat for more; a VLM only)",
    )
    p.add_argument("--tokenizer", help="a tokenizer.json (or its folder) instead of the model's")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="for sampling")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1")
    p.add_argument(
        "--dtype", default="auto", help=f"auto (float32 on cpu, else bfloat16), {DTYPES}"
    )
    p.add_argument("--json", action="store_true", help='one line {"ids": [...], "text": "..."}')
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        fail("--max-new-tokens", args.max_new_tokens, "an integer >= 1")
    if args.temperature < 0:
        fail("--temperature", args.temperature, "0 (greedy) or more")
    if not 0 < args.top_p <= 1:
        fail("--top-p", args.top_p, "a number in (0, 1]")
    if args.system is not None and args.chat is None:
        fail("--system", args.system, "only with --chat")
    if args.image and args.chat is None:
        fail("--image", args.image[0], "only with --chat (an image goes in its user turn)")
    if args.dtype != "auto" and args.dtype not in DTYPES:
        fail("--dtype", args.dtype, f"auto, {', '.join(DTYPES)}")


def device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        fail("--device", args.device, "auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("--device", args.device, "cpu (this machine has no CUDA device)")
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if device.type == "cpu" else "bfloat16"
    return device, getattr(torch, dtype)


def prompt_ids(
    args: argparse.Namespace,
    text: Text,
    vocab_size: int,
    max_len: int,
    images: Optional[PromptImages] = None,
) -> list[int]:
    """The prompt's ids: --prompt-ids as given, --prompt encoded, --chat rendered and encoded
    (with `images`: their parts before the text, each placeholder expanded)."""
    if args.prompt_ids is not None:
        key, value = "--prompt-ids", args.prompt_ids
        try:
            ids = [int(s) for s in args.prompt_ids.split(",") if s.strip()]
        except ValueError:
            fail(key, value, "token ids separated by commas: 1,2,3")
    elif args.prompt is not None:
        key, value, ids = "--prompt", args.prompt, text.encode(args.prompt)
    else:
        key, value = "--chat", args.chat
        ids = text.chat_ids(args.chat, args.system, images.count if images else 0)
        ids = images.expand(ids) if images else ids
    if not ids:
        fail(key, value, "a prompt of at least one token")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        fail(key, value, f"token ids in [0, {vocab_size}) (the model's vocabulary); got {bad[:5]}")
    if len(ids) >= max_len:
        fail(key, f"{len(ids)} tokens", f"fewer than model.max_seq_len={max_len} tokens")
    return ids


def run(args: argparse.Namespace) -> dict:
    check_args(args)
    device, dtype = device_and_dtype(args)
    source = open_source(args.path, log=lambda m: print(m, file=sys.stderr))
    text = source.text if args.tokenizer is None else with_tokenizer(source.text, args.tokenizer)
    images = prompt_images(args.image, source, text) if args.image else None
    ids = prompt_ids(args, text, source.cfg.vocab_size, source.cfg.max_seq_len, images)
    room = source.cfg.max_seq_len - len(ids)
    if args.max_new_tokens > room:
        print(
            f"generate: {room} new tokens at most (model.max_seq_len={source.cfg.max_seq_len}, "
            f"the prompt has {len(ids)})",
            file=sys.stderr,
        )
    model = source.load(device, dtype)
    generator = None
    if args.seed is not None:
        generator = torch.Generator().manual_seed(args.seed)
    new = generate_ids(
        model,
        ids,
        args.max_new_tokens,
        text.stop_ids,
        source.cfg,
        device,
        dtype,
        temperature=args.temperature,
        top_p=args.top_p,
        generator=generator,
        **(images.inputs if images else {}),
    )
    return {"ids": new, "text": text.decode(new)}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        out = run(args)
    # ConfigError is a ValueError, StorageError an OSError; a bad URI is a ValueError too.
    except (ConfigError, CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    elif out["text"] is None:  # no readable tokenizer: the ids are what there is
        print(" ".join(map(str, out["ids"])))
    else:
        print(out["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
