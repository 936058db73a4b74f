"""A mixture's stacked experts in a Hugging Face checkpoint: one of our tensors, many of theirs.

Ours: `layers.{i}.moe.experts.w1` [E, F, D] (and w3; w2 [E, D, F]), each expert's rows as its
nn.Linear. A folder holds them in one of two layouts (transformers 5 loads both):

- per expert, as published checkpoints store them (Qwen3-30B-A3B, Mixtral-8x7B) and transformers
  5's save_pretrained writes them: `model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [F, D]
  (Mixtral: `model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight`);
- fused, as transformers 5 holds them in memory: `model.layers.{i}.mlp.experts.gate_up_proj`
  [E, 2F, D] (gate rows first, then up) and `...experts.down_proj` [E, D, F].

Element (e, r) of ours (r: a row-major index inside expert e) is element r of expert e's
per-expert tensor, or element e P R + p R + r of the fused tensor where our tensor is part p
of P along its rows (gate 0 and up 1 of 2; down 0 of 1) and R = rows x columns of one expert:
a range of ours is a few contiguous byte ranges in either layout, one per expert it touches.
An export writes the per-expert layout with the family's published names.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Stacked:
    """How one of our stacked expert tensors is stored by a family."""

    ours: str
    """Our tensor, {i} the layer: "layers.{i}.moe.experts.w1"."""
    per_expert: tuple[str, ...]
    """The per-expert names, {i} the layer and {e} the expert; the first is what an export
    writes (the family's published name), the others are read too (Mixtral's `mlp.` spelling)."""
    fused: str
    """The fused tensor's name ({i}): "model.layers.{i}.mlp.experts.gate_up_proj"."""
    part: int = 0
    parts: int = 1
    """Ours is rows part x n .. (part + 1) x n of each expert's slice of the fused tensor."""


def _regex(template: str) -> re.Pattern:
    body = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile("^" + body + "$")


@dataclass(frozen=True)
class Hit:
    """A Hugging Face tensor name read as part of our stacked tensor `fqn`."""

    fqn: str
    layout: str  # "per_expert" or "fused"
    expert: Optional[int]  # per_expert: which
    stacked: Stacked


class StackedNames:
    """A family's stacked expert tensors, both layouts, both ways."""

    def __init__(self, entries: list[Stacked]):
        self.entries = entries
        self._per = [(_regex(t), s) for s in entries for t in s.per_expert]
        self._fused = [(_regex(s.fused), s) for s in entries]
        self._ours = [(_regex(s.ours), s) for s in entries]

    def match(self, name: str) -> list[Hit]:
        """Which of our stacked tensors a Hugging Face tensor holds part of (a fused gate_up:
        two of ours); empty for any other tensor."""
        for pattern, s in self._per:
            m = pattern.match(name)
            if m:
                return [Hit(s.ours.format(i=m["i"]), "per_expert", int(m["e"]), s)]
        return [
            Hit(s.ours.format(i=m["i"]), "fused", None, s)
            for pattern, s in self._fused
            if (m := pattern.match(name))
        ]

    def describe(self, fqn: str) -> str:
        """How a folder may name our stacked tensor (for an error: the first expert's name)."""
        s, layer = self.of(fqn)
        return f"{s.per_expert[0].format(i=layer, e=0)} (or {s.fused.format(i=layer)})"

    def of(self, fqn: str) -> Optional[tuple[Stacked, str]]:
        """(how it is stored, its layer) for our stacked tensor `fqn`; None for any other."""
        for pattern, s in self._ours:
            m = pattern.match(fqn)
            if m:
                return s, m["i"]
        return None

    def export_names(self, fqn: str, experts: int) -> list[str]:
        """The per-expert names an export writes for our stacked tensor, expert by expert."""
        s, layer = self.of(fqn)
        return [s.per_expert[0].format(i=layer, e=e) for e in range(experts)]


def expected_shape(hit: Hit, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a Hugging Face tensor must have when it is `hit` of our tensor of shape `ours`."""
    if hit.layout == "per_expert":
        return tuple(ours[1:])
    return (ours[0], ours[1] * hit.stacked.parts, *ours[2:])


@dataclass
class Source:
    """Where a folder keeps one of our stacked tensors: per expert (`names[e]`) or fused."""

    stacked: Stacked
    names: dict[int, str]
    """per_expert: expert -> the name found; fused: {-1: the fused tensor's name}."""

    @property
    def fused(self) -> bool:
        return -1 in self.names

    def ranges(self, shape: tuple[int, ...], start: int, count: int) -> list[tuple[str, int, int]]:
        """(name, start, count) of the contiguous pieces holding elements [start, start + count)
        of our tensor of `shape`, in order."""
        per = math.prod(shape[1:])  # elements of one expert
        out, at, end = [], start, start + count
        while at < end:
            e, r = divmod(at, per)
            n = min(end - at, per - r)
            if self.fused:
                s = self.stacked
                out.append((self.names[-1], e * s.parts * per + s.part * per + r, n))
            else:
                out.append((self.names[e], r, n))
            at += n
        return out
