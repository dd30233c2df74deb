"""The layout rules of the code, checked on the source text with ast (socompile is not imported):

- no import circles between socompile modules, counting imports inside functions too;
- no ``global`` statement in socompile/;
- the planner (plan/), the performance model (perf/) and the hardware profiles (hardware/) sit below the passes,
  the runtime, the backend, the pipeline drivers and the CLI: nothing they import, directly or through other
  socompile modules, lives there;
- each object owns its state: no module reads or writes ``x._name`` (``x`` not ``self`` or ``cls``) where
  ``_name`` is an attribute or method that only classes of other socompile modules define (an owner offers a
  public method or attribute instead);
- no function or method in socompile/ longer than ``MAX_FUNCTION_LINES``.

How imports are counted: relative imports are resolved; ``from pkg import name`` counts as an import of the
submodule ``pkg.name`` when that file exists, else of ``pkg``; importing ``a.b.c`` also runs the ``__init__`` of
``a.b`` (a package's __init__ is the package), unless the importer is itself inside ``a.b``. Imports under
``if TYPE_CHECKING:`` never run, so they do not make circles; they still count for the layering rules.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "socompile"

# What plan/, perf/ and hardware/ must not reach (the layers that use them).
UPPER_LAYERS = ("socompile.passes", "socompile.runtime", "socompile.backend", "socompile.cli", "socompile.offline",
                "socompile.pipeline")
LOWER_PACKAGES = ("socompile.plan", "socompile.perf", "socompile.hardware")


@dataclasses.dataclass(frozen=True)
class Edge:
    target: str
    where: str              # "socompile/options.py:147", for messages
    type_checking: bool     # under `if TYPE_CHECKING:`: never runs


def find_modules(source: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py under ``source`` (a package's __init__.py is the package)."""
    modules = {}
    for path in sorted(source.rglob("*.py")):
        parts = list(path.relative_to(source.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, type_checking: bool = False):
    """(Import or ImportFrom node, under TYPE_CHECKING?) for every import, at any depth (functions included)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, type_checking
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for stmt in child.body:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), type_checking)
        else:
            yield from _import_nodes(child, type_checking)


def _imported_names(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
                    modules: dict[str, pathlib.Path]) -> list[str]:
    """Absolute dotted names the statement imports (a name that is also a submodule counts as the submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = importer if is_package else importer.rpartition(".")[0]
        parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(source: pathlib.Path) -> dict[str, dict[str, Edge]]:
    """module -> {imported socompile module: first such import}, with the package __init__s an import runs."""
    modules = find_modules(source)
    top = source.name
    graph: dict[str, dict[str, Edge]] = {name: {} for name in modules}
    for importer, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, type_checking in _import_nodes(tree):
            where = f"{path.relative_to(source.parent)}:{node.lineno}"
            for name in _imported_names(node, importer, is_package, modules):
                if name != top and not name.startswith(top + "."):
                    continue
                while name not in modules:   # `import pkg.mod.attr`-like spellings: the module that holds it
                    name = name.rpartition(".")[0]
                inside = set(_ancestors(importer)) | {importer}
                for target in [name, *[a for a in _ancestors(name) if a not in inside]]:
                    if target != importer and target not in graph[importer]:
                        graph[importer][target] = Edge(target, where, type_checking)
    return graph


def runtime_graph(graph: dict[str, dict[str, Edge]], allowed: set[tuple[str, str]]) -> dict[str, list[Edge]]:
    """The imports that run (no TYPE_CHECKING ones), less the allowed edges."""
    return {src: [e for tgt, e in sorted(edges.items()) if not e.type_checking and (src, tgt) not in allowed]
            for src, edges in graph.items()}


def find_cycle(graph: dict[str, list[Edge]]) -> list[tuple[str, Edge]] | None:
    """One import circle as [(module, edge it follows), ...] back to the first module, or None."""
    done: set[str] = set()
    path: list[tuple[str, Edge]] = []
    on_path: dict[str, int] = {}

    def visit(module: str) -> list[tuple[str, Edge]] | None:
        on_path[module] = len(path)
        for edge in graph.get(module, []):
            path.append((module, edge))
            if edge.target in on_path:
                return path[on_path[edge.target]:]
            if edge.target not in done:
                found = visit(edge.target)
                if found:
                    return found
            path.pop()
        del on_path[module]
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            found = visit(module)
            if found:
                return found
    return None


def describe_chain(chain: list[tuple[str, Edge]]) -> str:
    return " -> ".join(f"{module} ({edge.where})" for module, edge in chain) + f" -> {chain[-1][1].target}"


def path_to_layer(graph: dict[str, dict[str, Edge]], start: str, layers: tuple[str, ...],
                  allowed: set[tuple[str, str]]) -> list[tuple[str, Edge]] | None:
    """The shortest import chain from ``start`` to a module in one of the packages ``layers`` (TYPE_CHECKING
    imports included), or None."""
    came_from: dict[str, tuple[str, Edge] | None] = {start: None}
    queue = [start]
    for module in queue:
        if module != start and any(module == up or module.startswith(up + ".") for up in layers):
            chain = []
            while came_from[module] is not None:
                chain.append(came_from[module])
                module = came_from[module][0]
            return chain[::-1]
        for target, edge in sorted(graph.get(module, {}).items()):
            if target not in came_from and (module, target) not in allowed:
                came_from[target] = (module, edge)
                queue.append(target)
    return None


def global_statements(source: pathlib.Path) -> list[tuple[str, str, str]]:
    """(module, name, file:line) of every ``global`` statement."""
    found = []
    for module, path in find_modules(source).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Global):
                found += [(module, name, f"{path.relative_to(source.parent)}:{node.lineno}") for name in node.names]
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(SOURCE)


def test_no_import_circles_between_socompile_modules(graph):
    cycle = find_cycle(runtime_graph(graph, set()))
    assert cycle is None, f"import circle: {describe_chain(cycle)}"


def test_no_global_statement_in_socompile():
    found = global_statements(SOURCE)
    assert not found, "module-level mutable state through `global`: " + ", ".join(
        f"{name} in {where}" for _, name, where in found)


@pytest.mark.parametrize("package", LOWER_PACKAGES)
def test_lower_packages_import_nothing_from_the_layers_above(graph, package):
    members = [m for m in graph if m == package or m.startswith(package + ".")]
    assert members, f"{package} holds no modules: the layout changed, update LOWER_PACKAGES"
    for module in members:
        chain = path_to_layer(graph, module, UPPER_LAYERS, set())
        assert chain is None, f"{module} reaches an upper layer: {describe_chain(chain)}"


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_checker_finds_a_circle_closed_by_an_import_inside_a_function(tmp_path):
    source = _write(tmp_path, {"__init__.py": "", "a.py": "def f():\n    from .sub import b\n",
                               "sub/__init__.py": "", "sub/b.py": "from ..a import f\n"})
    cycle = find_cycle(runtime_graph(import_graph(source), set()))
    assert cycle is not None
    assert [module for module, _ in cycle] == ["pkg.a", "pkg.sub.b"] and cycle[0][1].where == "pkg/a.py:2"


def test_the_checker_counts_the_package_init_an_import_runs_and_skips_type_checking_imports(tmp_path):
    source = _write(tmp_path, {"__init__.py": "", "low/__init__.py": "from .x import y\n",
                               "low/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from ..high import z\ny = 1\n",
                               "high/__init__.py": "", "high/z.py": "from ..low.x import y\n"})
    graph = import_graph(source)
    assert set(graph["pkg.high.z"]) == {"pkg.low.x", "pkg.low"}       # importing low.x runs low/__init__
    assert graph["pkg.low.x"]["pkg.high"].type_checking
    assert find_cycle(runtime_graph(graph, set())) is None             # the TYPE_CHECKING import never runs
    chain = path_to_layer(graph, "pkg.low.x", ("pkg.high",), set())    # ... but it counts for the layering rule
    assert chain is not None and describe_chain(chain) == "pkg.low.x (pkg/low/x.py:3) -> pkg.high"


# torch's protocol attributes, which socompile sets on objects torch reads (Dynamo's boxed calling convention).
TORCH_PROTOCOL = {"_boxed_call"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def foreign_private_accesses(files: dict[str, str]) -> list[str]:
    """``module:line x._name`` for each access of a private attribute that no class of that module defines but
    a class of another module in ``files`` ({module: source}) does."""
    trees = {name: ast.parse(text) for name, text in files.items()}
    owners: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                    owners.setdefault(node.name, set()).add(module)
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    owners.setdefault(node.attr, set()).add(module)
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in owners) or node.attr in TORCH_PROTOCOL:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if module not in owners[node.attr]:
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def _sources() -> dict[str, str]:
    """socompile's modules, {path under socompile/: source}."""
    return {str(p.relative_to(SOURCE)): p.read_text() for p in SOURCE.rglob("*.py")}


def test_no_module_reaches_into_another_modules_objects():
    files = _sources()
    assert foreign_private_accesses(files) == []


def test_the_ownership_checker_finds_a_read_and_a_write_of_another_modules_private_state():
    owner = "class Bucket:\n    def __init__(self):\n        self._spare = None\n    def _swap(self):\n        pass\n"
    user = "def f(bucket):\n    bucket._spare = 1\n    bucket._swap()\n    bucket._version\n"
    found = foreign_private_accesses({"bucket.py": owner, "user.py": user})
    assert found == ["user.py:2 bucket._spare", "user.py:3 bucket._swap"]   # torch's _version is not ours


BUCKET_MODULES = ("runtime/flat_bucket.py", "runtime/host_master.py")   # FlatBucket and its HostMasterCopies part
TENSOR_ATTRIBUTES = {"grad", "data"}   # a parameter's own (torch's), which the optimizer sets as torch's does


def foreign_bucket_writes(files: dict[str, str]) -> list[str]:
    """``module:line x.name = ...`` for each assignment, outside the bucket's modules, of an attribute that the
    bucket sets on itself and that no class of the writing module owns (the bucket's state changes through its
    methods only)."""
    def assigned_on_self(tree) -> set[str]:
        return {n.attr for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for n in ast.walk(cls)
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                and n.value.id == "self"} | {n.target.id for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
                                             for n in cls.body if isinstance(n, ast.AnnAssign)
                                             and isinstance(n.target, ast.Name)}
    trees = {name: ast.parse(text) for name, text in files.items()}
    bucket = set().union(*(assigned_on_self(trees[m]) for m in BUCKET_MODULES if m in trees)) - TENSOR_ATTRIBUTES
    found = []
    for module, tree in trees.items():
        if module in BUCKET_MODULES:
            continue
        own = assigned_on_self(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in bucket
                    and node.attr not in own and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_only_the_bucket_changes_its_own_state():
    files = _sources()
    assert foreign_bucket_writes(files) == []


def test_the_bucket_write_checker_finds_a_write_from_outside():
    bucket = "class FlatBucket:\n    def __init__(self):\n        self.stepped = False\n        self.grad = None\n"
    user = "def f(bucket, p):\n    bucket.stepped = True\n    p.grad = None\n"
    found = foreign_bucket_writes({"runtime/flat_bucket.py": bucket, "optim/user.py": user})
    assert found == ["optim/user.py:2 bucket.stepped"]


MAX_FUNCTION_LINES = 80   # a longer function does several jobs: it reads better as named steps


def long_functions(files: dict[str, str]) -> list[str]:
    """``module:line name (n lines)`` for each function or method longer than MAX_FUNCTION_LINES, decorators
    excluded, its docstring and comments included."""
    found = []
    for module, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{module}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_socompile_is_longer_than_the_limit():
    assert long_functions(_sources()) == []


def test_the_length_checker_finds_a_long_function():
    limit = MAX_FUNCTION_LINES
    short = "def short():\n" + "    x = 0\n" * (limit - 1)                   # the limit, in lines: allowed
    long = "class C:\n    def long(self):\n" + "        x = 0\n" * limit    # one line more
    assert long_functions({"a.py": short + "\n\n" + long}) == [f"a.py:{limit + 4} long ({limit + 1} lines)"]
