"""Tensor names and the rotary layout: how a family's Hugging Face tensors map onto ours.

A family's table pairs each Hugging Face name with ours, `{i}` standing for a block index:

    names = NameMap([("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight")])
    names.hf("layers.3.feed_forward.w3.weight")   # 'model.layers.3.mlp.up_proj.weight'
    names.ours("model.rotary_emb.inv_freq")       # None: our model has no such tensor

Layout: our rotary embedding rotates interleaved pairs of each head's dimensions (Meta's layout,
dims 2i and 2i+1); transformers rotates the two halves (i and i + head_dim/2). The rows of the
query and key projections are permuted between the two (`rotary_rows`), exactly as transformers'
own Llama conversion does, so both compute the same attention; so are the entries of their
biases (Qwen2) and of the per-head query/key norms (Qwen3), which act on the same dimensions.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


def _translate(name: str, table: list[tuple[re.Pattern, str]]) -> Optional[str]:
    for pattern, template in table:
        m = pattern.match(name)
        if m:
            return template.replace("{i}", m.group(1)) if m.groups() else template
    return None


class NameMap:
    """A family's (Hugging Face name, our name) table, translated either way."""

    def __init__(self, table: list[tuple[str, str]]):
        self.table = table
        self._to_ours = [(_pattern(h), o) for h, o in table]
        self._to_hf = [(_pattern(o), h) for h, o in table]

    def hf(self, fqn: str) -> str:
        """The Hugging Face name of our parameter fqn; KeyError when the family has none."""
        name = _translate(fqn, self._to_hf)
        if name is None:
            raise KeyError(f"no Hugging Face name for parameter {fqn!r}")
        return name

    def ours(self, name: str) -> Optional[str]:
        """Our parameter for a Hugging Face tensor name; None when the model has no such tensor."""
        return _translate(name, self._to_ours)


def rotary_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """perm[r] = the Hugging Face row of our row r of a query or key projection: within each
    head, our row 2i + j is transformers' row j * head_dim / 2 + i."""
    half = head_dim // 2
    r = np.arange(n_heads * head_dim)
    h, m = np.divmod(r, head_dim)
    i, j = np.divmod(m, 2)
    return h * head_dim + j * half + i


ROTARY = (
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wq.bias",
    "attention.wk.bias",
    "attention.q_norm.weight",
    "attention.k_norm.weight",
)
"""Our parameters whose rows are in rotary layout. The projections' biases are permuted as
their rows are; a query/key norm's weight (one head's head_dim entries, applied to every head
before the rotation) is permuted as one head's rows (RMS itself does not see the order)."""


def is_rotary(fqn: str) -> bool:
    """Our parameters whose rows are in rotary layout (ROTARY): with head_size rows a head,
    `rotary_rows(rows // head_size, head_size)` maps them, whatever their shape."""
    return fqn.endswith(ROTARY)
