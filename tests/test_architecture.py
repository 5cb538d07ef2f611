"""The layering of docs/architecture.md holds: each layer imports only from the layers below it,
nothing in the library imports the main job, and no file of the package is too long to read in
one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "zrs"
MAX_LINES = 400

# Layer of each part of the package, lowest first; a module may import its own layer or lower.
LAYERS = {
    "_core": 0,
    "planner": 1,
    "runtime": 1,
    "compiler": 2,
    "api": 3,  # the package root's own modules
    "train": 4,
}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "zrs":
        return None
    if len(parts) == 1:
        return LAYERS["api"]
    return LAYERS.get(parts[1], LAYERS["api"])


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if node.module == "zrs"]
    return found


def _module_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_layers_import_downwards_only():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _module_of(path)
        own = _layer(here)
        for imported in _imports(path):
            layer = _layer(imported)
            if layer is None or own is None or imported == "zrs":
                continue
            # planner and runtime are peers below the compiler, and neither imports the other
            peers = {here.split(".")[1:2][0] if "." in here else "", imported.split(".")[1]}
            if layer > own or (layer == own == 1 and peers == {"planner", "runtime"}):
                wrong.append(f"{here} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_files_are_short():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"
