"""pagedkv's import graph: no circles, and no arrow running back up the layers.

The graph is read with `ast` from every module under src/pagedkv: each `import pagedkv...`,
`from pagedkv... import ...` and relative import, those inside functions included (a lazy
import still ties two modules together; it only moves the failure to run time). An import
of `pagedkv.a.b` is an arrow to the module `pagedkv.a.b`, or to the package `pagedkv.a`
when `b` is a name defined there.

The layers, bottom up (docs/architecture.md has the package map):

    core        pure-Python paging bookkeeping: imports only errors, env and itself, never torch
    kernels     paged attention and layer kernels: never the engine or anything above it
    engine      scheduler, runner, step pipeline: never the server, sim, bench or calc
    server      the HTTP front end: never sim or bench
    sim         the simulator: never bench (the result helpers sit in `pagedkv.results`)
    calc        the memory calculator: no torch or transformers at module level (it runs without them)
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import pagedkv

SRC = Path(pagedkv.__file__).parent

#: Import circles tolerated for now, each the set of modules in one circle (none: keep it so); any
#: circle not listed here fails `test_no_import_cycles`.
KNOWN_IMPORT_CYCLES: set[frozenset[str]] = set()

#: package -> the packages it must never import (a lower layer reaching up).
FORBIDDEN_IMPORTS = {
    "pagedkv.kernels": ("pagedkv.engine", "pagedkv.server", "pagedkv.sim", "pagedkv.bench", "pagedkv.distributed",
                        "pagedkv.hf", "pagedkv.models"),
    "pagedkv.engine": ("pagedkv.server", "pagedkv.sim", "pagedkv.bench", "pagedkv.calc"),
    "pagedkv.server": ("pagedkv.sim", "pagedkv.bench"),
    "pagedkv.sim": ("pagedkv.bench",),
}
#: What `pagedkv.core` may import from pagedkv.
CORE_ALLOWED = ("pagedkv.core", "pagedkv.errors", "pagedkv.env")
#: Third-party packages that the pure-Python layers must not import.
HEAVY = ("torch", "transformers")


@dataclass(frozen=True)
class Import:
    """One import statement's target, as written (`name`) and, for pagedkv, as the module it reaches (`target`)."""

    importer: str
    name: str
    target: str | None  # the pagedkv module imported, None for a third-party import
    line: int
    top_level: bool  # runs when the importer is imported (not inside a function)

    def __str__(self) -> str:
        where = "module level" if self.top_level else "inside a function"
        return f"{self.importer} imports {self.name} (line {self.line}, {where})"


def module_name(path: Path) -> str:
    parts = ("pagedkv", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The longest prefix of `name` that is a pagedkv module (a package when the tail is a name in it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _statements(tree: ast.Module):
    """(import node, top_level) for every import in `tree`, inside functions included."""
    def visit(node, top_level):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, top_level
            inner = top_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(child, inner)

    yield from visit(tree, True)


def imports_of(module: str) -> list[Import]:
    """Every import in `module`'s source, relative ones made absolute."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node, top_level in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level \
                else node.module
            base = base.rstrip(".")
            # `from pagedkv.a import b` reaches the module pagedkv.a.b when there is one, else pagedkv.a
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for name in dict.fromkeys(names):
            target = resolve(name) if name.split(".")[0] == "pagedkv" else None
            if target != module:
                found.append(Import(module, name, target, node.lineno, top_level))
    return found


IMPORTS = {module: imports_of(module) for module in MODULES}


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _packages_entered(importer: str, target: str) -> list[str]:
    """The packages whose `__init__` runs when `importer` imports `target` (the root and its own excluded)."""
    parts = target.split(".")
    ancestors = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [package for package in ancestors if package in MODULES and not in_package(importer, package)]


def import_edges(through_package_inits: bool = False) -> dict[str, list[str]]:
    """module -> the pagedkv modules it imports; optionally also the packages whose `__init__` a
    module-level import runs first (`from pagedkv.hf.attention import x` runs pagedkv/hf/__init__.py)."""
    edges = {}
    for module, found in IMPORTS.items():
        targets = {i.target for i in found if i.target}
        if through_package_inits:
            targets |= {p for i in found if i.target and i.top_level for p in _packages_entered(module, i.target)}
        edges[module] = sorted(targets)
    return edges


def import_cycles(through_package_inits: bool = False) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    edges = import_edges(through_package_inits)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in edges[module]:
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in edges:
        if module not in index:
            connect(module)
    return cycles


def test_no_module_level_cycle_through_a_package_init():
    """A module-level import of pagedkv.a.b runs pagedkv/a/__init__.py first: a circle through it fails at import."""
    cycles = [cycle for cycle in import_cycles(through_package_inits=True) if frozenset(cycle) not in KNOWN_IMPORT_CYCLES]
    assert not cycles, "module-level import circles through a package's __init__: " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_the_graph_sees_every_kind_of_import():
    """The reader finds absolute, `from`, relative and in-function imports (else the checks below prove nothing)."""
    names = {str(i) for found in IMPORTS.values() for i in found}
    assert len(MODULES) > 50 and sum(map(len, IMPORTS.values())) > 200, names
    assert any(not i.top_level and i.target for found in IMPORTS.values() for i in found)
    assert any(i.target == "pagedkv.errors" for i in IMPORTS["pagedkv.core.allocator"])


def test_no_import_cycles():
    cycles = [cycle for cycle in import_cycles() if frozenset(cycle) not in KNOWN_IMPORT_CYCLES]
    details = []
    for cycle in cycles:
        members = set(cycle)
        details.append(" <-> ".join(cycle) + ":\n    " + "\n    ".join(
            str(i) for module in cycle for i in IMPORTS[module] if i.target in members))
    assert not cycles, "import circles (move the shared piece to a module both import):\n" + "\n".join(details)


@pytest.mark.parametrize("package", list(FORBIDDEN_IMPORTS))
def test_no_import_runs_back_up_the_layers(package):
    bad = [str(i) for module, found in IMPORTS.items() if in_package(module, package) for i in found
           if i.target and any(in_package(i.target, above) for above in FORBIDDEN_IMPORTS[package])]
    assert not bad, f"{package} must not import {', '.join(FORBIDDEN_IMPORTS[package])}:\n" + "\n".join(bad)


def test_core_imports_only_errors_env_and_itself_and_never_torch():
    bad = [str(i) for module, found in IMPORTS.items() if in_package(module, "pagedkv.core") for i in found
           if (i.target and not any(in_package(i.target, allowed) for allowed in CORE_ALLOWED))
           or i.name.split(".")[0] in HEAVY]
    assert not bad, f"pagedkv.core imports only {', '.join(CORE_ALLOWED)} and no {'/'.join(HEAVY)}:\n" + "\n".join(bad)


def test_calc_needs_no_torch_or_transformers_to_import():
    bad = [str(i) for module, found in IMPORTS.items() if in_package(module, "pagedkv.calc") for i in found
           if i.top_level and i.name.split(".")[0] in HEAVY]
    assert not bad, "pagedkv.calc imports torch/transformers at module level:\n" + "\n".join(bad)
