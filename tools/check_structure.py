"""Check the import structure of the logbus package: no import cycles, and the layers import only downwards.

    python tools/check_structure.py [PACKAGE_DIR]      (default: the logbus/ next to tools/)

Exit codes: 0 the structure is clean; 1 violations were found (each listed with file:line);
2 a usage error (PACKAGE_DIR is not a package).

How the graph is built. Every ``.py`` file under PACKAGE_DIR is a module (``api/client.py`` is
``logbus.api.client``, ``api/__init__.py`` is ``logbus.api``). The source is parsed with ``ast``
and *every* import statement counts, wherever it sits: at module level, inside functions and
methods, under ``if TYPE_CHECKING:``, in ``try`` blocks. A function-level import only delays a
dependency, it does not remove it, so a cycle hidden behind one is still a cycle. Relative
imports are resolved against the importing module's package. An edge A -> B is added when
A's source names B:

- ``import logbus.spark`` names ``logbus.spark``;
- ``from logbus.api import dataset`` and ``from logbus import errors`` name the submodules
  ``logbus.api.dataset`` and ``logbus.errors``;
- ``from logbus.x import Name`` (Name not a submodule) and ``from logbus.x import *`` name
  ``logbus.x``. When ``logbus.x`` is a package this is its ``__init__`` module, which has its own
  edges to the submodules it re-exports from; the chain goes through it.

Parent packages are *not* added implicitly: Python runs ``logbus/api/__init__.py`` before it
runs ``logbus/api/client.py``, but counting that for every submodule import would put every
package ``__init__`` that re-exports from its submodules on a cycle with them. The question this
check answers is narrower and the one that matters for the design: does some module's source
name another module that (directly or through others) names it back?

What fails:

- ``cycle``: any cycle among logbus modules, reported as the chain of modules with the file:line
  of the import(s) behind each hop (every elementary cycle is listed);
- ``actors-imports-api``: a module under ``logbus/actors/`` importing anything from ``logbus/api/``
  (the actors serve the API; the API drives the actors, never the reverse);
- ``bottom-imports-ray`` and ``bottom-imports-upper``: a module under ``logbus/storage/`` or
  ``logbus/protocol/`` importing ``ray`` (or any ``ray.*``), or anything from ``logbus/actors/``
  or ``logbus/api/``. Storage and protocol are the bottom layers: pure Python, testable and
  usable without Ray;
- ``unresolved-import``: an import of a logbus module that does not exist, or a relative import
  that climbs above the package (both fail at run time, and the graph cannot place them).

Reported as information only (not a failure): ``logbus/storage/`` importing ``logbus/protocol/``.

Imports built at run time (``importlib.import_module``, ``__import__``) are not seen.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PACKAGE_DIR = Path(__file__).resolve().parent.parent / "logbus"


@dataclass(frozen=True, order=True)
class Site:
    """Where an import statement is: a file (relative to the package's parent directory) and a line."""

    path: str
    line: int
    statement: str = field(compare=False)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True, order=True)
class Edge:
    """One import of ``target`` by module ``source`` at ``site``; ``target`` is a module name."""

    source: str
    target: str
    site: Site


@dataclass
class ImportGraph:
    """The modules of one package and every import their sources make."""

    package: str
    modules: dict[str, Path]
    internal: list[Edge]  # both ends are modules of the package
    external: list[Edge]  # the target is outside the package (``ray.util.metrics``, ``numpy``)
    unresolved: list[Edge]  # the target names no module of the package (or climbs above it)

    def successors(self) -> dict[str, set[str]]:
        """Module -> the modules its source imports (every module is a key)."""
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.internal:
            out[e.source].add(e.target)
        return out

    def sites(self) -> dict[tuple[str, str], list[Site]]:
        """(source, target) -> every place source imports target, in file order."""
        out: dict[tuple[str, str], list[Site]] = defaultdict(list)
        for e in sorted(self.internal):
            out[(e.source, e.target)].append(e.site)
        return out


@dataclass(frozen=True)
class Violation:
    """A broken rule. For a cycle, ``chain`` is the modules in order (first repeated at the end)
    and ``hops`` the import sites behind each step; for any other rule, ``edge`` is the import."""

    rule: str
    message: str
    edge: Edge | None = None
    chain: tuple[str, ...] = ()
    hops: tuple[tuple[Site, ...], ...] = ()

    def describe(self) -> str:
        if self.edge is not None:
            return f"{self.edge.site}: {self.message}  [{self.edge.site.statement}]"
        lines = [self.message]
        for (a, b), sites in zip(zip(self.chain, self.chain[1:]), self.hops):
            lines.append(f"    {a} -> {b}  at {', '.join(str(s) for s in sites)}")
        return "\n".join(lines)


@dataclass
class Report:
    """The outcome of a check: the graph, what fails, and what is only worth knowing."""

    graph: ImportGraph
    violations: list[Violation]
    info: list[Violation]

    @property
    def ok(self) -> bool:
        return not self.violations

    def render(self) -> str:
        g = self.graph
        lines = [f"{g.package}: {len(g.modules)} modules, {len(g.internal)} imports between them "
                 f"({sum(len(s) for s in g.successors().values())} distinct module edges)"]
        if self.ok:
            lines.append("OK: no import cycles, no layering violations")
        else:
            lines.append(f"FAIL: {len(self.violations)} violation(s)")
            by_rule: dict[str, list[Violation]] = defaultdict(list)
            for v in self.violations:
                by_rule[v.rule].append(v)
            for rule, vs in by_rule.items():
                lines.append(f"\n{rule} ({len(vs)}):")
                lines.extend(f"  {v.describe()}" for v in vs)
        lines.append(f"\ninformation, not a failure: storage importing protocol ({len(self.info) or 'none'})")
        lines.extend(f"  {v.describe()}" for v in self.info)
        return "\n".join(lines)


