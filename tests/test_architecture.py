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


# The runtime's tiers, lowest first (docs/architecture.md, "The runtime's tiers"): a runtime module
# imports only runtime modules of its own tier or lower, and those imports form no cycle.
RUNTIME = PACKAGE / "runtime"
RUNTIME_TIERS = [
    # leaves: side streams, host exchanges between the ranks, the copy kernels
    {"streams", "exchange", "kernels"},
    # the process index: parameter handles and the live models (`LIVE`)
    {"handles"},
    # one model's state: `ZeroState`, what one step holds (`StepState`), gradients at fixed
    # addresses
    {"grad_store", "step", "state"},
    # the collectives and their communicators
    {"collectives"},
    # the compiled path's work: the gathered parameters, the gradients
    {"gather", "grads"},
    # the eager path's fetcher
    {"fetch"},
    # the entry point of the compiled graphs: every torch.ops.zrs op
    {"ops"},
]


def _runtime_imports(path: Path) -> set[str]:
    """The runtime modules that `path` imports anywhere: at module level, in a function, or
    under TYPE_CHECKING (`ast.walk` sees every one). A module naming itself is no edge (the
    kernels' command line imports the package's copy of itself)."""
    here = path.stem
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from .x import y
                base = "zrs.runtime" + (f".{node.module}" if node.module else "")
            else:
                base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = [*name.split("."), ""]
            if parts[:2] == ["zrs", "runtime"] and (RUNTIME / f"{parts[2]}.py").is_file():
                found.add(parts[2])
    found.discard(here)
    return found


def test_runtime_imports_form_tiers():
    modules = {p.stem for p in RUNTIME.glob("*.py") if p.stem != "__init__"}
    tier = {m: i for i, members in enumerate(RUNTIME_TIERS) for m in members}
    assert set(tier) == modules, f"give each runtime module a tier: {sorted(modules ^ set(tier))}"
    edges = {m: _runtime_imports(RUNTIME / f"{m}.py") for m in modules}
    upward = [
        f"{m} (tier {tier[m]}) imports {d} (tier {tier[d]})"
        for m in sorted(modules)
        for d in sorted(edges[m])
        if tier[d] > tier[m]
    ]
    assert not upward, "\n".join(upward)
    # Within a tier too the imports must go one way: no module reaches itself.
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(m) :], m]))
        if m not in done:
            for d in sorted(edges[m]):
                visit(d, [*path, m])
            done.add(m)

    for m in sorted(modules):
        visit(m, [])
