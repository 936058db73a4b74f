"""The data options of conf/data/ (data=chat, data=jsonl, ...) for the commands of trainer/data,
composed as Hydra composes them for training: DataConfig's defaults, then conf/data/<name>.yaml,
then the `data.<key>=<value>` arguments. So `python -m trainer.data prepare data=chat ...`
prepares exactly what `python -m cluster.train data=chat ...` reads (the same digest), and
conf/data/chat.yaml is the one home of the chat defaults for both.

    cfg = data_config(["data=chat", "data.source=sft.jsonl", "data.tokenizer=tok.json"])

trainer/ stays free of Hydra: an option's file is plain YAML of DataConfig's fields (Hydra
checks the same files against the same dataclass through cluster/config.py's JobConfig;
tests/data/test_data_groups.py holds the two to the same result for every option). Without
`data=<name>` the fields start from DataConfig's defaults, except that `data.kind=chat` takes
data=chat's (a chat preparation with other defaults would be another preparation).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path

import yaml

from trainer.config import ConfigError, DataConfig, SourceConfig

CONF_DATA = Path(__file__).resolve().parents[2] / "conf" / "data"
"""conf/data/: the options of the `data` group (cluster/train.py reads conf/ from here too)."""
GROUP = "data"
OPTION_OF_KIND = {"chat": "chat"}
"""data.kind=<kind> without data=<name> composes this option."""
KIND_TEXT = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def data_config(args: list[str]) -> DataConfig:
    """The validated DataConfig of `data=<name>` and `data.<key>=<value>` arguments."""
    cfg = compose(args)
    cfg.validate()
    return cfg


def compose(args: list[str]) -> DataConfig:
    """DataConfig's defaults, then the option's file, then the assignments (typed by the
    dataclass's fields); a ConfigError naming the argument and what is valid."""
    options = [a.partition("=")[2] for a in args if a.partition("=")[0] == GROUP]
    assignments = [a for a in args if a.partition("=")[0] != GROUP]
    if len(options) > 1:
        raise ConfigError(
            f"invalid argument data={options[1]}: data={options[0]} is given too; valid: one "
            f"data=<option> of {', '.join(option_names())}"
        )
    values = {}
    for arg in assignments:
        name, value = _assignment(arg)
        values[name] = value
    option = options[0] if options else OPTION_OF_KIND.get(values.get("kind"))
    base = option_values(option) if option else {}
    return DataConfig(**{**base, **values})


def option_names() -> list[str]:
    return sorted(p.stem for p in CONF_DATA.glob("*.yaml"))


def option_values(option: str) -> dict:
    """The fields conf/data/<option>.yaml sets, typed as DataConfig's."""
    path = CONF_DATA / f"{option}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"invalid argument data={option}: no {path}; valid: data=<one of "
            f"{', '.join(option_names())}>"
        )
    loaded = yaml.safe_load(path.read_text()) or {}
    hints = typing.get_type_hints(DataConfig)
    values = {}
    for name, value in loaded.items():
        if name not in hints:
            raise ConfigError(
                f"invalid config: {path} sets {name!r}, which is not a field of DataConfig; "
                f"valid: {', '.join(hints)}"
            )
        values[name] = _checked(name, value, hints[name], str(path))
    return values


def _checked(name: str, value, hint, where: str):
    """A YAML value as the field's type (an int where a float is asked is one, as in Hydra)."""
    if name == "mix":
        return [SourceConfig(**m) for m in value or []]
    if value is None and typing.get_origin(hint) is typing.Union:
        return None
    kind = next(t for t in (bool, int, float, str) if hint in (t, typing.Optional[t]))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"invalid config: data.{name}={value!r} in {where}; valid: {KIND_TEXT[kind]}"
        )
    return value


def _assignment(arg: str) -> tuple[str, object]:
    """(field name, typed value) of a `data.<key>=<value>` argument."""
    hints = typing.get_type_hints(DataConfig)
    key, sep, value = arg.partition("=")
    name = key.removeprefix("data.")
    if not sep or not key.startswith("data.") or name not in hints or name == "mix":
        names = [f.name for f in dataclasses.fields(DataConfig) if f.name != "mix"]
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6) if sep else []
        hint = f" (did you mean data.{close[0]}?)" if close else ""
        raise ConfigError(
            f"invalid argument {arg!r}{hint}; valid: data.<key>=<value> with a key of "
            f"{', '.join(f'data.{n}' for n in names)}, and data=<option> (one of "
            f"{', '.join(option_names())})"
        )
    return name, _typed(name, value, hints[name])


def _typed(name: str, value: str, hint):
    kind = next((t for t in (int, float, bool) if hint in (t, typing.Optional[t])), str)
    if value in ("null", "None") and typing.get_origin(hint) is typing.Union:
        return None
    try:
        return {"true": True, "false": False}[value.lower()] if kind is bool else kind(value)
    except (ValueError, KeyError):
        raise ConfigError(
            f"invalid config: data.{name}={value!r}; valid: {KIND_TEXT[kind]}"
        ) from None
