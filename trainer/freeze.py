"""train.freeze: the parameters that do not train, named by fnmatch patterns.

    frozen = freeze(model, ["visual.*", "layers.0"])   # requires_grad_(False) on what they name
    print0(frozen.describe())

A pattern names a parameter when it matches the parameter's name ("layers.0.attention.wq.weight")
or the name of a module holding it ("layers.0", "layers.0.attention"); `*` crosses dots, so
"visual.*" names the whole vision tower. trainer/build.py freezes on the plain model, before
anything wraps it: the engine then gives the frozen parameters flats of their own
(trainer/fsdp/wrap.py), which get no gradient, no reduce-scatter and no optimizer state, and
the planner, building the same way, prices them so. A pattern that names nothing is refused
with the model's top-level modules (a typo would otherwise train what was meant to stay).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from trainer.fsdp.config import ConfigError


@dataclass(frozen=True)
class Frozen:
    """What train.freeze froze in one model."""

    patterns: tuple[str, ...]
    tensors: int
    """Parameter tensors frozen."""
    params: int
    """Their elements."""
    total_tensors: int
    total_params: int
    by_pattern: tuple[tuple[str, int, int], ...] = ()
    """(pattern, tensors, elements) each pattern froze (a tensor counted under the first)."""

    @property
    def trainable(self) -> int:
        return self.total_params - self.params

    def describe(self) -> str:
        """One line for the log: what is frozen, what trains."""
        if not self.patterns:
            return f"train.freeze: nothing frozen ({self.total_params:,} parameters train)"
        each = ", ".join(f"{p}: {t} tensors, {n:,}" for p, t, n in self.by_pattern)
        return (
            f"train.freeze: {self.tensors} of {self.total_tensors} tensors frozen "
            f"({self.params:,} of {self.total_params:,} parameters; {self.trainable:,} train) "
            f"[{each}]"
        )


def freeze(model: torch.nn.Module, patterns: list[str] | tuple[str, ...]) -> Frozen:
    """requires_grad_(False) on every parameter a pattern names (module docstring); ConfigError
    for a pattern that names none, listing the model's top-level modules, and for patterns that
    leave nothing to train. Works on the meta device (the planner's build): only names and
    shapes are read."""
    patterns = tuple(patterns)
    named = list(model.named_parameters())
    counts = {p: [0, 0] for p in patterns}
    for name, param in named:
        pattern = next((p for p in patterns if _names(p, name)), None)
        if pattern is None:
            continue
        param.requires_grad_(False)
        counts[pattern][0] += 1
        counts[pattern][1] += param.numel()
    unused = [p for p in patterns if not counts[p][0]]
    if unused:
        raise ConfigError(
            f"invalid config: train.freeze pattern {unused[0]!r} names no parameter of this "
            f"model; valid: fnmatch patterns over parameter or module names under its "
            f"top-level modules {top_level(model)} (e.g. 'layers.0', 'layers.0.*')"
        )
    if named and all(not p.requires_grad for _, p in named):
        raise ConfigError(
            f"invalid config: train.freeze={list(patterns)!r} freezes every parameter of this "
            "model: nothing would train; valid: patterns that leave some parameters trainable"
        )
    frozen = [(t, n) for t, n in counts.values()]
    return Frozen(
        patterns=patterns,
        tensors=sum(t for t, _ in frozen),
        params=sum(n for _, n in frozen),
        total_tensors=len(named),
        total_params=sum(p.numel() for _, p in named),
        by_pattern=tuple((p, *counts[p]) for p in patterns),
    )


def _names(pattern: str, param_name: str) -> bool:
    """`pattern` names the parameter itself or one of the modules holding it."""
    parts = param_name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(len(parts), 0, -1))


def top_level(model: torch.nn.Module) -> str:
    """The model's child modules that hold parameters, and its own parameters: "tok_embeddings,
    layers (layers.0 .. layers.3), norm, output"."""
    out = []
    for name, child in model.named_children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, torch.nn.ModuleList) and len(child):
            name = f"{name} ({name}.0 .. {name}.{len(child) - 1})"
        out.append(name)
    out += [n for n, _ in model.named_parameters(recurse=False)]
    return ", ".join(out) or "(none)"
