"""What the docs test runs for a command the docs print: the rewrite table, each line with why.

    as printed                         run as                             why
    (the working directory)            the doc's sandbox, the repository  a command's files stay
                                       root on PYTHONPATH                 there; `python -m` from
                                                                          the root imports the
                                                                          checkout (benchmarks/)
    .venv/bin/TOOL ...                 <repo>/.venv/bin/TOOL ...          the docs run from the
                                                                          repository root, the test
                                                                          from its sandbox
    make run ARGS="A B"                .venv/bin/python -m cluster.train  the Makefile's recipe
                                       A B                                (checked to be that)
    /an/absolute/path                  <sandbox>/an/absolute/path         the sandbox stands in for
                                                                          the machine; stand-ins
                                                                          (standins.py) live there
    .../checkpoints/step_000001000     .../checkpoints/<newest step>      a smoke run writes few
    ...  (an argument)                 dropped                            "your other arguments"
    a training command                 + SMOKE["cluster.train"]           tiny data, two steps; a
                                       + cluster.run_name=<block>-<n>     later key=value wins in
                                         when it names no run             Hydra; examples are
                                                                          independent runs
    benchmarks.checkpoint              + SMOKE["benchmarks.checkpoint"]   a 10 MB checkpoint
    mlflow ui (a server)               + --workers 1 --port <free port>   one server process, not
                                                                          the user's port 5000

A command the docs do not run here (```sh cluster, ```sh gpu, ```sh tested-by=...) is composed
instead: `python -m cluster.train|cluster.prepare ...` with `--cfg job` appended (Hydra prints
the config after the project's key check, so a misspelled key fails), one per job of a `-m`
sweep, with the same path rewrites.
"""

from __future__ import annotations

import itertools
import re
import shlex
import sys
from pathlib import Path

from tests.docs.blocks import REPO

# The docs' interpreter; a checkout without .venv (a bare GPU machine) has only this one.
VENV = REPO / ".venv" / "bin"
VENV_BIN = VENV if (VENV / "python").exists() else Path(sys.executable).parent
LOCAL_TOOLS = (".venv/bin/python", ".venv/bin/mlflow", ".venv/bin/ray", "make")
SPELLING = (
    "a command typed here starts with .venv/bin/python (or .venv/bin/mlflow, .venv/bin/ray, "
    "make): the docs run from the repository root, outside an activated venv (README, 'Two "
    "commands'); only a command run on the cluster (after `ray job submit ... --`) says python"
)
SMOKE = {
    "cluster.train": (
        "train.steps=2",
        "data.max_bytes=200000",
        "data.seq_len=64",
        "train.global_batch_size=2",
        "cluster.num_workers=1",
    ),
    "benchmarks.checkpoint": ("--size-gb", "0.01", "--rounds", "1"),
}
SERVER_ARGS = ("--workers", "1", "--port")  # the port follows
COMPOSED = ("cluster.train", "cluster.prepare")  # Hydra entry points: `--cfg job` composes them
MAKE_RUN_RECIPE = "$(PY) -m cluster.train $(ARGS)"
ABSOLUTE = re.compile(r"(^|[\s=,])/(?=[A-Za-z])")
STEP = re.compile(r"^(?P<root>.*/checkpoints)/step_\d{9}(?P<rest>/?.*)$")


def split(command: str) -> list[str]:
    """The arguments as the shell splits them, a trailing comment left out."""
    return shlex.split(command, comments=True)


def module_of(argv: list[str]) -> str | None:
    return argv[2] if len(argv) > 2 and argv[1] == "-m" else None


def entrypoint(argv: list[str]) -> list[str] | None:
    """What `ray job submit ... -- CMD` or `cluster.submit ... -- CMD` runs on the cluster."""
    return argv[argv.index("--") + 1 :] if "--" in argv else None


def is_training(argv: list[str]) -> bool:
    return module_of(argv) == "cluster.train" and "--cfg" not in argv


