"""A sweep's repeats, in rotation: `+sweep.repeats=K` runs every job K times, and
`+sweep.interleave` says in which order (cluster/sweep.py's docstring tells why rotation).

    repeats = repeats_of(config)          # Repeats(count, interleave), or exit 2 naming the key
    apply_repeats(config, repeats)        # before Hydra's sweeper reads the overrides
    repeat_indices(jobs, keys)            # per job: which repeat of its configuration it is
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from cluster.job_slot import job_label

DEFAULT_REPEATS = 3
"""Repeats of `+sweep.interleave=true` without `+sweep.repeats`."""


@dataclass(frozen=True)
class Repeats:
    """How often each job runs (+sweep.repeats) and in which order (+sweep.interleave)."""

    count: int = 1
    interleave: bool = True

    def describe(self) -> str:
        if self.count == 1:
            return "each job once"
        order = "in rotation" if self.interleave else "back to back"
        return f"each job {self.count} times, {order}"


def repeats_of(config: DictConfig) -> Repeats:
    """+sweep.repeats / +sweep.interleave of the command line (or a `sweep:` config section),
    or exit 2 naming the key, the value and what is valid."""
    count = OmegaConf.select(config, "sweep.repeats", default=None)
    interleave = OmegaConf.select(config, "sweep.interleave", default=None)
    if interleave is not None and not isinstance(interleave, bool):
        _refuse("sweep.interleave", interleave, "true or false")
    if count is None:
        count = DEFAULT_REPEATS if interleave else 1
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        _refuse("sweep.repeats", count, "a positive integer (how often each job runs)")
    return Repeats(count, interleave if interleave is not None else True)


def _refuse(key: str, value: object, valid: str) -> None:
    print(f"error: invalid config: {key}={value!r}; valid: {valid}", file=sys.stderr)
    sys.exit(2)


def apply_repeats(config: DictConfig, repeats: Repeats) -> None:
    """Take the sweep.* overrides out of the jobs' overrides and, for repeats, rewrite one swept
    list so that Hydra's basic sweeper (the product of the swept lists, the last varying
    fastest) runs every job `repeats.count` times: the first list repeated whole for rounds of
    every job, or each value of the last list repeated for back-to-back repeats."""
    task = [o for o in config.hydra.overrides.task if not _is_sweep_setting(o)]
    if repeats.count > 1:
        task = _repeated(config, task, repeats)
    with read_write(config), open_dict(config):
        config.hydra.overrides.task = task


def _is_sweep_setting(override: str) -> bool:
    return override.lstrip("+~").split("=", 1)[0].startswith("sweep.")


def _repeated(config: DictConfig, task: list[str], repeats: Repeats) -> list[str]:
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    if params:
        print(
            "error: invalid config: sweep.repeats with hydra.sweeper.params; valid: the swept "
            "lists on the command line (sharding=a,b +sweep.repeats=3)",
            file=sys.stderr,
        )
        sys.exit(2)
    swept = [i for i, o in enumerate(parser.parse_overrides(task)) if o.is_sweep_override()]
    if not swept:
        _refuse("sweep.repeats", repeats.count, "1 for a sweep without a swept list (a,b)")
    at = swept[0] if repeats.interleave else swept[-1]
    override = parser.parse_overrides([task[at]])[0]
    values = list(override.sweep_string_iterator())
    if repeats.interleave:
        values = values * repeats.count
    else:
        values = [v for v in values for _ in range(repeats.count)]
    task = list(task)
    task[at] = task[at].split("=", 1)[0] + "=" + ",".join(values)
    return task


def repeat_indices(jobs: list[list[str]], keys: list[str]) -> list[int]:
    """Per job, how many earlier jobs had the same swept values: its repeat, from 0."""
    seen: dict[str, int] = {}
    out = []
    for overrides in jobs:
        label = job_label(overrides, keys)
        out.append(seen.get(label, 0))
        seen[label] = out[-1] + 1
    return out
