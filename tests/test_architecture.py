"""The layering of docs/architecture.md holds: the package root holds the public API and no other
module, every package has a layer, each package imports only from the layers below it (never a
peer of its own layer), nothing in the library imports the main job, and no file of the package is
too long to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "zrs"
MAX_LINES = 400
MAX_RUST_LINES = 500

# Layer of each package of zrs, lowest first. A module may import its own package and the
# packages of lower layers; packages of one layer are peers and import none of each other.
LAYERS = {
    "_core": 0,  # Rust: rust/zrs-py over rust/zrs-core
    "planner": 1,  # the planner's Python API, plot and CLI
    "runtime": 1,  # the ops and the state they act on
    "prepare": 2,  # what zrs.compile and zrs.shard do to a model: options, links, shards, units
    "checkpointing": 2,  # a sharded model's state on disk: state dicts, checkpoints
    "step": 2,  # the training step captured as CUDA graphs
    "integrations": 2,  # the conventions of model libraries (Hugging Face)
    "compiler": 3,  # the compiled forward, the dynamo backend and its FX passes
    "trainers": 3,  # the libraries that own the training loop (Accelerate, Trainer, Lightning)
    "api": 4,  # zrs/__init__.py: the public API and the recipe of zrs.compile and zrs.shard
    "train": 5,  # the main job
}

# What sits at the top of python/zrs besides the packages: the public API, and the Rust
# extension with its stub (and the marker for type checkers).
ROOT_FILES = {"__init__.py", "_core.pyi", "py.typed"}


def _package(module: str) -> str | None:
    """The package of `module` (a key of LAYERS, "api" for the root), None outside zrs."""
    parts = module.split(".")
    if parts[0] != "zrs":
        return None
    return parts[1] if len(parts) > 1 else "api"


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


def test_the_root_holds_the_public_api_only():
    loose = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if p.is_file() and p.name not in ROOT_FILES and not p.name.startswith("_core.")
    )
    assert not loose, f"modules at the top of python/zrs, outside every layer: {loose}"


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == set(LAYERS) - {"_core", "api"}, (
        f"packages without a layer: {sorted(packages - set(LAYERS))}; "
        f"layers without a package: {sorted(set(LAYERS) - packages - {'_core', 'api'})}"
    )
    # Source files live in packages only (zrs/cuda/ holds the kernels' CUDA source).
    stray = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.parent != PACKAGE and not (p.parent / "__init__.py").exists()
    ]
    assert not stray, f"Python files outside a package: {stray}"


def test_layers_import_downwards_only():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _module_of(path)
        own = _package(here)
        for imported in _imports(path):
            theirs = _package(imported)
            # `import zrs` alone: the package root, for its side effects (the ops it defines)
            if theirs is None or imported == "zrs" or theirs == own:
                continue
            if theirs not in LAYERS:
                wrong.append(f"{here} imports {imported}, which is in no layer")
            elif LAYERS[theirs] >= LAYERS[own]:
                peer = " (a peer of its layer)" if LAYERS[theirs] == LAYERS[own] else ""
                wrong.append(f"{here} imports {imported}{peer}")
    assert not wrong, "\n".join(wrong)


def test_files_are_short():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_rust_files_are_under_500_lines():
    """One concern a Rust file, its tests beside it (a module's tests.rs when they are long)."""
    rust = PACKAGE.parents[1] / "rust"
    long = {
        str(p.relative_to(rust)): n
        for p in rust.rglob("*.rs")
        if "target" not in p.parts and (n := len(p.read_text().splitlines())) >= MAX_RUST_LINES
    }
    assert not long, f"{MAX_RUST_LINES} lines or more: {long}"


# The runtime's tiers, lowest first (docs/architecture.md, "The runtime's tiers"): a runtime module
# imports only runtime modules of its own tier or lower, and those imports form no cycle.
RUNTIME = PACKAGE / "runtime"
RUNTIME_TIERS = [
    # leaves: side streams, host exchanges between the ranks, the copy kernels, the host
    # optimizer
    {"streams", "exchange", "kernels", "host_optim", "host_step"},
    # the process index: parameter handles and the live models (`LIVE`)
    {"handles"},
    # one model's state: `ZeroState`, what one step holds (`StepState`), gradients at fixed
    # addresses, parameters added after the sharding (`Additions`), its host side (`Offload`,
    # and its updates during the backward, `Overlap`)
    {"additions", "grad_store", "offload", "overlap", "step", "state"},
    # the collectives and their communicators
    {"collectives"},
    # the compiled path's work: the gathered parameters, the gradients
    {"gather", "grads"},
    # the eager path's fetcher, its all-gathers, and its check of the recorded order
    {"fetch", "flights", "eager_trace"},
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
