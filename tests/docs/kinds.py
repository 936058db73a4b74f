"""What the docs test does with each kind of block (blocks.py's KINDS): run it, or check what
can be checked of it without a cluster, a GPU or a second run of an existing test."""

from __future__ import annotations

import importlib.util
import re
from concurrent.futures import ThreadPoolExecutor

from tests.docs import rewrite
from tests.docs.blocks import REPO, Block, commands
from tests.docs.sandbox import Sandbox

COMPOSE_THREADS = 2  # `--cfg job` runs are a Python start-up each: two at a time on two cores


def run_sh(block: Block, sandbox: Sandbox) -> None:
    """Every command, in order, as printed (rewrite.py's table), each exiting 0."""
    for n, argv in enumerate(_spelled(block), start=1):
        if argv[0] == "make":
            assert argv[1:2] == ["run"], (
                f"{block.where}: `make {argv[1]}` cannot run inside the suite: tag the block"
            )
        stem = block.doc.removeprefix("docs/").removesuffix(".md")
        ran = sandbox.run(sandbox.prepared(argv, run_name=f"{stem}-{block.number}-{n}"))
        assert ran.returncode == 0, f"{block.where}: {ran.report()}"


def run_python(block: Block, sandbox: Sandbox) -> None:
    script = sandbox.root / f"{block.doc.replace('/', '-')}-{block.number}.py"
    script.write_text(block.text)
    ran = sandbox.run([str(rewrite.VENV_BIN / "python"), str(script)])
    assert ran.returncode == 0, f"{block.where}: {ran.report()}"


def run_server(block: Block, sandbox: Sandbox) -> None:
    for argv in _spelled(block):
        ran = sandbox.serve(sandbox.prepared(argv, run_name=""))
        assert ran.returncode == 0, f"{block.where}: never answered HTTP: {ran.report()}"


def check_cluster(block: Block, sandbox: Sandbox) -> None:
    """Each tool and module named exists; each training or preparation composes (--cfg job);
    the entrypoint after `--` is the cluster's `python`."""
    jobs = []
    for argv in _spelled(block):
        jobs += _checked_parts(block, argv, sandbox)
    _compose(block, jobs, sandbox)


def check_gpu(block: Block, sandbox: Sandbox) -> None:
    """As check_cluster, but a bare GPU machine's python3 (or a serving CLI) may start a line."""
    jobs = []
    for command in commands(block):
        argv = rewrite.split(command)
        assert argv[0] != "python", f"{block.where}: `{command}`: {rewrite.SPELLING}"
        jobs += _checked_parts(block, argv, sandbox)
    _compose(block, jobs, sandbox)


def check_tested_by(block: Block, sandbox: Sandbox) -> None:
    """The test file exists and holds every override of the block's training commands (so the
    two cannot drift apart); each command composes."""
    path = REPO / block.tested_by
    assert path.is_file(), f"{block.where}: tested-by={block.tested_by}: no such file"
    test_text = path.read_text()
    jobs = []
    for argv in _spelled(block):
        if argv[0] == "make":
            argv = rewrite.make_to_python(argv)
            if argv is None:
                continue  # another target: the Makefile has it (make_to_python checked)
        if rewrite.module_of(argv) != "cluster.train":
            continue
        missing = [o for o in rewrite.overrides(argv) if not _in_test(o, test_text)]
        if rewrite.is_sweep(argv) and '"-m"' not in test_text:
            missing.append("-m")
        assert not missing, f"{block.where}: {block.tested_by} does not run {missing}"
        jobs += rewrite.composed(sandbox.composable(argv))
    _compose(block, jobs, sandbox)


def _spelled(block: Block) -> list[list[str]]:
    """The block's commands, split; each must start with a local tool (rewrite.SPELLING)."""
    out = []
    for command in commands(block):
        argv = rewrite.split(command)
        assert argv[0] in rewrite.LOCAL_TOOLS, f"{block.where}: `{command}`: {rewrite.SPELLING}"
        out.append(argv)
    return out


def _checked_parts(block: Block, argv: list[str], sandbox: Sandbox) -> list[list[str]]:
    """Check the command and its entrypoint; the `--cfg job` runs they call for."""
    if argv[0] == "make":
        argv = rewrite.make_to_python(argv) or argv
    if argv[0].startswith(".venv/bin/"):
        tool = rewrite.VENV_BIN / argv[0].removeprefix(".venv/bin/")
        assert tool.exists(), f"{block.where}: {argv[0]}: not installed by make run"
    entry = rewrite.entrypoint(argv)
    if entry is not None:
        assert entry[0] == "python", (
            f"{block.where}: `{' '.join(entry)}` runs on the cluster: its python is `python`"
        )
    jobs = []
    for part in (argv, entry):
        module = rewrite.module_of(part or [])
        if module is None:
            continue
        assert importlib.util.find_spec(module) is not None, f"{block.where}: no module {module}"
        if module in rewrite.COMPOSED:
            jobs += rewrite.composed(sandbox.composable(part))
    return jobs


def _compose(block: Block, jobs: list[list[str]], sandbox: Sandbox) -> None:
    with ThreadPoolExecutor(COMPOSE_THREADS) as pool:
        for ran in pool.map(sandbox.run, jobs):
            assert ran.returncode == 0, f"{block.where}: does not compose: {ran.report()}"


def _in_test(override: str, test_text: str) -> bool:
    """`key=` is in the test; for a config group (no dot: sharding=, model=) each value too."""
    key, values = override.split("=", 1)
    if f"{key}=" not in test_text:
        return False
    words = values.split(",")
    return "." in key or all(re.search(rf"\b{re.escape(v)}\b", test_text) for v in words)


RUNNERS = {
    "sh": run_sh,
    "python": run_python,
    "sh server": run_server,
    "sh cluster": check_cluster,
    "sh gpu": check_gpu,
    "sh tested-by": check_tested_by,
    "text": lambda block, sandbox: None,
}
RUN_IN_ORDER = ("sh", "python")  # blocks whose files the doc's later blocks may read
