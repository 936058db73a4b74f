"""The fenced code blocks of README.md and docs/*.md, each with what its info string says to do.

A block's info string classifies it, so no block escapes the docs test (tests/docs/
test_docs_commands.py). GitHub renders the first word as the language; the words after it say
why a block is not run here:

    ```sh                   commands the test runs, on tiny data, in a sandbox
    ```sh cluster           needs a Ray cluster with GPUs or object storage (cluster=ray,
                            ray job submit, s3:// sources): composed and checked, not run
    ```sh gpu               needs CUDA (train.float8, the GPU check, vLLM): checked, not run
    ```sh server            starts a server: started until it answers, then stopped
    ```sh tested-by=FILE    run by the test FILE already: its overrides must be in FILE
    ```python               a snippet the test runs as a script
    ```text                 output, trees, logs: not run
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))

KINDS = {
    "sh": "commands the test runs on tiny data",
    "sh cluster": "needs a Ray cluster with GPUs or object storage: composed, not run",
    "sh gpu": "needs CUDA: composed, not run",
    "sh server": "starts a server: started until it answers, then stopped",
    "sh tested-by": "run by an existing test (tested-by=FILE), which must hold its overrides",
    "python": "a snippet run as a script",
    "text": "output, trees and logs: not run",
}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    doc: str  # the file, relative to the repository root
    number: int  # 1 for the file's first block
    line: int  # the line of its opening fence
    info: str
    text: str  # its lines, the fence's indentation removed

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.number}"

    @property
    def kind(self) -> str:
        """The key of KINDS this block's info string names; ValueError when none."""
        words = self.info.split()
        if not words:
            raise ValueError(f"{self.where}: a code block without an info string; {valid_kinds()}")
        kind = " ".join(words)
        if len(words) == 2 and words[0] == "sh" and words[1].startswith("tested-by="):
            kind = "sh tested-by"
        if kind not in KINDS:
            raise ValueError(f"{self.where}: unknown info string {self.info!r}; {valid_kinds()}")
        return kind

    @property
    def tested_by(self) -> str:
        """FILE of `sh tested-by=FILE`."""
        return self.info.split()[1].removeprefix("tested-by=")

    @property
    def where(self) -> str:
        return f"{self.doc} line {self.line} (block {self.number})"


def valid_kinds() -> str:
    return "valid: " + "; ".join(f"```{k}: {meaning}" for k, meaning in KINDS.items())


def blocks_of(doc: str, root: Path = REPO) -> list[Block]:
    """Every fenced block of `doc` (a path under `root`), in order; a fence left open is an
    error."""
    found, opened, body = [], None, []
    for n, line in enumerate((root / doc).read_text().splitlines(), start=1):
        m = FENCE.match(line)
        if opened is None:
            if m:
                opened, body = (n, m), []
            continue
        start, om = opened
        if m and not m["info"].strip() and len(m["ticks"]) >= len(om["ticks"]):
            indent = len(om["indent"])
            text = "\n".join(b[indent:] if b[:indent].isspace() else b for b in body)
            found.append(Block(doc, len(found) + 1, start, om["info"].strip(), text + "\n"))
            opened = None
        else:
            body.append(line)
    if opened is not None:
        raise ValueError(f"{doc} line {opened[0]}: a code block that is never closed")
    return found


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks_of(doc)]


def commands(block: Block) -> list[str]:
    """The block's commands, one a line: `\\` continuations joined (as the shell joins them,
    inside quotes too), blank lines and comment lines dropped."""
    joined = block.text.replace("\\\n", "")
    return [s for line in joined.splitlines() if (s := line.strip()) and not s.startswith("#")]
