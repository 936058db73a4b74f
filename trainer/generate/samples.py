"""What the model says at each evaluation: a few fixed eval prompts, generated on every rank of
the engine together and returned as one text block for rank 0 to log (samples/step_N.txt).

    prompts = eval_prompts(eval_batches, cfg.train.sample_prompts)   # the same on every rank
    text = sample_text(fsdp, data.tokenizer_info(), prompts, cfg.train.sample_tokens,
                       world=world, step=step)                                  # ALL ranks
    logger.log_text(text, f"samples/step_{step}.txt")                           # rank 0 logs

A prompt is the start of a window's first document: up to its first loss token (chat data: the
first conversation's prompt, its generation header included), or without a loss mask its first
`max_prompt` tokens. With image data a prompt carries the images its image tokens stand for
(Prompt.pixels, Prompt.image_grid: its rows of the eval micro-batch's pixels), and is never cut
inside an image.

Why carry the images rather than skip prompts that hold image tokens: every rank reads the same
eval windows (eval_prompts asks as rank 0 of a world of one), so every rank holds the same
pixels and runs the same forwards with the same shapes, as generate_ids needs under the engine
(the tower runs in each prefill whether or not a prompt has an image); and in a vision run
nearly every prompt holds an image, so skipping them would leave the samples of such a run
empty: what the model says about a picture is the sample worth reading.
"""

from __future__ import annotations

import re
from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from trainer.data.chat_images import IMAGE_PAD
from trainer.generate.decode import generate_ids
from trainer.generate.text import Text, text_of_info

DEFAULT_PROMPT_TOKENS = 32
"""Prompt length taken from a window without a loss mask (text data)."""


class Prompt(list):
    """A sample prompt: its ids (a list, so whatever reads ids reads them unchanged) and the
    images they hold, as the model's forward takes them (None for a text prompt)."""

    def __init__(self, ids, pixels=None, image_grid=None):
        super().__init__(int(i) for i in ids)
        self.pixels: Optional[torch.Tensor] = pixels
        """float32 [N, patch_dim]: the patches of the prompt's images (pixel_values)."""
        self.image_grid: Optional[torch.Tensor] = image_grid
        """int64 [n, 3]: each image's (t, h, w) in patches (image_grid_thw)."""

    @property
    def images(self) -> dict:
        """generate_ids' image keywords: {} without images."""
        if self.image_grid is None or not len(self.image_grid):
            return {}
        return {"pixels": self.pixels, "image_grid": self.image_grid}


def eval_prompt(
    tokens, loss_mask=None, positions=None, max_prompt: int = DEFAULT_PROMPT_TOKENS
) -> list[int]:
    """The prompt of one window (1-D tokens [T+1] as ids, its loss_mask and positions as in
    MicroBatch, or None): the first document's tokens before its first loss target; a first
    document without one (or no mask) gives its first `max_prompt` tokens (at least one)."""
    ids = np.asarray(_numpy(tokens), dtype=np.int64)
    end = len(ids)
    if positions is not None:
        starts = np.flatnonzero(_numpy(positions)[1:] == 0)  # where the next document begins
        end = int(starts[0]) + 1 if len(starts) else end
    if loss_mask is not None:
        targets = np.flatnonzero(_numpy(loss_mask)[:end])
        if len(targets) and targets[0] > 0:
            return ids[: int(targets[0])].tolist()
    return ids[: max(1, min(end, max_prompt))].tolist()


def batch_prompts(
    mb,
    count: int,
    max_prompt: int = DEFAULT_PROMPT_TOKENS,
    image_token_id: Optional[int] = None,
    merge_size: int = 2,
) -> list[Prompt]:
    """The prompts of a MicroBatch's first `count` windows (eval_prompt of each), each with its
    images when the micro-batch has some (`image_token_id` and `merge_size`: how its windows
    hold them, as the model's vision config says)."""
    windows = mb.windows
    rows = min(count, windows.shape[0])
    prompts = [
        eval_prompt(
            windows[i],
            None if mb.loss_mask is None else mb.loss_mask[i],
            None if mb.positions is None else mb.positions[i],
            max_prompt,
        )
        for i in range(rows)
    ]
    if mb.image_grid is None or not len(mb.image_grid):
        return [Prompt(p) for p in prompts]
    if image_token_id is None:
        raise ValueError(
            "batch_prompts: the micro-batch holds images and no image_token_id is given; valid: "
            "the model's vision.image_token_id (the preparation's tokenizer image_token_id)"
        )
    return with_images(prompts, mb, image_token_id, merge_size)