def is_sweep(argv: list[str]) -> bool:
    return "-m" in argv[3:] or "--multirun" in argv


def overrides(argv: list[str]) -> list[str]:
    """The Hydra key=value arguments of a cluster.train command."""
    return [a for a in argv[3:] if "=" in a and not a.startswith("-")]


def makefile_recipe(target: str) -> str | None:
    """The first recipe line of a Makefile target, None when the Makefile has no such target."""
    lines = (REPO / "Makefile").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"^{re.escape(target)}:", line):
            return lines[i + 1].strip() if i + 1 < len(lines) else ""
    return None


def make_to_python(argv: list[str]) -> list[str] | None:
    """`make run ARGS="..."` as the Makefile runs it; None for another target (checked to exist)."""
    target = argv[1] if len(argv) > 1 else ""
    recipe = makefile_recipe(target)
    assert recipe is not None, f"`{shlex.join(argv)}`: the Makefile has no target {target!r}"
    if target != "run":
        return None
    assert recipe == MAKE_RUN_RECIPE, f"make run's recipe changed: {recipe!r}"
    args = [a.removeprefix("ARGS=") for a in argv[2:] if a.startswith("ARGS=")]
    return [".venv/bin/python", "-m", "cluster.train", *(a for s in args for a in split(s))]


def in_sandbox(argv: list[str], sandbox: Path) -> list[str]:
    """Absolute paths moved under the sandbox; `...` dropped."""
    return [ABSOLUTE.sub(rf"\1{sandbox}/", a) for a in argv if a != "..."]


def newest_steps(argv: list[str], sandbox: Path) -> list[str]:
    return [_newest_step(a, sandbox) for a in argv]


def _newest_step(arg: str, sandbox: Path) -> str:
    m = STEP.match(arg.split("=", 1)[-1])
    if not m or not (sandbox / m["root"]).is_dir():
        return arg
    found = (sandbox / m["root"]).glob("step_*")
    steps = sorted(p.name for p in found if (p / "manifest.json").exists())
    assert steps, f"{arg}: no committed checkpoint under {m['root']}"
    return arg.replace(m.group(0), f"{m['root']}/{steps[-1]}{m['rest']}")


def with_tool(argv: list[str]) -> list[str]:
    """.venv/bin/TOOL as an absolute path (the test's cwd is the sandbox)."""
    if argv[0].startswith(".venv/bin/"):
        return [str(VENV_BIN / argv[0].removeprefix(".venv/bin/")), *argv[1:]]
    if argv[0] == "python":  # a cluster's entrypoint, composed here with the venv's interpreter
        return [str(VENV_BIN / "python"), *argv[1:]]
    return argv


def smoke_sized(argv: list[str], run_name: str) -> list[str]:
    module = module_of(argv)
    if module != "cluster.train":
        return [*argv, *SMOKE.get(module or "", ())]
    if not is_training(argv):
        return argv  # --cfg job: composes only
    named = is_sweep(argv) or any(a.startswith("cluster.run_name=") for a in argv)
    return [*argv, *SMOKE[module], *([] if named else [f"cluster.run_name={run_name}"])]


def composed(argv: list[str]) -> list[list[str]]:
    """`--cfg job` runs of a cluster.train|cluster.prepare command: one per job of a sweep (the
    swept values' product, `-m` and the sweep's own +sweep.* keys left out)."""
    if is_sweep(argv):
        args = [a for a in argv[3:] if a not in ("-m", "--multirun")]
        fixed = argv[:3] + [a for a in args if not a.startswith("+sweep.")]
        keyed = [(a.split("=", 1)[0], a.split("=", 1)[1].split(",")) for a in overrides(fixed)]
        head = [a for a in fixed if a not in overrides(fixed)]
        jobs = itertools.product(*[[f"{k}={v}" for v in vs] for k, vs in keyed])
        return [[*head, *job, "--cfg", "job"] for job in jobs]
    return [[*argv, "--cfg", "job"]]
