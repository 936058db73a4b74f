"""`ray job submit` that keeps the submitting checkout's git commit on the run.

    python -m cluster.submit --address http://localhost:8265 -- python -m cluster.train <overrides>

`ray job submit --working-dir .` uploads the working tree without .git, so a job cannot ask git
which commit it runs, and its MLflow run would carry none. This wrapper asks git here, in the
checkout being submitted, and hands the answer to the job as two environment variables in its
runtime env (cluster.tracking.source.COMMIT_ENV / DIRTY_ENV), which the driver tags as
`mlflow.source.git.commit` and `git_dirty`. Everything else is `ray job submit`'s own: every
option before `--` goes to it unchanged, except that

- `--working-dir` defaults to this checkout, and
- `--runtime-env-json` / `--runtime-env` (JSON or YAML) are merged into one runtime env with the
  two variables added (a value the user set for either is kept).

It then replaces itself with `ray job submit` (same exit code, same Ctrl-C). No Ray import here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from cluster.tracking.source import COMMIT_ENV, DIRTY_ENV, git_commit, git_dirty

REPO_ROOT = Path(__file__).resolve().parents[1]
USAGE = (
    "usage: python -m cluster.submit [ray job submit options] -- ENTRYPOINT...\n"
    "  e.g. python -m cluster.submit --address http://localhost:8265 -- "
    "python -m cluster.train cluster=ray"
)


class SubmitError(ValueError):
    """The command line cannot be turned into a `ray job submit` (says what would be valid)."""


def _option(args: list[str], name: str) -> tuple[Optional[str], list[str]]:
    """(value of `name` given as `name VALUE` or `name=VALUE`, args without it); None if absent."""
    rest, value, i = [], None, 0
    while i < len(args):
        arg = args[i]
        if arg == name:
            if i + 1 >= len(args):
                raise SubmitError(f"{name} needs a value")
            value, i = args[i + 1], i + 2
            continue
        if arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def runtime_env(json_text: Optional[str], file: Optional[str]) -> dict:
    """The user's runtime env from --runtime-env-json or --runtime-env (a JSON or YAML file)."""
    if json_text is not None and file is not None:
        raise SubmitError("give --runtime-env-json or --runtime-env, not both")
    if json_text is not None:
        try:
            env = json.loads(json_text)
        except json.JSONDecodeError as e:
            raise SubmitError(f"--runtime-env-json={json_text!r} is not JSON: {e}") from None
    elif file is not None:
        import yaml  # noqa: PLC0415 -- only for a runtime env file (PyYAML comes with Hydra)

        try:
            env = yaml.safe_load(Path(file).read_text())
        except OSError as e:
            raise SubmitError(f"--runtime-env={file!r}: {e.strerror}") from None
    else:
        env = {}
    if not isinstance(env, dict) or not isinstance(env.get("env_vars", {}), dict):
        raise SubmitError(
            "the runtime env must be a mapping whose env_vars is a mapping of name to value; "
            f"got {env!r}"
        )
    return env


def ray_job_submit_argv(argv: Sequence[str], ray: str = "ray") -> tuple[list[str], str]:
    """(the `ray job submit` command line, a line saying what source it carries)."""
    argv = list(argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SubmitError(f"no entrypoint after '--'\n{USAGE}")
    split = argv.index("--")
    options, entrypoint = argv[:split], argv[split + 1 :]
    env_json, options = _option(options, "--runtime-env-json")
    env_file, options = _option(options, "--runtime-env")
    working_dir, options = _option(options, "--working-dir")
    env = runtime_env(env_json, env_file)
    commit, dirty = git_commit(), git_dirty()
    env_vars = {str(k): str(v) for k, v in env.get("env_vars", {}).items()}
    if commit is not None:
        env_vars.setdefault(COMMIT_ENV, commit)
        if dirty is not None:
            env_vars.setdefault(DIRTY_ENV, "true" if dirty else "false")
        said = f"source: {commit[:12]}{' (uncommitted changes)' if dirty else ''}"
    else:
        said = f"source: {REPO_ROOT} is not a git checkout; the run will not name a commit"
    if env_vars:
        env["env_vars"] = env_vars
    command = [ray, "job", "submit", "--working-dir", working_dir or str(REPO_ROOT), *options]
    if env:
        command += ["--runtime-env-json", json.dumps(env)]
    return [*command, "--", *entrypoint], said


def ray_executable() -> str:
    """The `ray` CLI of this Python's environment (a venv's bin/ first), else the one on PATH."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args in ([], ["-h"], ["--help"]):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0 if args else 2
    try:
        command, said = ray_job_submit_argv(args, ray_executable())
    except SubmitError as e:
        print(f"cluster.submit: {e}", file=sys.stderr)
        return 2
    print(said, flush=True)
    os.execvp(command[0], command)  # ray job submit from here on: its output, its exit code
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
