"""Plain helpers for the deploy/ tests: load manifests, find train commands, read quantities.

Imported by conftest.py and the test modules (conftest puts this folder on sys.path, so it works
under any pytest import mode).
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
# CI runs from a fresh clone with ../shared beside it (KubeRay CRDs among others).
SHARED_DIR = REPO_ROOT.parent / "shared"
DEPLOY_DIR = REPO_ROOT / "deploy"
KUBERAY_DIR = DEPLOY_DIR / "kuberay"
CLOUD_DIR = DEPLOY_DIR / "cloud"

# The two ways a user starts a run; both take Hydra overrides.
TRAIN_MODULE = "cluster.train"
CONSOLE_SCRIPT = "elastic-fsdp-train"
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}
# Hydra's own switches that take no value; everything else after the module is an override.
HYDRA_FLAGS = {"--multirun", "-m"}


def load_documents(path: Path) -> list[dict]:
    """Every non-empty YAML document of a file, the way `kubectl apply -f` reads it."""
    with path.open() as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for i, doc in enumerate(docs):
        assert isinstance(doc, dict), f"{path}: document {i} is {type(doc).__name__}, not a mapping"
    return docs


def logical_lines(text: str) -> list[str]:
    """Shell text with backslash-newline continuations joined, one command per line."""
    return re.sub(r"\\\n", " ", text).splitlines()


def train_commands(text: str, expand: bool = True) -> list[list[str]]:
    """The Hydra overrides of every `python -m cluster.train ...` / `elastic-fsdp-train ...` in
    text.

    Works on a RayJob entrypoint (one folded line) and on README code blocks alike; stops at a
    shell operator or a comment. A --multirun command becomes one override list per run of its
    sweep unless expand is False.
    """
    commands = []
    for line in logical_lines(text):
        if TRAIN_MODULE not in line and CONSOLE_SCRIPT not in line:
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # prose with an apostrophe, not a command
            continue
        for i, tok in enumerate(tokens):
            if tok == CONSOLE_SCRIPT and (i == 0 or tokens[i - 1] in SHELL_OPERATORS | {"--"}):
                start = (
                    i + 1
                )  # in command position only: "kubectl get rayjob elastic-fsdp-train" is not a run
            elif tok == "-m" and i + 1 < len(tokens) and tokens[i + 1] == TRAIN_MODULE:
                start = i + 2
            else:
                continue
            args = []
            for arg in tokens[start:]:
                if arg in SHELL_OPERATORS:
                    break
                args.append(arg)
            commands += expand_sweep(args) if expand else [args]
    return commands


def expand_sweep(args: list[str]) -> list[list[str]]:
    """A `--multirun` command -> one override list per run of its sweep (Hydra's basic sweeper:
    the cartesian product of comma-separated values); any other command -> itself."""
    if not HYDRA_FLAGS & set(args):
        return [args]
    choices = []
    for arg in args:
        if arg in HYDRA_FLAGS:
            continue
        key, _, value = arg.partition("=")
        choices.append([f"{key}={v}" for v in value.split(",")])
    return [list(run) for run in itertools.product(*choices)]


def python_modules(text: str) -> list[str]:
    """Every module named by `python -m <module>` in text."""
    return re.findall(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)", text)


def overrides(args: list[str]) -> dict[str, str]:
    """Hydra override list -> {key: value}; '+'/'++' prefixes dropped, '~key' deletions refused."""
    out = {}
    for arg in args:
        assert not arg.startswith("~"), (
            f"override {arg!r}: a deletion has no place in a deploy command"
        )
        key, sep, value = arg.partition("=")
        assert sep, f"override {arg!r} is not key=value"
        out[key.lstrip("+")] = value
    return out


def ray_container(pod_template: dict) -> dict:
    """KubeRay runs Ray in the first container of a pod template."""
    return pod_template["spec"]["containers"][0]


def container_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
_FACTORS = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity(value) -> float:
    """A Kubernetes resource quantity ('24Gi', '500m', 1) as a number."""
    m = _QUANTITY.match(str(value))
    assert m, f"not a Kubernetes quantity: {value!r}"
    return float(m.group(1)) * _FACTORS[m.group(2)]


def code_blocks(markdown: str) -> str:
    """The fenced code blocks of a Markdown text, joined: the commands a reader copies."""
    return "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.M | re.S))
