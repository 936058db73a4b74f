"""trainer/shell.py: commands the user is told to run work as printed, outside the venv."""

import os
import subprocess
import sys
from pathlib import Path

from trainer.shell import program, python_m

BIN = Path(sys.executable).parent


def test_a_venv_program_is_spelled_with_its_path_unless_it_is_the_one_on_path(monkeypatch):
    monkeypatch.chdir(BIN.parent.parent)  # the folder holding the venv (the repository root)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    venv = BIN.relative_to(BIN.parent.parent)
    assert program("mlflow") == f"{venv}/mlflow"
    assert python_m("cluster.train") == f"{venv}/python -m cluster.train"
    monkeypatch.setenv("PATH", f"{BIN}:/usr/bin:/bin")  # an activated venv
    assert program("mlflow") == "mlflow" and python_m("x") == "python -m x"


def test_the_printed_command_runs_from_a_shell_without_the_venv(monkeypatch):
    monkeypatch.chdir(BIN.parent.parent)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    line = f"{program('mlflow')} --version"
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    done = subprocess.run(line, shell=True, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "mlflow" in done.stdout.lower(), done.stdout + done.stderr
