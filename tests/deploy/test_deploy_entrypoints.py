"""Every command deploy/ ships names the project's real module and real config keys.

A typo in a RayJob entrypoint (`train.step=...`, `cluster=rays`) costs a GPU cluster start-up to
find out. The dataclasses of cluster/config.py's JobConfig are the schema: each dotted override
must name a field and parse as its type; each group choice (`cluster=ray`) must be a
conf/<group>/<choice>.yaml, or for `model=` a preset of trainer.config.PRESETS; and Hydra itself
must compose the full command into a JobConfig that validates.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import typing

import pytest
import yaml
from deploy_helpers import (
    CONSOLE_SCRIPT,
    REPO_ROOT,
    TRAIN_MODULE,
    expand_sweep,
    overrides,
    python_modules,
    train_commands,
)
from hydra import compose, initialize_config_dir

from cluster.compose import register_schemas, to_job_config
from cluster.config import JobConfig
from trainer.config import PRESETS

PROJECT_PACKAGES = ("cluster", "trainer")
CONF_DIR = REPO_ROOT / "conf"


def _field_types(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _type_ok(value, hint) -> bool:
    """Would OmegaConf accept this parsed override value for a field of this type?"""
    if typing.get_origin(hint) is typing.Union:
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is str:
        return value is not None and not isinstance(value, (dict, list))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is bool:
        return isinstance(value, bool)
    return True


def override_problems(args: list[str]) -> list[str]:
    """Each override checked against JobConfig's fields and conf/; empty when all are real."""
    problems = []
    groups = {f.name: f.type for f in dataclasses.fields(JobConfig)}
    for key, raw in overrides(args).items():
        group, _, field = key.partition(".")
        if group not in groups:
            problems.append(f"{key}: no config group {group!r}; valid: {', '.join(groups)}")
        elif not field:
            if group == "model" and raw in PRESETS:  # the presets are Python, not YAML
                continue
            if not (CONF_DIR / group / f"{raw}.yaml").is_file():
                problems.append(f"{key}={raw}: conf/{group}/{raw}.yaml does not exist")
        else:
            hints = _field_types(type(getattr(JobConfig(), group)))
            if field not in hints:
                problems.append(f"{key}: {group} has no field {field!r}; valid: {', '.join(hints)}")
            elif not _type_ok(yaml.safe_load(raw), hints[field]):
                problems.append(f"{key}={raw}: not a valid {hints[field]}")
    return problems


def defaults_with_overrides(args: list[str]) -> JobConfig:
    """JobConfig defaults with the dotted overrides applied (group choices left out)."""
    cfg = JobConfig()
    for key, raw in overrides(args).items():
        group, _, field = key.partition(".")
        if field:
            setattr(getattr(cfg, group), field, yaml.safe_load(raw) if raw != "" else "")
    return cfg


def shipped_commands(rayjob, readme_commands) -> list[tuple[str, list[str]]]:
    found = [("rayjob.yaml", args) for args in train_commands(rayjob["spec"]["entrypoint"])]
    found += [("README.md", args) for args in train_commands(readme_commands)]
    return found


def test_rayjob_entrypoint_runs_the_train_module_on_ray(rayjob_overrides, rayjob):
    assert rayjob["spec"]["entrypoint"].startswith(f"python -m {TRAIN_MODULE} ")
    assert rayjob_overrides.get("cluster") == "ray"
    assert rayjob_overrides.get("tracking") == "server"


def test_python_modules_named_by_commands_exist(rayjob, readme_commands):
    modules = python_modules(rayjob["spec"]["entrypoint"]) + python_modules(readme_commands)
    assert TRAIN_MODULE in modules
    for module in set(modules):
        if module.split(".")[0] in PROJECT_PACKAGES:
            path = REPO_ROOT.joinpath(*module.split("."))
            assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), (
                f"`python -m {module}`: neither {path}.py nor {path}/__main__.py exists"
            )
        else:
            assert importlib.util.find_spec(module) is not None, (
                f"`python -m {module}`: not installed"
            )


def test_console_script_points_at_a_main_in_the_train_module():
    import tomllib  # noqa: PLC0415 -- Python 3.11+: on 3.10 only this test fails, not the module

    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[CONSOLE_SCRIPT] == f"{TRAIN_MODULE}:main"
    source = REPO_ROOT / "cluster" / "train.py"
    assert source.is_file(), f"{source} missing"
    tree = ast.parse(source.read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    names |= {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert "main" in names, f"{source} defines no top-level main for the {CONSOLE_SCRIPT} script"


def test_every_override_names_a_real_config_key(rayjob, readme_commands):
    commands = shipped_commands(rayjob, readme_commands)
    assert len(commands) >= 3, "expected the RayJob entrypoint and the README's runs"
    found = {f"{where}: {' '.join(args)}": override_problems(args) for where, args in commands}
    assert found == {k: [] for k in found}


def test_override_check_catches_typos_and_bad_values():
    problems = override_problems(
        [
            "train.step=5",
            "cluster=no_such_cluster",
            "trainer.steps=5",
            "train.steps=many",
            "cluster.min_workers=null",
            "cluster.use_gpu=yes!",
        ]
    )
    text = "\n".join(problems)
    assert "train has no field 'step'" in text
    assert "conf/cluster/no_such_cluster.yaml does not exist" in text
    assert "no config group 'trainer'" in text
    assert "train.steps=many: not a valid" in text
    assert "cluster.use_gpu=yes!: not a valid" in text
    assert "min_workers" not in text  # null is valid for an Optional[int]
    assert len(problems) == 5


def test_overrides_on_defaults_pass_job_config_validation(rayjob, readme_commands):
    """The values make sense together (elastic range, batch >= largest world), not just one by
    one."""
    for where, args in shipped_commands(rayjob, readme_commands):
        defaults_with_overrides(args).validate()


def test_hydra_composes_each_command_into_a_valid_job_config(rayjob, readme_commands):
    """The real thing: Hydra applies the overrides to conf/ under the JobConfig schema, exactly as
    cluster/train.py does, and the result validates."""
    assert (CONF_DIR / "config.yaml").is_file(), f"{CONF_DIR / 'config.yaml'} missing"
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for where, args in shipped_commands(rayjob, readme_commands):
            job = to_job_config(compose(config_name="config", overrides=args)).validate()
            for key, raw in overrides(args).items():
                group, _, field = key.partition(".")
                if field and "${" not in raw:  # the override reached the typed config
                    actual = getattr(getattr(job, group), field)
                    assert actual == yaml.safe_load(raw) or str(actual) == raw, (where, key, actual)


def test_each_run_of_a_sweep_has_its_own_run_name(readme_commands):
    """Runs of one --multirun share the storage path: with one run name, each would resume the
    previous run's checkpoint instead of training its own configuration."""
    sweeps = [
        args for args in train_commands(readme_commands, expand=False) if "--multirun" in args
    ]
    assert sweeps, "deploy/README.md should show a sharding sweep"
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for sweep in sweeps:
            runs = expand_sweep(sweep)
            names = {
                to_job_config(compose(config_name="config", overrides=r)).cluster.run_name
                for r in runs
            }
            assert len(names) == len(runs), f"{' '.join(sweep)}: run names {names} repeat"


@pytest.mark.parametrize(
    "text",
    [
        "python -m cluster.train a=1 b=2 && echo done",
        "ray job submit --working-dir . -- \\\n  python -m cluster.train a=1 \\\n  b=2",
    ],
)
def test_command_finder_reads_continuations_and_stops_at_shell_operators(text):
    assert train_commands(text) == [["a=1", "b=2"]]
