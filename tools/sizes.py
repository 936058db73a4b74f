"""The house's size limits in trainer/ and cluster/: no file over 450 lines, no class over 250.

    python tools/sizes.py            # prints each file or class over its limit, exits 1 if any

A file holds one idea and a class one job (shared/STYLE.md); past these sizes they hold more.
The five largest of each are printed either way, so the headroom is visible.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "cluster")
MAX_FILE_LINES = 450
MAX_CLASS_LINES = 250


def sizes() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """([(lines, file)], [(lines, file:Class)]), largest first."""
    files, classes = [], []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            text = path.read_text()
            files.append((len(text.splitlines()), rel))
            for node in ast.walk(ast.parse(text, rel)):
                if isinstance(node, ast.ClassDef):
                    classes.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
    return sorted(files, reverse=True), sorted(classes, reverse=True)


def main() -> int:
    files, classes = sizes()
    over = [f"file {n} lines > {MAX_FILE_LINES}: {f}" for n, f in files if n > MAX_FILE_LINES]
    over += [f"class {n} lines > {MAX_CLASS_LINES}: {c}" for n, c in classes if n > MAX_CLASS_LINES]
    print("\n".join(over))
    largest = ", ".join(f"{f} {n}" for n, f in files[:5])
    print(f"sizes: largest files {largest}")
    print("sizes: largest classes " + ", ".join(f"{c} {n}" for n, c in classes[:5]))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
