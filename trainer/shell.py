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
    me = os.path.realpath(sys.executable)
    on_path = shutil.which("python")
    if on_path and os.path.realpath(on_path) == me:
        return "python"
    here = os.getcwd()
    exe = os.path.abspath(sys.executable)  # the venv's link, not what it points at
    return os.path.relpath(exe, here) if exe.startswith(here + os.sep) else exe


def python_m(module: str) -> str:
    """`<python> -m <module>`, as typed from here."""
    return f"{python()} -m {module}"
