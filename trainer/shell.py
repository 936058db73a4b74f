"""Commands the way the user can type them here: what a message tells the user to run must work
as printed, on a fresh clone, outside an activated virtual environment (`make run` installs into
.venv/ and never activates it).

    print(f"run: {python_m('trainer.checkpoint')} verify {path}")
    # -> "run: .venv/bin/python -m trainer.checkpoint verify runs/..." from the repository root
"""

from __future__ import annotations

import os
import shutil
import sys


def python() -> str:
    """This interpreter as typed from the current directory: `python` when that is the one on
    PATH (an activated venv, a cluster image), else its path, relative when under the current
    directory (.venv/bin/python)."""
    return program("python")


def program(name: str) -> str:
    """A program installed beside this interpreter (`mlflow`, `ray`, `python`) as typed from the
    current directory: its bare name when that is the one on PATH, else its path, relative when
    under the current directory (.venv/bin/mlflow)."""
    exe = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), name)  # the venv's link
    mine = os.path.realpath(sys.executable) if name == "python" else os.path.realpath(exe)
    on_path = shutil.which(name)
    if on_path and os.path.realpath(on_path) == mine:
        return name
    here = os.getcwd()
    return os.path.relpath(exe, here) if exe.startswith(here + os.sep) else exe


def python_m(module: str) -> str:
    """`<python> -m <module>`, as typed from here."""
    return f"{python()} -m {module}"