def with_images(prompts: list[list[int]], mb, image_token_id: int, merge: int) -> list[Prompt]:
    """Each prompt of the first rows of `mb` with its images' pixels and grids. The micro-batch's
    images are in the order of their image-token runs, row by row; a prompt holds the first of
    its row's images whole (chat prompts end at an answer, never inside an image): one cut by
    `max_prompt` (a window without loss tokens) is completed to its run's end instead."""
    windows, grid = mb.windows, mb.image_grid.cpu()
    patches = grid.prod(-1).tolist()
    tokens = [n // merge**2 for n in patches]
    first_patch = np.concatenate([[0], np.cumsum(patches)]).tolist()
    out, image = [], 0  # `image`: the first image of the current row
    for row, prompt in enumerate(prompts):
        ids = windows[row].tolist()
        held = sum(1 for i in prompt if i == image_token_id)
        k = covered = 0
        while covered < held:
            covered, k = covered + _tokens_of(tokens, image + k), k + 1
        prompt = ids[: len(prompt) + covered - held]  # a cut run completed
        pixels = mb.pixels[first_patch[image] : first_patch[image + k]].clone()  # not the rest
        out.append(Prompt(prompt, pixels, grid[image : image + k]))
        in_row, taken = sum(1 for i in ids if i == image_token_id), 0
        while taken < in_row:  # past the row's images, to the next row's first
            taken, image = taken + _tokens_of(tokens, image), image + 1
    return out


def _tokens_of(tokens: list[int], image: int) -> int:
    if image >= len(tokens):
        raise ValueError(
            f"batch_prompts: the windows hold more image tokens than the {len(tokens)} images of "
            "the micro-batch's image_grid take; valid: a micro-batch as the loader makes it"
        )
    return tokens[image]


def eval_prompts(batches, count: int, max_prompt: int = DEFAULT_PROMPT_TOKENS) -> list[Prompt]:
    """The prompts of the eval split's first `count` windows (a trainer.data Batches), with their
    images when the split has some. Every rank reads the same windows (as rank 0 of a world of
    one): they must feed the same tokens and the same pixels."""
    if count <= 0:
        return []
    mb = batches.fixed_micro_batches(count, 0, 1, count)[0]
    images = getattr(batches, "images", None)  # trainer.data's Images: None without images
    if images is None:
        return batch_prompts(mb, count, max_prompt)
    merge = images.processing.merge_size
    return batch_prompts(mb, count, max_prompt, images.pad_id, merge)


def sample_text(
    model: nn.Module,
    tokenizer: Union[dict, Text],
    prompts: list[Union[Prompt, list[int]]],
    max_new_tokens: int = 48,
    *,
    world: int = 1,
    step: Optional[int] = None,
    stop_ids: Optional[list[int]] = None,
) -> str:
    """Greedy generations for `prompts`, as a text block: per prompt, its text, then the
    generation's. Every rank of the engine must call it with the same prompts (each forward
    is collective); each returns the same text. `tokenizer`: the run's tokenizer dict
    (PreparedData.tokenizer_info()) or a Text; its stop ids unless `stop_ids` is given. A
    Prompt's images go with it; a prompt's runs of <|image_pad|> are shown as one, with a count."""
    text = tokenizer if isinstance(tokenizer, Text) else text_of_info(tokenizer)
    stops = text.stop_ids if stop_ids is None else list(stop_ids)
    title = f"step {step}: " if step is not None else ""
    lines = [f"# {title}{len(prompts)} prompts, greedy, up to {max_new_tokens} new tokens"]
    for n, prompt in enumerate(prompts, 1):
        images = prompt.images if isinstance(prompt, Prompt) else {}
        ids = generate_ids(model, prompt, max_new_tokens, stops, world=world, **images)
        ended = "ended its turn" if ids and ids[-1] in stops else "did not end its turn"
        held = f", {len(images['image_grid'])} image(s)" if images else ""
        lines += [
            "",
            f"## sample {n}",
            f"### prompt ({len(prompt)} tokens{held})",
            _collapsed(_shown(text, prompt, keep_stop=True)),
            f"### generated ({len(ids)} tokens, {ended})",
            _shown(text, ids),
        ]
    return "\n".join(lines) + "\n"


def _shown(text: Text, ids: list[int], keep_stop: bool = False) -> str:
    """The text of ids (ids themselves without a readable tokenizer)."""
    if text.codec is None:
        return " ".join(map(str, ids))
    return text.codec.decode(ids) if keep_stop else text.decode(ids)


def _collapsed(shown: str) -> str:
    """Each run of image pads as one with its count: an image is hundreds of them."""
    pad = re.escape(IMAGE_PAD)
    return re.sub(f"(?:{pad})+", lambda m: f"{IMAGE_PAD}x{len(m[0]) // len(IMAGE_PAD)}", shown)


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)
