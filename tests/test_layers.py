"""The layering docs/architecture.md promises: `actors/` and `learner/` import `common/` and never
each other, `common/` imports neither, and only `launch/` (which wires processes) imports all three.
Read off every module's import statements, lazy ones included."""

import ast
from pathlib import Path

from tests.support.paths import REPO

MAY_IMPORT = {"common": {"common"}, "actors": {"common", "actors"}, "learner": {"common", "learner"},
              "launch": {"common", "actors", "learner", "launch"}}


def imported_layers(path: Path) -> set[tuple[str, int]]:
    """(layer, line) of every `asyncvla.<layer>` the module imports (relative imports stay inside)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "asyncvla" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


def test_no_module_imports_a_layer_above_it():
    upward = [f"{path.relative_to(REPO)}:{line} imports asyncvla.{imported}"
              for layer, allowed in MAY_IMPORT.items() for path in sorted((REPO / layer).rglob("*.py"))
              for imported, line in sorted(imported_layers(path)) if imported not in allowed]
    assert not upward, "\n".join(upward)
