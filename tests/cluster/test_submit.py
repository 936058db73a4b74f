"""cluster.submit: the `ray job submit` command line it builds, and the tags a run gets.

The real submission to a Ray head is tests/deploy/test_job_submit.py; here the command line
(no Ray) and cluster.tracking.source.source_tags where git cannot answer, as in Ray's copy of a
working tree."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cluster import submit
from cluster.submit import SubmitError, ray_job_submit_argv
from cluster.tracking import source as tracking

REPO_ROOT = Path(__file__).resolve().parents[2]


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def split(command: list[str]) -> tuple[list[str], dict, list[str]]:
    """(options, the runtime env passed, the entrypoint) of a built command."""
    sep = command.index("--")
    options, entrypoint = command[:sep], command[sep + 1 :]
    i = options.index("--runtime-env-json")
    env = json.loads(options[i + 1])
    return options[:i] + options[i + 2 :], env, entrypoint


def test_the_checkouts_commit_and_dirty_flag_join_the_users_runtime_env():
    user_env = {"env_vars": {"A": "1"}, "pip": ["rich"]}
    command, said = ray_job_submit_argv(
        ["--address", "http://h:8265", "--runtime-env-json", json.dumps(user_env), "--",
         "python", "-m", "cluster.train", "--", "x=1"],
        ray="/bin/ray",
    )  # fmt: skip
    options, env, entrypoint = split(command)
    assert options == ["/bin/ray", "job", "submit", "--working-dir", str(REPO_ROOT),
                       "--address", "http://h:8265"]  # fmt: skip
    assert entrypoint == ["python", "-m", "cluster.train", "--", "x=1"]
    dirty = "true" if git("status", "--porcelain", "--untracked-files=no") else "false"
    assert env == {
        "pip": ["rich"],
        "env_vars": {"A": "1", tracking.COMMIT_ENV: git("rev-parse", "HEAD"),
                     tracking.DIRTY_ENV: dirty},
    }  # fmt: skip
    assert said.startswith(f"source: {git('rev-parse', 'HEAD')[:12]}")


def test_a_runtime_env_file_and_a_working_dir_are_the_users(tmp_path):
    file = tmp_path / "env.yaml"
    file.write_text(f"env_vars:\n  {tracking.COMMIT_ENV}: mine\nworking_dir_excludes: [x]\n")
    command, _ = ray_job_submit_argv(
        [f"--runtime-env={file}", "--working-dir", "/src", "--", "true"], ray="ray"
    )
    options, env, _ = split(command)
    assert options[:5] == ["ray", "job", "submit", "--working-dir", "/src"]
    assert "--runtime-env" not in options
    assert env["env_vars"][tracking.COMMIT_ENV] == "mine"  # what the user set is kept
    assert env["working_dir_excludes"] == ["x"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--address", "x"], "no entrypoint after '--'"),
        (["--address", "x", "--"], "no entrypoint after '--'"),
        (["--runtime-env-json", "{nope", "--", "true"], "is not JSON"),
        (["--runtime-env-json", '{"env_vars": [1]}', "--", "true"], "env_vars is a mapping"),
        (["--runtime-env-json", "{}", "--runtime-env", "f.yaml", "--", "true"], "not both"),
        (["--runtime-env", "/no/such.yaml", "--", "true"], "/no/such.yaml"),
        (["--working-dir", "--", "true"], "--working-dir needs a value"),
    ],
)
def test_bad_command_lines_are_refused_naming_what_is_wrong(argv, says, capsys):
    with pytest.raises(SubmitError) as e:
        ray_job_submit_argv(argv, ray="ray")
    assert says in str(e.value)
    assert submit.main(argv) == 2
    assert says in capsys.readouterr().err


def test_without_git_the_run_takes_the_submitted_commit_or_says_it_has_none(monkeypatch):
    monkeypatch.setattr(tracking, "_git", lambda *args: None)  # Ray's copy: no .git
    monkeypatch.delenv(tracking.COMMIT_ENV, raising=False)
    monkeypatch.delenv(tracking.DIRTY_ENV, raising=False)
    tags = tracking.source_tags()
    assert "mlflow.source.git.commit" not in tags
    assert tags["git_commit"].startswith("unknown: not a git checkout")
    monkeypatch.setenv(tracking.COMMIT_ENV, "a" * 40)
    monkeypatch.setenv(tracking.DIRTY_ENV, "true")
    assert tracking.source_tags() == {"mlflow.source.git.commit": "a" * 40, "git_dirty": "true"}


def test_in_a_checkout_git_answers_and_the_environment_is_not_asked(monkeypatch):
    monkeypatch.setenv(tracking.COMMIT_ENV, "b" * 40)
    dirty = "true" if git("status", "--porcelain", "--untracked-files=no") else "false"
    assert tracking.source_tags() == {
        "mlflow.source.git.commit": git("rev-parse", "HEAD"),
        "git_dirty": dirty,
    }
