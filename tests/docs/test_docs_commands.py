"""Every code block of README.md and docs/*.md, run or checked (issue 35, items 1 and 3), so a
doc cannot drift from the code again.

Each block is one test, `README.md:3` being README's third block. Its info string says what to
do with it (tests/docs/blocks.py): a block without one, or with one not known, fails. `sh` blocks
run command by command in the doc's sandbox, rewritten only as tests/docs/rewrite.py's table
says (the venv's tools made absolute, absolute paths under the sandbox, smoke sizes appended to
training commands), the paths they read stood in for by tests/docs/standins.py; a block runs
after the doc's earlier `sh` and `python` blocks, whose files it may read. Blocks that need a
cluster or a GPU are checked without one; `tested-by=` blocks against the test that runs them.

A doc command that fails because of a bug in the code is listed in XFAIL with the bug, so the
suite stays green and the block turns red (strict) once the code is fixed.
"""

from __future__ import annotations

import time

import pytest

from tests.docs.blocks import Block, all_blocks, blocks_of
from tests.docs.kinds import RUN_IN_ORDER, RUNNERS

XFAIL: dict[str, str] = {}


def params():
    for block in all_blocks():
        xfail = pytest.mark.xfail(strict=True, reason=XFAIL.get(block.id, ""))
        marks = [xfail] if block.id in XFAIL else []
        yield pytest.param(block, id=block.id, marks=marks)


def run_block(block: Block, sandbox) -> float:
    start = time.monotonic()
    RUNNERS[block.kind](block, sandbox)
    sandbox.done.add(block.id)
    return time.monotonic() - start


@pytest.mark.parametrize("block", list(params()))
def test_block(block: Block, sandboxes):
    make_sandbox, times = sandboxes
    kind = block.kind  # a missing or unknown info string fails here, naming the valid ones
    sandbox = make_sandbox(block.doc)
    for earlier in blocks_of(block.doc)[: block.number - 1]:
        if earlier.kind in RUN_IN_ORDER and earlier.id not in sandbox.done:
            try:  # its own test reports its failure; this block may still run without it
                run_block(earlier, sandbox)
            except AssertionError:
                sandbox.done.add(earlier.id)
    if kind != "text":
        times[block.id] = run_block(block, sandbox)