def discover_modules(package_dir: Path) -> dict[str, Path]:
    """Module name -> file for every ``.py`` file under ``package_dir`` (the package itself included), and
    for every ``.c`` file: the source of a C extension of the same name (a module importing nothing of
    the package's, as the checker sees it)."""
    package = package_dir.name
    modules: dict[str, Path] = {}
    for path in sorted([*package_dir.rglob("*.py"), *package_dir.rglob("*.c")]):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def _resolve_base(module: str, is_package: bool, level: int, name: str | None) -> str | None:
    """The absolute module a ``from`` statement starts from (None if a relative import climbs too high)."""
    if level == 0:
        return name
    # The package a relative import is relative to: the module itself for an __init__, else its parent.
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 >= len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def build_graph(package_dir: Path) -> ImportGraph:
    """Parse every module under ``package_dir`` and collect every import statement it contains."""
    package_dir = package_dir.resolve()
    package = package_dir.name
    modules = discover_modules(package_dir)
    internal: list[Edge] = []
    external: list[Edge] = []
    unresolved: list[Edge] = []

    def inside(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    for module, path in modules.items():
        if path.suffix != ".py":
            continue  # a C extension's source
        rel = path.relative_to(package_dir.parent).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"

        def add(target: str, node: ast.stmt) -> None:
            edge = Edge(module, target, Site(rel, node.lineno, ast.unparse(node)))
            if not inside(target):
                external.append(edge)
            elif target in modules:
                internal.append(edge)
            else:
                unresolved.append(edge)

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_base(module, is_package, node.level, node.module)
                if base is None:
                    target = "." * node.level + (node.module or "")
                    unresolved.append(Edge(module, target, Site(rel, node.lineno, ast.unparse(node))))
                    continue
                targets = set()
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    # A name that is a submodule names that module; any other name (or *) lives in base.
                    targets.add(sub if alias.name != "*" and sub in modules else base)
                for target in sorted(targets):
                    add(target, node)
    return ImportGraph(package, modules, sorted(internal), sorted(external), sorted(unresolved))


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> successors)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def elementary_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle of ``graph`` (Johnson's algorithm), each starting at its smallest node.

    A cycle is returned as its nodes in order without repeating the first; the list is sorted.
    """
    cycles: list[list[str]] = [[v] for v in sorted(graph) if v in graph[v]]
    graph = {v: {w for w in ws if w != v} for v, ws in graph.items()}
    work = [c for c in strongly_connected(graph) if len(c) > 1]
    while work:
        component = work.pop()
        sub = {v: graph[v] & component for v in component}
        start = min(component)
        path: list[str] = []
        blocked: set[str] = set()
        blocked_by: dict[str, set[str]] = defaultdict(set)

        def unblock(u: str) -> None:
            pending = [u]
            while pending:
                x = pending.pop()
                if x in blocked:
                    blocked.discard(x)
                    pending.extend(blocked_by.pop(x, ()))

        def circuit(v: str) -> bool:
            found = False
            path.append(v)
            blocked.add(v)
            for w in sorted(sub[v]):
                if w == start:
                    cycles.append(list(path))
                    found = True
                elif w not in blocked and circuit(w):
                    found = True
            if found:
                unblock(v)
            else:
                for w in sub[v]:
                    blocked_by[w].add(v)
            path.pop()
            return found

        circuit(start)
        del sub[start]
        rest = {v: ws - {start} for v, ws in sub.items()}
        work.extend(c for c in strongly_connected(rest) if len(c) > 1)
    return sorted(cycles)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def check(package_dir: Path) -> Report:
    """Build the import graph of ``package_dir`` and apply the rules in this module's docstring."""
    graph = build_graph(package_dir)
    root = graph.package
    actors, api, storage, protocol = (f"{root}.{name}" for name in ("actors", "api", "storage", "protocol"))
    violations: list[Violation] = []
    info: list[Violation] = []

    for e in graph.unresolved:
        violations.append(Violation("unresolved-import", f"{e.source} imports {e.target}, which is not a module of {root}", edge=e))

    sites = graph.sites()
    for cycle in elementary_cycles(graph.successors()):
        chain = (*cycle, cycle[0])
        hops = tuple(tuple(sites[(a, b)]) for a, b in zip(chain, chain[1:]))
        violations.append(Violation("cycle", "cycle: " + " -> ".join(chain), chain=chain, hops=hops))

    for e in graph.internal:
        bottom = _within(e.source, storage) or _within(e.source, protocol)
        if _within(e.source, actors) and _within(e.target, api):
            violations.append(Violation("actors-imports-api", f"{e.source} imports {e.target} (actors must not import the API)", edge=e))
        elif bottom and (_within(e.target, actors) or _within(e.target, api)):
            violations.append(Violation("bottom-imports-upper", f"{e.source} imports {e.target} (storage and protocol are the bottom layers)", edge=e))
        elif _within(e.source, storage) and _within(e.target, protocol):
            info.append(Violation("storage-imports-protocol", f"{e.source} imports {e.target}", edge=e))

    for e in graph.external:
        if (_within(e.source, storage) or _within(e.source, protocol)) and _within(e.target, "ray"):
            violations.append(Violation("bottom-imports-ray", f"{e.source} imports {e.target} (storage and protocol never import Ray)", edge=e))

    return Report(graph, violations, info)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package_dir", nargs="?", type=Path, default=DEFAULT_PACKAGE_DIR,
                        help="the package directory to check (default: %(default)s)")
    args = parser.parse_args(argv)
    if not (args.package_dir / "__init__.py").is_file():
        parser.error(f"{args.package_dir} is not a package directory (no __init__.py)")
    report = check(args.package_dir)
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
