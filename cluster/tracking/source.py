"""Where the code of a run came from: the git commit (and whether the checkout was dirty) that
every MLflow run is tagged with, asked of git here, or handed over by `python -m cluster.submit`
where the job runs without .git (Ray's copy of the working tree). Imports neither Ray nor MLflow.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional

COMMIT_ENV = "ELASTIC_FSDP_GIT_COMMIT"
DIRTY_ENV = "ELASTIC_FSDP_GIT_DIRTY"
"""Set by `python -m cluster.submit` in the job's runtime env: `ray job submit` uploads the
working tree without .git, so the job itself cannot ask git; the submitting checkout's answer
travels with it."""


def source_tags() -> dict[str, str]:
    """MLflow tags naming the code a run ran: `mlflow.source.git.commit` (what the MLflow UI
    shows) and `git_dirty` ("true" when tracked files differed from that commit). From git when
    this code runs in a checkout, else from what `cluster.submit` passed on; when neither knows,
    `git_commit` says why instead of leaving the run without a word."""
    commit, dirty = git_commit(), git_dirty()
    if commit is None:
        commit = os.environ.get(COMMIT_ENV) or None
        dirty = {"true": True, "false": False}.get(os.environ.get(DIRTY_ENV, "").lower())
    if commit is None:
        return {"git_commit": f"unknown: not a git checkout and {COMMIT_ENV} unset"}
    tags = {"mlflow.source.git.commit": commit}
    if dirty is not None:
        tags["git_dirty"] = "true" if dirty else "false"
    return tags


def _git(*args: str) -> Optional[str]:
    """`git <args>` in the directory of this code: its stdout, or None where git fails."""
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit() -> Optional[str]:
    """HEAD of the repository this code runs from, or None (not a checkout, no commit yet)."""
    commit = (_git("rev-parse", "HEAD") or "").strip()
    return commit if len(commit) == 40 else None


def git_dirty() -> Optional[bool]:
    """Whether tracked files differ from HEAD (untracked files do not count), or None."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status.strip())
