"""Import circles in trainer/, cluster/ and benchmarks/: `make lint` fails on any.

    python tools/import_cycles.py            # prints each circle, exits 1 if there is one

Every import counts, at module level or inside a function (a lazy import that only dodges a
circle is still a circle), except those under `if TYPE_CHECKING:` (never executed). `from p
import n` is an edge to the submodule p.n when there is one, else to p itself (its __init__);
the implicit import of a module's parent packages is not an edge (a submodule importing a
sibling through its package is how packages work, not a circle).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "cluster", "benchmarks")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_blocks(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [s for s in subs if s in known] or [base]
            if any(s not in known for s in subs) and base not in targets:
                targets.append(base)  # some names are attributes of the package itself
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` where a.b.c is an attribute
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each in a stable order."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    found = cycles(graph)
    for comp in found:
        edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        print(f"import circle of {len(comp)} modules:\n  " + "\n  ".join(edges))
    if not found:
        print(f"import circles: none in {', '.join(PACKAGES)} ({len(known)} modules)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
