"""deploy/docker/Dockerfile: a Ray GPU image with the project installed, and a lean build context.

The static checks run everywhere. The build itself needs a Docker engine (this project's CI
machines have the client only) and pulls several GB, so it is a slow test that skips, saying why,
when `docker info` cannot reach an engine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version

import pytest
from deploy_helpers import DEPLOY_DIR, REPO_ROOT

DOCKERFILE = DEPLOY_DIR / "docker" / "Dockerfile"
# BuildKit (Docker >= 23) reads <Dockerfile>.dockerignore for the context of that Dockerfile.
DOCKERIGNORE = DEPLOY_DIR / "docker" / "Dockerfile.dockerignore"
NEVER_SHIPPED = (
    ".venv/bin/python",
    ".git/HEAD",
    "runs/elastic-fsdp/checkpoints/step_20/manifest.json",
    "outputs/2026-01-01/12-00-00/.hydra/config.yaml",
    "multirun/2026-01-01/0/x.log",
    "data/prepared/shard_00000.parquet",
    "mlruns/0/meta.yaml",
    "mlflow.db",
    "mlartifacts/1/x.txt",
    "cluster/__pycache__/train.cpython-311.pyc",
    "trainer/fsdp/__pycache__/flat.cpython-311.pyc",
    "elastic_fsdp.egg-info/PKG-INFO",
    ".pytest_cache/v/cache/nodeids",
    ".whl/torch.whl",
    ".gl/x",
)
ALWAYS_SHIPPED = (
    "pyproject.toml",
    "README.md",
    "cluster/train.py",
    "trainer/config.py",
    "trainer/data/__init__.py",
    "trainer/fsdp/flat_param.py",
    "conf/config.yaml",
    "conf/data/stdlib.yaml",
    "deploy/README.md",
)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuations joined, comments
    dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def arg_defaults(instrs) -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in instrs if i == "ARG" and "=" in a)


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def _pattern_regex(pattern: str) -> re.Pattern:
    """One .dockerignore pattern as a regex, with Docker's rules: '**' any depth, '*' and '?'
    within one path element, anchored at the context root."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(f"^{out}$")


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """True if Docker leaves `path` out of the context: it, or a folder above it, matches."""
    regexes = [_pattern_regex(p.strip().lstrip("/").rstrip("/")) for p in patterns]
    parts = path.split("/")
    return any(r.match("/".join(parts[:n])) for r in regexes for n in range(1, len(parts) + 1))


def _ignore_patterns() -> list[str]:
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions (!) are beyond this check"
    return patterns


def test_builds_on_the_ray_gpu_image_of_the_projects_ray_and_python():
    instrs = instructions(DOCKERFILE.read_text())
    froms = [substitute(a, arg_defaults(instrs)) for i, a in instrs if i == "FROM"]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert froms == [f"rayproject/ray:{version('ray')}-{py}-gpu"], froms


def test_installs_cuda_torch_of_the_projects_version_then_the_project():
    instrs = instructions(DOCKERFILE.read_text())
    args = arg_defaults(instrs)
    assert args["TORCH_VERSION"] == version("torch").split("+")[0]
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX"]), args[
        "TORCH_INDEX"
    ]
    runs = [substitute(a, args) for i, a in instrs if i == "RUN"]
    torch_run = [
        n
        for n, r in enumerate(runs)
        if f"torch=={args['TORCH_VERSION']}" in r and args["TORCH_INDEX"] in r
    ]
    project_run = [n for n, r in enumerate(runs) if re.search(r"pip install (-e )?\.(\s|$)", r)]
    assert torch_run and project_run and torch_run[0] < project_run[0], (
        "install CUDA torch first (its own layer), then the project, which must not replace it"
    )
    copies = [
        n for n, (i, a) in enumerate(instrs) if i == "COPY" and re.search(r"(^|\s)\.\s", a + " ")
    ]
    project_at = [
        n
        for n, (i, a) in enumerate(instrs)
        if i == "RUN" and re.search(r"pip install (-e )?\.(\s|$)", a)
    ]
    assert copies and copies[0] < project_at[0], "COPY the source before installing it"


def test_never_copies_the_venv_and_the_context_leaves_run_outputs_out():
    instrs = instructions(DOCKERFILE.read_text())
    for i, a in instrs:
        if i in ("COPY", "ADD"):
            assert ".venv" not in a and "mlruns" not in a, f"{i} {a}"
    patterns = _ignore_patterns()
    leaked = [p for p in NEVER_SHIPPED if not dockerignore_excludes(patterns, p)]
    lost = [p for p in ALWAYS_SHIPPED if dockerignore_excludes(patterns, p)]
    assert leaked == [] and lost == []


def test_dockerignore_matcher_follows_docker_rules():
    assert dockerignore_excludes(["**/__pycache__"], "a/b/__pycache__/x.pyc")
    assert dockerignore_excludes(["data"], "data/prepared/x")
    assert not dockerignore_excludes(["data"], "conf/data/stdlib.yaml")  # root-anchored
    assert not dockerignore_excludes(["*.pyc"], "cluster/x.pyc")  # '*' stays in one element
    assert dockerignore_excludes(["**/*.pyc"], "cluster/x.pyc")


def _docker_engine_problem() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        return f"`docker info` failed, no usable engine: {lines[-1] if lines else info.returncode}"
    return None


@pytest.mark.slow
def test_image_builds_and_imports_the_project():
    problem = _docker_engine_problem()
    if problem:
        pytest.skip(problem)
    tag = "elastic-fsdp:test-build"
    build = subprocess.run(
        ["docker", "build", "-f", str(DOCKERFILE), "-t", tag, str(REPO_ROOT)],
        capture_output=True,
        text=True,
        env={**os.environ, "DOCKER_BUILDKIT": "1"},
    )
    assert build.returncode == 0, build.stderr[-5000:]
    check = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            tag,
            "python",
            "-c",
            "import cluster.train, trainer.config, ray; print(ray.__version__)",
        ],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr[-3000:]
