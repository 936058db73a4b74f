"""The docs test's shared pieces: one Ray head for every training command of the module, one
sandbox per doc, and the time each block took, printed when the module ends."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from tests.deploy.local_ray_head import local_ray_head
from tests.docs.sandbox import Sandbox

HEAD_CPUS = 2  # one smoke-sized worker (cluster.num_workers=1) and room for Ray Train's own


@pytest.fixture(scope="module")
def ray_env():
    """The client environment of a Ray head started at the first training command (and stopped
    with the module): RAY_ADDRESS and its token, which cluster=local joins."""
    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}

        def started() -> dict[str, str]:
            if not env:
                head = stack.enter_context(local_ray_head(num_cpus=HEAD_CPUS))
                env.update(head.client_env(), RAY_ADDRESS=head.gcs_address)
            return env

        yield started


TIMES = pytest.StashKey[dict]()


@pytest.fixture(scope="module")
def sandboxes(tmp_path_factory, ray_env, request):
    """doc -> its Sandbox, made on first use; and where each block's seconds go."""
    made: dict[str, Sandbox] = {}

    def sandbox(doc: str) -> Sandbox:
        if doc not in made:
            root = Path(tmp_path_factory.mktemp(doc.replace("/", "-").removesuffix(".md")))
            made[doc] = Sandbox(root, ray_env)
        return made[doc]

    yield sandbox, request.config.stash.setdefault(TIMES, {})


def pytest_terminal_summary(terminalreporter, config):
    """The seconds of each block run or checked, slowest first (the docs test's budget)."""
    times = config.stash.get(TIMES, {})
    if times:
        terminalreporter.write_sep("-", f"docs blocks: {sum(times.values()):.1f} s in all")
        for block_id, seconds in sorted(times.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:7.1f} s  {block_id}")
