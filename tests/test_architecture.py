"""The layering rules, checked on the source itself.

- every module of the engine imports with Prefect unimportable (the engine is usable without it);
- no module of ``tasks/`` imports ``flows/`` (flows call tasks, never the other way round);
- every flow is made with ``prefect_internals.flow``, never ``prefect.flow`` itself (its runs end when their
  function does, in every process that runs one: a deployment loads its flow's module by path);
- no import cycle among engine modules, nor among the engine's packages (planning, serving, coding,
  training, models and the top-level modules);
- the engine imports nothing of the CLI package, the flows or the tasks (its errors are its own);
- a training mode's name is compared as a string only in the mode registry (``engine/training/modes.py``):
  everything else asks the mode's record;
- no engine module reaches into another module's private names;
- private attributes of other objects (``actor._address``, ``TaskRunContext.__var__``) and private
  modules of other libraries are used only in ``engine/serving/dask_internals.py`` and
  ``flows/prefect_internals.py``, each tested against the installed library.

The static checks read every module's syntax tree, imports inside functions and under
``if TYPE_CHECKING:`` included: a lazy import hides a cycle from the interpreter, not from a reader.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dlrmflow.engine
import dlrmflow.tasks

ENGINE = "dlrmflow.engine"


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. dlrmflow.engine.coding.group
    path: Path
    is_package: bool

    def tree(self) -> ast.Module:
        return ast.parse(self.path.read_text(), filename=str(self.path))


def modules_of(package: str, root: Path) -> list[Module]:
    """Every module under ``root`` (the directory of ``package``), subpackages included."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out.append(Module(".".join([package, *parts]), path, is_package))
    return out


def engine_modules() -> list[Module]:
    return modules_of(ENGINE, Path(dlrmflow.engine.__file__).parent)


@dataclass(frozen=True)
class Imported:
    """One name an import statement brings in: ``module`` (absolute), and ``name`` for ``from module import name``."""

    module: str
    name: str | None
    line: int


