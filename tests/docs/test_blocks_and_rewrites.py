"""The docs test's own machinery on made-up docs and commands (no process runs): how blocks are
found and classified, how a command is split, and tests/docs/rewrite.py's table."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs import kinds, rewrite
from tests.docs.blocks import blocks_of, commands
from tests.docs.sandbox import Sandbox

DOC = """# A doc

```sh
# a comment
.venv/bin/python -m cluster.train a=1 \\
    b=2   # why b

make run ARGS="c=3 d=4"
```

1. A list item:

   ```text
   output
   ```

```
no info string
```

```bash cluster
unknown info string
```

```sh tested-by=tests/cluster/test_sweep.py
make run
```
"""


@pytest.fixture
def doc_blocks(tmp_path: Path):
    (tmp_path / "doc.md").write_text(DOC)
    return blocks_of("doc.md", root=tmp_path)


def test_every_fence_is_a_block_and_its_info_string_its_kind(doc_blocks):
    assert [b.id for b in doc_blocks] == [f"doc.md:{n}" for n in range(1, 6)]
    assert doc_blocks[0].kind == "sh" and doc_blocks[1].kind == "text"
    assert doc_blocks[1].text == "output\n"  # an indented fence's indentation is left out
    assert doc_blocks[4].kind == "sh tested-by"
    assert doc_blocks[4].tested_by == "tests/cluster/test_sweep.py"


def test_a_block_without_or_with_an_unknown_info_string_fails_naming_the_valid_ones(doc_blocks):
    for block, said in ((doc_blocks[2], "without an info string"), (doc_blocks[3], "unknown")):
        with pytest.raises(ValueError, match=said) as e:
            block.kind
        assert "```sh cluster" in str(e.value) and "line" in str(e.value)


def test_an_unclosed_fence_is_an_error(tmp_path):
    (tmp_path / "doc.md").write_text("```sh\nmake run\n")
    with pytest.raises(ValueError, match="never closed"):
        blocks_of("doc.md", root=tmp_path)


def test_commands_join_continuations_and_drop_comments_and_blank_lines(doc_blocks):
    assert commands(doc_blocks[0]) == [
        ".venv/bin/python -m cluster.train a=1     b=2   # why b",
        'make run ARGS="c=3 d=4"',
    ]
    assert rewrite.split(commands(doc_blocks[0])[0])[3:] == ["a=1", "b=2"]


def test_a_local_command_with_a_bare_python_fails_before_anything_runs(tmp_path):
    (tmp_path / "doc.md").write_text("```sh\npython -m cluster.train\n```\n")
    (block,) = blocks_of("doc.md", root=tmp_path)
    sandbox = Sandbox(tmp_path, ray_env=lambda: pytest.fail("nothing may start"))
    with pytest.raises(AssertionError, match=r"starts with \.venv/bin/python"):
        kinds.run_sh(block, sandbox)
    assert sandbox.ran == []


def test_make_run_is_the_makefiles_recipe_and_another_target_must_exist():
    argv = rewrite.make_to_python(rewrite.split('make run ARGS="c=3 d=4"'))
    assert argv == [".venv/bin/python", "-m", "cluster.train", "c=3", "d=4"]
    assert rewrite.make_to_python(["make", "test"]) is None
    with pytest.raises(AssertionError, match="no target 'tset'"):
        rewrite.make_to_python(["make", "tset"])


def test_absolute_paths_go_under_the_sandbox_and_urls_and_dots_do_not(tmp_path):
    argv = ["x", "/models/M/", "a=/path/to/t", "s3://b/k", "sqlite:///mlflow.db", "...", "rel/p"]
    assert rewrite.in_sandbox(argv, tmp_path) == [
        "x",
        f"{tmp_path}/models/M/",
        f"a={tmp_path}/path/to/t",
        "s3://b/k",
        "sqlite:///mlflow.db",
        "rel/p",
    ]


def test_a_step_is_the_newest_committed_one_of_its_checkpoints_folder(tmp_path):
    for step, committed in ((2, True), (4, True), (6, False)):
        folder = tmp_path / "runs/r/checkpoints" / f"step_{step:09d}"
        folder.mkdir(parents=True)
        if committed:
            (folder / "manifest.json").write_text("{}")
    argv = ["x", "runs/r/checkpoints/step_000001000", "p=runs/r/checkpoints/step_000001000/a"]
    assert rewrite.newest_steps(argv, tmp_path) == [
        "x",
        "runs/r/checkpoints/step_000000004",
        "p=runs/r/checkpoints/step_000000004/a",
    ]


def test_training_gets_smoke_sizes_last_and_a_run_name_unless_it_names_one():
    train = [".venv/bin/python", "-m", "cluster.train", "train.steps=200"]
    sized = rewrite.smoke_sized(train, "doc-1-1")
    assert sized[:4] == train and sized[-1] == "cluster.run_name=doc-1-1"
    assert sized.index("train.steps=2") > sized.index("train.steps=200")  # the later one wins
    named = rewrite.smoke_sized([*train, "cluster.run_name=mine"], "doc-1-1")
    assert named[-1] != "cluster.run_name=doc-1-1"
    assert rewrite.smoke_sized([*train, "--cfg", "job"], "doc-1-1") == [*train, "--cfg", "job"]


def test_a_sweep_composes_one_cfg_job_run_per_job():
    argv = [".venv/bin/python", "-m", "cluster.train", "-m", "a=1,2", "b=x,y", "c=3", "+sweep.r=2"]
    jobs = rewrite.composed(argv)
    assert len(jobs) == 4
    assert jobs[0][:3] == argv[:3] and jobs[0][3:] == ["a=1", "b=x", "c=3", "--cfg", "job"]
    assert rewrite.composed(argv[:3] + ["c=3"]) == [argv[:3] + ["c=3", "--cfg", "job"]]


def test_a_cluster_entrypoint_is_what_follows_the_double_dash():
    argv = rewrite.split(".venv/bin/ray job submit --address a -- python -m cluster.train x=1")
    assert rewrite.entrypoint(argv) == ["python", "-m", "cluster.train", "x=1"]
    assert rewrite.module_of(argv) is None
