"""The import graph of nanokv_cli: cycles, arrows that point up a floor, and oversized code.

Walks the package with `ast` (nothing is imported) and builds the graph of its imports of
itself. Each arrow has a kind: `module` (runs when the module is imported, class bodies and
module-level `if`/`try` included), `function` (inside a function: deferred, but still a
dependency) or `typing` (under `if TYPE_CHECKING:`). Cycles are found over every kind, since
an import moved into a function hides a cycle from Python, not from a reader; pass
`--module-level` to look at module-level arrows only.

Floors (`RULES`): `engine/cpu/` is a leaf below the layers, the models and the loader; the
engine imports nothing of nanokv_cli outside `engine/`; views do not import the CLI; the engine
imports no UI or web library (`ENGINE_FORBIDDEN_LIBRARIES`).

Imports that have no place (failing too):

- a test module imported by another file of the tests folder (`--tests`, the checkout's
  `tests/` by default): what tests share belongs in `tests/support/` or `conftest.py`;
- an import the module does not use: a name imported and never referenced in the module's
  own code, whether listed in `__all__` (a re-export) or not. The package root and the seed's
  public paths (`REEXPORTS_ALLOWED`) may re-export.

Also listed, without failing: modules (Python, C) over 600 lines and functions over 80.

    python scripts/check/import_graph.py            # the report; exit status 1 on any failure
    python scripts/check/import_graph.py --json     # the same as JSON
    python scripts/check/import_graph.py --root path/to/package --tests path/to/tests
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

# This checkout: the nearest folder above holding pyproject.toml.
CHECKOUT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
ROOT = CHECKOUT / "nanokv_cli"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
KINDS = ("module", "function", "typing")


@dataclass(frozen=True)
class Rule:
    """Modules under `sources` must not import modules under any of `forbidden` (names
    relative to the root package; "" is the root itself), except those under `allowed`."""

    why: str
    sources: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()


RULES = (
    Rule(
        "engine/cpu is a leaf: of the engine it imports only the GGUF format itself (gguf_file: "
        "parser and codec, no model knowledge, which the packed weight formats decode) and "
        "the cache folder its builds go to (cpu/cache_dir.py, inside it)",
        "engine.cpu",
        ("engine",),
        ("engine.cpu", "engine.model.gguf_file"),
    ),
    Rule("the engine imports nothing of nanokv_cli outside engine/", "engine", ("",), ("engine",)),
    Rule("views do not import the CLI", "views", ("cli",)),
)
ENGINE_FORBIDDEN_LIBRARIES = ("typer", "click", "rich", "fastapi", "starlette", "uvicorn")
# Modules that may import names only to offer them (paths relative to the root package): the
# package root, and the import paths the seed (nano-vllm) gave its public classes.
REEXPORTS_ALLOWED = (
    "__init__.py",
    "engine/block_manager.py",
    "engine/sequence.py",
    "engine/sampling_params.py",
)


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    kind: str  # one of KINDS
    line: int


@dataclass
class Module:
    name: str
    path: str  # relative to the root package's parent
    lines: int
    imports: list[Edge] = field(default_factory=list)
    libraries: list[Edge] = field(default_factory=list)  # target: a top-level outside name
    functions: list[tuple[str, int, int]] = field(default_factory=list)  # (name, line, length)


# -- scanning ------------------------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def scan(root: Path) -> dict[str, Module]:
    """Every module under `root` with its imports of the package, libraries and functions."""
    files = sorted(root.rglob("*.py"))
    names = {module_name(path, root): path for path in files}
    modules = {}
    for name, path in names.items():
        source = path.read_text(encoding="utf-8")
        module = Module(name, str(path.relative_to(root.parent)), len(source.splitlines()))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        _ImportVisitor(module, package, root.name, set(names)).visit(ast.parse(source, str(path)))
        module.imports = _dedupe(module.imports)
        module.libraries = _dedupe(module.libraries)
        modules[name] = module
    return modules


def _dedupe(edges: list[Edge]) -> list[Edge]:
    first: dict[tuple[str, str], Edge] = {}
    for edge in sorted(edges, key=lambda e: e.line):
        first.setdefault((edge.target, edge.kind), edge)
    return sorted(first.values(), key=lambda e: (e.line, e.target))


class _ImportVisitor(ast.NodeVisitor):
    """Collects one module's imports, each with its kind, and its functions' lengths."""

    def __init__(self, module: Module, package: str, root: str, known: set[str]) -> None:
        self.module, self.package, self.root, self.known = module, package, root, known
        self.scope: list[str] = []  # enclosing classes and functions
        self.in_function = 0
        self.in_typing = 0

    def kind(self) -> str:
        return "typing" if self.in_typing else "function" if self.in_function else "module"

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            self.in_typing += 1
            for child in node.body:
                self.visit(child)
            self.in_typing -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        name = ".".join([*self.scope, node.name])
        self.module.functions.append((name, node.lineno, node.end_lineno - node.lineno + 1))
        self.scope.append(node.name)
        self.in_function += 1
        self.generic_visit(node)
        self.in_function -= 1
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._absolute(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0:
            base = node.module or ""
            if base.split(".")[0] != self.root:
                self._absolute(base, node.lineno)
                return
        else:
            parts = self.package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, node.module] if node.module else parts)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"  # `from . import kernels` names a module
            self._add(submodule if submodule in self.known else base, node.lineno)

    def _absolute(self, dotted: str, line: int) -> None:
        if dotted.split(".")[0] != self.root:
            edge = Edge(self.module.name, dotted.split(".")[0], self.kind(), line)
            self.module.libraries.append(edge)
            return
        parts = dotted.split(".")
        while parts and ".".join(parts) not in self.known:
            parts.pop()
        if parts:
            self._add(".".join(parts), line)

    def _add(self, target: str, line: int) -> None:
        if target in self.known and target != self.module.name:
            self.module.imports.append(Edge(self.module.name, target, self.kind(), line))


# -- checks --------------------------------------------------------------------------------------


def cycles(modules: dict[str, Module], kinds: Iterable[str] = KINDS) -> list[list[Edge]]:
    """The arrows inside each strongly connected group of modules (Tarjan), group by group."""
    kinds = set(kinds)
    graph = {
        name: sorted({e.target for e in m.imports if e.kind in kinds})
        for name, m in modules.items()
    }
    groups = []
    for group in _strongly_connected(graph):
        if len(group) > 1:
            members = set(group)
            edges = [
                e
                for name in sorted(group)
                for e in modules[name].imports
                if e.target in members and e.kind in kinds
            ]
            groups.append(edges)
    return sorted(groups, key=lambda edges: edges[0].source)


def _strongly_connected(graph: dict[str, list[str]]) -> Iterator[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for start in sorted(graph):
        if start in index:
            continue
        # Iterative Tarjan: (node, iterator over its successors) frames.
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            child = next(successors, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, []))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                yield group


def _under(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def upward_arrows(modules: dict[str, Module], root: str) -> list[tuple[str, Edge]]:
    """(the rule's reason, the arrow) for every import that breaks one of `RULES`."""

    def full(relative: str) -> str:
        return f"{root}.{relative}" if relative else root

    found = []
    for rule in RULES:
        for module in modules.values():
            if not _under(module.name, full(rule.sources)):
                continue
            for edge in module.imports:
                if any(_under(edge.target, full(f)) for f in rule.forbidden) and not any(
                    _under(edge.target, full(a)) for a in rule.allowed
                ):
                    found.append((rule.why, edge))
    return found


def forbidden_libraries(modules: dict[str, Module], root: str) -> list[Edge]:
    engine = f"{root}.engine"
    return [
        edge
        for module in modules.values()
        if _under(module.name, engine)
        for edge in module.libraries
        if edge.target in ENGINE_FORBIDDEN_LIBRARIES
    ]


def oversized(modules: dict[str, Module], root: Path) -> tuple[list, list]:
    """(path, lines) of modules over MAX_MODULE_LINES, C sources included, and (path, line,
    name, lines) of functions over MAX_FUNCTION_LINES, longest first."""
    sizes = [(m.path, m.lines) for m in modules.values()]
    for path in sorted([*root.rglob("*.c"), *root.rglob("*.h")]):
        text = path.read_text(encoding="utf-8", errors="replace")
        sizes.append((str(path.relative_to(root.parent)), len(text.splitlines())))
    big_modules = sorted((s for s in sizes if s[1] > MAX_MODULE_LINES), key=lambda s: -s[1])
    long_functions = sorted(
        (
            (m.path, line, name, length)
            for m in modules.values()
            for name, line, length in m.functions
            if length > MAX_FUNCTION_LINES
        ),
        key=lambda f: -f[3],
    )
    return big_modules, long_functions


# -- imports with no place -----------------------------------------------------------------------


def _imported_modules(node: ast.AST) -> list[str]:
    """The dotted names an import statement may load: `import a.b` -> a.b; `from a import b`
    -> a and a.b (b may be a module); relative dots dropped."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        return [base, *(f"{base}.{a.name}".lstrip(".") for a in node.names if a.name != "*")]
    return []


def test_imports(tests: Path) -> list[dict]:
    """Every import of a test module (`test_*.py` of the tests folder) by another file there."""
    files = sorted(tests.rglob("*.py"))
    test_modules = {path.stem for path in files if path.stem.startswith("test_")}
    found = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            parts = {p for target in _imported_modules(node) for p in target.split(".")}
            for target in sorted((parts & test_modules) - {path.stem}):
                relative = str(path.relative_to(tests.parent))
                found.append({"path": relative, "target": target, "line": node.lineno})
    return sorted(found, key=lambda f: (f["path"], f["line"], f["target"]))


def _bound_imports(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(name bound, line) of every import in the module, at any depth; `from __future__`
    and star imports bind nothing checkable."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.asname or alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                if alias.name != "*":
                    yield alias.asname or alias.name, node.lineno


def _names_in(expr: ast.AST) -> Iterator[str]:
    """Names an expression reads, those inside string annotations ("Foo", list["Foo"]) too."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            yield node.id
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                parsed = ast.parse(node.value.strip(), mode="eval")
            except SyntaxError:
                continue
            if isinstance(parsed.body, (ast.Name, ast.Attribute, ast.Subscript, ast.BinOp)):
                yield from _names_in(parsed.body)


def _used_names(tree: ast.AST) -> set[str]:
    """Every name the module's code reads (a string constant counts where it is an annotation)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            used.add(node.id)
        annotations = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for annotation in annotations:
            used.update(_names_in(annotation))
    return used


def _all_names(tree: ast.Module) -> set[str]:
    """The strings of a module-level `__all__ = [...]` (or `+=`)."""
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = getattr(node, "value", None)
            if isinstance(value, (ast.List, ast.Tuple)):
                names.update(e.value for e in value.elts if isinstance(e, ast.Constant))
    return names


def unused_imports(root: Path) -> list[dict]:
    """Every name a module imports and never reads in its own code (`in_all`: it is listed
    in `__all__`, a re-export), outside `REEXPORTS_ALLOWED`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in REEXPORTS_ALLOWED:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        used, exported = _used_names(tree), _all_names(tree)
        for name, line in _bound_imports(tree):
            if name not in used:
                relative = str(path.relative_to(root.parent))
                found.append(
                    {"path": relative, "name": name, "line": line, "in_all": name in exported}
                )
    return found


# -- the report ----------------------------------------------------------------------------------


def report(root: Path, kinds: Iterable[str] = KINDS, tests: Path | None = None) -> dict:
    modules = scan(root)
    big_modules, long_functions = oversized(modules, root)
    edges = [e for m in modules.values() for e in m.imports]
    return {
        "root": str(root),
        "modules": len(modules),
        "imports": {kind: sum(e.kind == kind for e in edges) for kind in KINDS},
        "edges": [asdict(e) for e in edges],
        "cycles": [[asdict(e) for e in group] for group in cycles(modules, kinds)],
        "upward": [
            {"rule": why, **asdict(edge)} for why, edge in upward_arrows(modules, root.name)
        ],
        "forbidden_libraries": [asdict(e) for e in forbidden_libraries(modules, root.name)],
        "tests": str(tests) if tests else None,
        "test_imports": test_imports(tests) if tests else [],
        "unused_imports": unused_imports(root),
        "big_modules": [{"path": p, "lines": n} for p, n in big_modules],
        "long_functions": [
            {"path": p, "line": line, "name": name, "lines": n}
            for p, line, name, n in long_functions
        ],
    }


def failures(result: dict) -> int:
    gates = ("cycles", "upward", "forbidden_libraries", "test_imports", "unused_imports")
    return sum(len(result[gate]) for gate in gates)


def print_report(result: dict, root: str) -> None:
    def short(name: str) -> str:
        return name.removeprefix(root + ".")

    def arrow(e: dict) -> str:
        return f"{short(e['source'])} -> {short(e['target'])}  ({e['kind']}, line {e['line']})"

    counts = ", ".join(f"{n} {kind}" for kind, n in result["imports"].items())
    print(f"{result['root']}: {result['modules']} modules, imports of itself: {counts}")
    print(f"\ncycles ({len(result['cycles'])}):")
    for group in result["cycles"]:
        members = sorted({short(e["source"]) for e in group})
        print("  " + " <-> ".join(members))
        for e in group:
            print("    " + arrow(e))
    print(f"\nupward arrows ({len(result['upward'])}):")
    for e in result["upward"]:
        print(f"  {arrow(e)}: {e['rule']}")
    print(f"\nUI or web libraries in the engine ({len(result['forbidden_libraries'])}):")
    for e in result["forbidden_libraries"]:
        print(f"  {arrow(e)}")
    print(f"\ntest modules imported by other test files ({len(result['test_imports'])}):")
    for t in result["test_imports"]:
        print(f"  {t['path']}:{t['line']} imports {t['target']}")
    print(f"\nimports the module does not use ({len(result['unused_imports'])}):")
    for u in result["unused_imports"]:
        why = "re-exported in __all__" if u["in_all"] else "never read"
        print(f"  {u['path']}:{u['line']} {u['name']} ({why})")
    print(f"\nmodules over {MAX_MODULE_LINES} lines ({len(result['big_modules'])}):")
    for m in result["big_modules"]:
        print(f"  {m['path']}: {m['lines']}")
    print(f"\nfunctions over {MAX_FUNCTION_LINES} lines ({len(result['long_functions'])}):")
    for f in result["long_functions"]:
        print(f"  {f['path']}:{f['line']} {f['name']}: {f['lines']}")
    print(
        f"\n{'FAIL' if failures(result) else 'OK'}: {failures(result)} cycles, upward arrows, "
        "forbidden libraries, test-to-test imports or unused imports"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the package folder to walk")
    parser.add_argument(
        "--tests",
        type=Path,
        default=CHECKOUT / "tests",
        help="the tests folder whose files may not import one another's test modules",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--module-level",
        action="store_true",
        help="find cycles among module-level imports only (not function or TYPE_CHECKING ones)",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / "__init__.py").is_file():
        parser.error(f"{root} is not a package folder (it has no __init__.py)")
    if not args.tests.is_dir():
        parser.error(f"{args.tests} is not a folder")
    result = report(root, ("module",) if args.module_level else KINDS, args.tests.resolve())
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result, root.name)
    return 1 if failures(result) else 0


if __name__ == "__main__":
    sys.exit(main())
