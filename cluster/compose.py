"""How Hydra composes the job's config: the schema in its ConfigStore, the model presets,
model=hf's shape read from its config.json, and the typed JobConfig out of the DictConfig.

    register_schemas()                                 # once per process, before Hydra composes
    cfg = to_job_config(dictcfg)                       # cluster/preflight.py checks it next

`register_schemas` stores JobConfig (cluster/config.py) in Hydra's ConfigStore as `job_schema`,
which conf/config.yaml lists first, so every YAML file and override is merged into a typed,
struct-mode JobConfig: an unknown key or a value of the wrong type fails in Hydra, before any
code of ours runs. The model presets (trainer.config.PRESETS) are registered as the `model`
group. Hydra stops at `to_job_config`: nothing below it sees a DictConfig.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import typing

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from cluster.config import JobConfig
from trainer.config import PRESETS, ConfigError, ModelConfig
from trainer.data.run_defaults import with_run_defaults

SCHEMA_NAME = "job_schema"

HF_RESOLVER = "hf_config"
"""model=hf's shape fields are `${hf_config:<field>}`: read from model.hf_path's config.json
when the config is resolved. `--cfg job` prints them so (where they come from), `--cfg job
--resolve` and the run itself the checkpoint's values."""
HF_OWN_FIELDS = ("name", "hf_path")
"""The fields of model=hf that are not config.json's."""


def register_schemas() -> None:
    """JobConfig as `job_schema` and every model preset as `model/<name>` in Hydra's ConfigStore
    (idempotent: Hydra replaces an entry of the same name); model=hf's shape as interpolations
    of the `hf_config` resolver."""
    store = ConfigStore.instance()
    schema = OmegaConf.structured(JobConfig)
    # A map whose keys the user chooses (module-name patterns): Hydra's struct mode would refuse
    # every key `sharding.modules={tok_embeddings:no_shard}` adds; its values stay typed (str).
    OmegaConf.set_struct(schema.sharding.modules, False)
    store.store(name=SCHEMA_NAME, node=schema)
    for name, preset in PRESETS.items():
        store.store(group="model", name=name, node=hf_preset() if name == "hf" else preset)
    OmegaConf.register_new_resolver(HF_RESOLVER, hf_config_field, replace=True)


def hf_preset() -> DictConfig:
    """PRESETS["hf"] with every field config.json sets as `${hf_config:<field>}`."""
    node = OmegaConf.structured(PRESETS["hf"])
    for f in dataclasses.fields(ModelConfig):
        if f.name not in HF_OWN_FIELDS:
            node[f.name] = f"${{{HF_RESOLVER}:{f.name}}}"
    return node


def hf_config_field(key: str, *, _parent_) -> object:
    """The resolver: field `key` of the model node's hf_path's config.json (as our ModelConfig);
    the preset's own value while hf_path is unset (validate() then names model.hf_path)."""
    path = _parent_.get("hf_path")
    if not path:
        return getattr(PRESETS["hf"], key)
    return _hf_model(path)[key]


@functools.lru_cache(maxsize=8)
def _hf_model(path: str) -> dict:
    """The ModelConfig fields of the checkpoint at `path`, read once per to_job_config (it
    clears this cache) however many fields refer to them."""
    from trainer.hf import resolve_model  # noqa: PLC0415 -- torch: only for model=hf

    return dataclasses.asdict(resolve_model(ModelConfig(name="hf", hf_path=path)))


def unknown_key(prefix: str, key: str, valid: list[str]) -> ConfigError:
    """The error of a key `prefix + key` that the schema does not have: the closest valid key
    first ("did you mean"), then every valid key of its section."""
    section = prefix.rstrip(".") or "the top level"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
    return ConfigError(
        f"invalid config: unknown key {prefix}{key}{hint}; valid keys of {section}: "
        f"{', '.join(valid)}"
    )


GROUPS = ("model", "sharding", "optim", "data", "cluster", "tracking")
"""conf/'s config groups: `group=option` picks a file (or a model preset), not a key."""


def check_override_keys(overrides: list[str], own: tuple[str, ...] = ()) -> None:
    """Each `key=value` on the command line (also `+key`, `++key`, `~key`) names a key of the
    schema, or a ConfigError names the closest one, before Hydra composes anything (Hydra's own
    answer to `train.stpes=10` is advice to append it with `+`). Options (-m, --cfg ...), group
    choices (`sharding=no_shard`), hydra.* and sweep.* keys, and a command's `own` keys pass;
    inside a map of the user's keys (sharding.modules) any key passes."""
    for arg in overrides:
        key, sep, _ = arg.partition("=")
        key = key.lstrip("+~")
        if arg.startswith("-") or not sep or key in GROUPS or key in own:
            continue
        if key.split(".")[0] in ("hydra", "sweep"):
            continue
        schema, prefix = JobConfig, ""
        for part in key.split("."):
            fields = {f.name: f for f in dataclasses.fields(schema)}
            if part not in fields:
                raise unknown_key(prefix, part, list(fields))
            hint = typing.get_type_hints(schema)[part]
            if not dataclasses.is_dataclass(hint):
                break  # a value (or a map whose keys the user chooses)
            schema, prefix = hint, f"{prefix}{part}."


def overrides_or_exit(overrides: list[str]) -> None:
    """check_override_keys, or the error line and exit 2 (nothing has started)."""
    try:
        check_override_keys(overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def to_job_config(dictcfg: DictConfig) -> JobConfig:
    """The composed DictConfig as plain dataclasses; Hydra stops here and nothing below sees it.

    Hydra's `+key=value` adds a key even to a typed node, and OmegaConf.to_object then drops it
    without a word; such a key is refused here instead, listing the valid ones. A ConfigError
    raised while resolving (model=hf's config.json) is raised as itself, not wrapped.
    """
    check_known_keys(dictcfg, JobConfig)
    _hf_model.cache_clear()
    try:
        job = OmegaConf.to_object(dictcfg)
    except InterpolationResolutionError as e:
        cause = e.__context__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__context__
        if cause is None:
            raise
        raise cause from None
    if not isinstance(job, JobConfig):
        raise TypeError(
            f"composed config is {type(job).__name__}, not JobConfig: "
            f"conf/config.yaml must list '{SCHEMA_NAME}' first in its defaults"
        )
    return with_run_defaults(job)  # what data.* leaves to the rest of the job


def check_known_keys(node: DictConfig, schema: type, prefix: str = "") -> None:
    """Raise ConfigError for the first key of `node` that is not a field of dataclass `schema`."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields:
            raise unknown_key(prefix, str(key), list(fields))
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            check_known_keys(child, OmegaConf.get_type(child), f"{prefix}{key}.")