def from_target(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module of ``from ... import``, relative forms resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: Module) -> Iterator[Imported]:
    """Every import anywhere in the module (top level, functions, conditionals), relative ones resolved."""
    for node in ast.walk(module.tree()):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Imported(alias.name, None, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                yield Imported(from_target(module, node), alias.name, node.lineno)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# --------------------------------------------------------------------------------------------
# (a) the engine without Prefect

_IMPORT_WITHOUT_PREFECT = textwrap.dedent(
    """
    import importlib, importlib.abc, json, sys, traceback

    class NoPrefect(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "prefect" or name.startswith("prefect."):
                raise ImportError(f"prefect is unimportable here (import of {name!r})")
            return None

    sys.meta_path.insert(0, NoPrefect())
    try:
        import prefect  # noqa: F401
        blocked = False
    except ImportError:
        blocked = True
    failures = {}
    for name in json.loads(sys.argv[1]):
        try:
            importlib.import_module(name)
        except BaseException:
            failures[name] = traceback.format_exc(limit=-3)
    print(json.dumps({"blocked": blocked, "failures": failures,
                      "prefect_loaded": sorted(m for m in sys.modules if m.split(".")[0] == "prefect")}))
    """
)


def test_every_engine_module_imports_without_prefect():
    names = [m.name for m in engine_modules()]
    assert "dlrmflow.engine.coding.erasure" in names and "dlrmflow.engine.training.job" in names
    done = subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT_PREFECT, json.dumps(names)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["blocked"], "the check is void: prefect could still be imported"
    failures = "\n".join(f"{name}:\n{trace}" for name, trace in report["failures"].items())
    assert not report["failures"], f"engine modules that need Prefect (or fail to import):\n{failures}"
    assert report["prefect_loaded"] == []


# --------------------------------------------------------------------------------------------
# (b) tasks never import flows


def test_no_task_module_imports_a_flow_module():
    flows = "dlrmflow.flows"
    found = []
    for module in modules_of("dlrmflow.tasks", Path(dlrmflow.tasks.__file__).parent):
        for imp in imports_of(module):
            targets = [imp.module] + ([f"{imp.module}.{imp.name}"] if imp.name else [])
            if any(t == flows or t.startswith(f"{flows}.") for t in targets):
                found.append(f"{module.path.name}:{imp.line} imports {imp.module}"
                             + (f" ({imp.name})" if imp.name else ""))
        for node in ast.walk(module.tree()):  # importlib.import_module("dlrmflow.flows...")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(flows):
                found.append(f"{module.path.name}:{node.lineno} names {node.value!r}")
    assert not found, "tasks/ must not import flows/ (the flow hands tasks what they need):\n" + "\n".join(found)


def uses_of_prefects_own(package: str, decorator: str, wrapper: str) -> list[str]:
    """Where a module of ``package`` (other than ``wrapper``, the module that wraps it) imports or uses
    ``prefect.<decorator>``."""
    import importlib

    found = []
    for module in modules_of(package, Path(importlib.import_module(package).__file__).parent):
        if module.name == wrapper:
            continue
        found += [f"{module.path.name}:{imp.line} imports prefect.{decorator}" for imp in imports_of(module)
                  if (imp.module, imp.name) == ("prefect", decorator)]
        found += [f"{module.path.name}:{node.lineno} uses prefect.{decorator}" for node in ast.walk(module.tree())
                  if isinstance(node, ast.Attribute) and node.attr == decorator and isinstance(node.value, ast.Name)
                  and node.value.id == "prefect"]
    return found


def test_every_flow_is_made_with_the_prefect_internals_flow_decorator():
    found = uses_of_prefects_own("dlrmflow.flows", "flow", "dlrmflow.flows.prefect_internals")
    assert not found, "flows made with prefect.flow, not prefect_internals.flow:\n" + "\n".join(found)
    from dlrmflow.flows.train import train_flow

    assert train_flow.name == "train"  # a Prefect Flow all the same


def test_every_task_is_made_with_the_tasks_packages_decorator():
    """Its runs carry only their own tags (dlrmflow.tasks.task): no tag concurrency request before each task."""
    found = uses_of_prefects_own("dlrmflow.tasks", "task", "dlrmflow.tasks")
    assert not found, "tasks made with prefect.task, not dlrmflow.tasks.task:\n" + "\n".join(found)
    from dlrmflow.tasks.train import train_task

    assert train_task.name == "train-dlrm"  # a Prefect Task all the same


# --------------------------------------------------------------------------------------------
# (c) no import cycle in the engine


def engine_import_graph(modules: list[Module]) -> dict[str, dict[str, int]]:
    """module -> {engine module it imports: line of the first such import}."""
    known = {m.name for m in modules}
    graph: dict[str, dict[str, int]] = {m.name: {} for m in modules}
    for module in modules:
        for imp in imports_of(module):
            # ``from package import name`` imports the submodule ``package.name`` when there is one.
            target = f"{imp.module}.{imp.name}" if f"{imp.module}.{imp.name}" in known else imp.module
            if target in known and target != module.name:
                graph[module.name].setdefault(target, imp.line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (first node repeated at the end) per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for group in groups:  # the shortest way from the group's first module back to it
        start, members = group[0], set(group)
        paths = {start: [start]}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        cycle = [*paths[v], start]
                        break
                    if w in members and w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return cycles


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 5}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycle_among_engine_modules():
    modules = engine_modules()
    graph = engine_import_graph(modules)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles among engine modules:\n" + "\n".join(describe(c, graph) for c in cycles)


def package_of(module: str) -> str:
    """``dlrmflow.engine.training.loop`` -> ``training``; a top-level module is its own package."""
    return module.removeprefix(ENGINE + ".").split(".")[0]


def test_no_import_cycle_among_engine_packages():
    graph = engine_import_graph(engine_modules())
    packages: dict[str, dict[str, int]] = {}
    for module, targets in graph.items():
        for target, line in targets.items():
            a, b = package_of(module), package_of(target)
            packages.setdefault(a, {})
            packages.setdefault(b, {})
            if a != b and module != ENGINE:
                packages[a].setdefault(b, line)
    assert {"planning", "serving", "coding", "training", "models"} <= set(packages)
    cycles = import_cycles(packages)
    assert not cycles, "import cycles among engine packages: " + "; ".join(" -> ".join(c) for c in cycles)


FORBIDDEN_FOR_THE_ENGINE = ("dlrmflow.cli", "dlrmflow.commands", "dlrmflow.errors", "dlrmflow.flows", "dlrmflow.tasks",
                            "prefect")


def test_the_engine_imports_neither_the_cli_nor_flows_nor_tasks():
    found = [f"{m.name} line {imp.line}: {imp.module}" for m in engine_modules() for imp in imports_of(m)
             if any(imp.module == f or imp.module.startswith(f + ".") for f in FORBIDDEN_FOR_THE_ENGINE)
             or (imp.module == "dlrmflow" and imp.name in ("cli", "commands", "errors", "flows", "tasks"))]
    assert not found, "the engine imports the CLI package, a flow or a task:\n" + "\n".join(found)


def mode_name_comparisons(path: Path, names: set[str]) -> Iterator[str]:
    """``x.mode == "oracle"``, ``mode in ("local", "remote")``, ``"lru" != config.mode``: a comparison of a
    ``mode`` name or attribute with a mode's name."""

    def is_mode(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "mode") or \
            (isinstance(node, ast.Attribute) and node.attr == "mode")

    def strings(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        return set()

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_mode(x) for x in sides) and any(strings(x) & names for x in sides):
                yield f"{path}:{node.lineno}"


def test_the_mode_check_finds_each_form(tmp_path):
    source = tmp_path / "user.py"
    source.write_text('a = config.mode == "oracle"\nb = mode in ("local", "x")\nc = "lru" != s.mode\n'
                      'd = config.mode == other\ne = policy == "lru"\n')
    assert [w.split(":")[-1] for w in mode_name_comparisons(source, {"oracle", "local", "lru"})] == ["1", "2", "3"]


def test_mode_names_are_compared_only_in_the_mode_registry():
    from dlrmflow.engine.training.modes import MODES

    root = Path(dlrmflow.engine.__file__).parent.parent
    registry = root / "engine" / "training" / "modes.py"
    found = [where for folder in ("engine", "flows", "tasks", "dlrmflow", "datasets")
             for path in sorted((root / folder).rglob("*.py")) if path != registry
             for where in mode_name_comparisons(path, set(MODES))]
    assert not found, "a mode's name compared outside engine/training/modes.py:\n" + "\n".join(found)


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    """``a (line 3) -> b (line 9) -> a``: a imports b at its line 3, b imports a at its line 9."""
    steps = [f"{a.removeprefix(ENGINE + '.')} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    return " -> ".join([*steps, cycle[-1].removeprefix(ENGINE + ".")])


# --------------------------------------------------------------------------------------------
# (d) no access to another engine module's private names


def private_accesses(module: Module, known: set[str]) -> Iterator[str]:
    """``from engine_module import _name`` and ``engine_module._name`` (through any import binding)."""
    tree = module.tree()
    bound: dict[str, str] = {}  # local name -> the module (or package prefix) it refers to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            target = from_target(module, node)
            for alias in node.names:
                if f"{target}.{alias.name}" in known:  # a submodule
                    bound[alias.asname or alias.name] = f"{target}.{alias.name}"
                elif target in known and target != module.name and is_private(alias.name):
                    found.append((node.lineno, f"from {target} import {alias.name}"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        owner = ".".join([bound[value.id], *reversed(chain)])
        if owner in known and owner != module.name:
            found.append((node.lineno, f"{owner}.{node.attr}"))
    for line, what in sorted(found):
        yield f"line {line}: {what}"


def test_the_private_access_check_finds_both_forms(tmp_path):
    source = tmp_path / "user.py"
    source.write_text(textwrap.dedent(
        """
        from dlrmflow.engine.coding.erasure import _check_rows, ErasureCode
        from dlrmflow.engine.coding import gf256
        from dlrmflow.engine.coding import gf256 as field
        import dlrmflow.engine.coding.erasure as code
        import dlrmflow.engine.coding.erasure

        def f():
            from . import gf256 as g
            return gf256._flat, field.MUL, code._to_host, dlrmflow.engine.coding.erasure._words, g._is_numpy, f._x
        """
    ))
    coding = f"{ENGINE}.coding"
    known = {f"{coding}.erasure", f"{coding}.gf256", f"{coding}.user", coding, ENGINE}
    found = list(private_accesses(Module(f"{coding}.user", source, False), known))
    assert found == [
        f"line 2: from {coding}.erasure import _check_rows",
        f"line 10: {coding}.erasure._to_host",
        f"line 10: {coding}.erasure._words",
        f"line 10: {coding}.gf256._flat",
        f"line 10: {coding}.gf256._is_numpy",
    ]


def test_no_engine_module_uses_another_modules_private_names():
    modules = engine_modules()
    known = {m.name for m in modules}
    found = [f"{m.name.removeprefix(ENGINE + '.')} {where}" for m in modules for where in private_accesses(m, known)]
    assert not found, "engine modules reaching into another module's private names:\n" + "\n".join(found)


# --------------------------------------------------------------------------------------------
# (e) private attributes and private APIs of Dask and Prefect only in the internals modules

# The one module per library allowed to use what it does not document (each with its own test).
INTERNALS = {"dlrmflow.engine.serving.dask_internals", "dlrmflow.flows.prefect_internals"}
# Dunder names that are a library's internals, not Python's data model.
INTERNAL_DUNDERS = {"__var__"}


def foreign_private_uses(module: Module) -> Iterator[str]:
    """Private attributes of any object but ``self``/``cls``/``super()`` (``actor._address``,
    ``TaskRunContext.__var__``), and imports of private modules or names of other packages
    (``prefect._internal``, ``from distributed.x import _y``)."""
    found = []
    for node in ast.walk(module.tree()):
        if isinstance(node, ast.Attribute) and (is_private(node.attr) or node.attr in INTERNAL_DUNDERS):
            value = node.value
            own = isinstance(value, ast.Name) and value.id in ("self", "cls")
            own |= isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"
            if not own:
                found.append((node.lineno, ast.unparse(node)))
    for imp in imports_of(module):
        if imp.module.split(".")[0] == "dlrmflow":
            continue  # the project's own modules: see the engine check above
        names = imp.module.split(".") + ([imp.name] if imp.name else [])
        if any(is_private(n) for n in names):
            found.append((imp.line, f"import of {imp.module}" + (f".{imp.name}" if imp.name else "")))
    for line, what in sorted(found):
        yield f"line {line}: {what}"


def test_private_attributes_and_apis_are_used_only_in_the_internals_modules():
    import dlrmflow.datasets
    import dlrmflow.flows

    modules = [*engine_modules(), *modules_of("dlrmflow.flows", Path(dlrmflow.flows.__file__).parent),
               *modules_of("dlrmflow.tasks", Path(dlrmflow.tasks.__file__).parent),
               *modules_of("dlrmflow.datasets", Path(dlrmflow.datasets.__file__).parent)]
    assert INTERNALS <= {m.name for m in modules}
    found = [f"{m.path.name} {where}" for m in modules if m.name not in INTERNALS for where in foreign_private_uses(m)]
    assert not found, ("private attributes or modules used outside engine/serving/dask_internals.py and "
                       "flows/prefect_internals.py (engine/, datasets/, flows/, tasks/):\n" + "\n".join(found))


def project_ancestors(cls: type) -> list[type]:
    """The classes of this project that ``cls`` inherits from (itself excluded)."""
    return [base for base in cls.__mro__[1:] if base.__module__.split(".")[0] == "dlrmflow"]


def test_the_depth_check_counts_every_project_ancestor():
    class Base:
        pass

    class Middle(Base):
        pass

    class Leaf(Middle):
        pass

    for cls in (Base, Middle, Leaf):
        cls.__module__ = "dlrmflow.example"
    assert project_ancestors(Leaf) == [Middle, Base] and project_ancestors(Base) == []


def test_no_row_store_class_subclasses_more_than_one_level_deep():
    """A store combines its parts (home, cache, W-trainer sync) by composition: each class subclasses at most
    one class of the project (the protocol), so a call never bounces between levels of one object."""
    import importlib
    import inspect

    package = "dlrmflow.engine.training.stores"
    modules = [m for m in engine_modules() if m.name.startswith(package + ".")]
    assert len(modules) >= 5
    deep = []
    for module in modules:
        loaded = importlib.import_module(module.name)
        for name, cls in inspect.getmembers(loaded, inspect.isclass):
            if cls.__module__ == module.name and len(project_ancestors(cls)) > 1:
                deep.append(f"{module.name}.{name}: {[a.__name__ for a in project_ancestors(cls)]}")
    assert not deep, "store classes more than one level deep:\n" + "\n".join(deep)
