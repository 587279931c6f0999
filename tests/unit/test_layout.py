"""The package layout: which folder may import which, read from the source with `ast`.

Floors, from the bottom; a module imports lenbatch modules only from its own folder or from a
lower floor (`embed` and `generate` share a floor and never import each other):

    config/ (0) < core/ (1) < runners/ (2) < serving/ (3) < embed/, generate/ (4)
    < plan/, scaleout/ (5) < replay/ (6) < cli/ (7)

`lenbatch/__init__.py` re-exports public names and sits above every floor, so no module inside
the package imports the root package itself. Every import counts: inside functions and under
`TYPE_CHECKING` too.

Within a folder the floors say nothing, so the modules' import graph is checked for cycles
(module by module, every import counted as above), and no module reads another lenbatch
module's private names, neither by importing them nor as `module._name`. `Queues` is the only
writer of its counters and lanes (`core/queues.py`): the scheduler and the engines read them.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PACKAGE = "lenbatch"
SRC = Path(__file__).resolve().parents[2] / "src" / PACKAGE

ROOT = "__init__"  # the folder key of lenbatch/__init__.py
FLOORS: dict[str, int] = {
    "config": 0,
    "core": 1,
    "runners": 2,
    "serving": 3,
    "embed": 4,
    "generate": 4,
    "plan": 5,
    "scaleout": 5,  # the Ray Serve app: embed engines behind a length-aware router
    "replay": 6,
    "cli": 7,
    ROOT: 8,
}
# Third-party packages the pure core never imports (top-level package name).
CORE_FORBIDDEN = frozenset(
    {"asyncio", "torch", "fastapi", "starlette", "uvicorn", "transformers", "httpx"}
)
# Folders that serve and so never reach into the offline tools or the command line.
SERVING_SIDE = ("core", "runners", "serving")
OFFLINE_SIDE = ("plan", "replay", "cli")


@dataclass(frozen=True)
class Import:
    """One imported module (and the name taken from it, for `from m import name`)."""

    module: str  # absolute dotted name, relative imports resolved
    name: str | None  # the name after `import` in `from m import name`; None for `import m`
    line: int

    def __str__(self) -> str:
        where = f"line {self.line}"
        if self.name is None:
            return f"`import {self.module}` ({where})"
        return f"`from {self.module} import {self.name}` ({where})"


def module_name(rel: str) -> str:
    """`core/buckets.py` -> `lenbatch.core.buckets`; `core/__init__.py` -> `lenbatch.core`."""
    parts = [PACKAGE, *Path(rel).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def folder_of(rel: str) -> str:
    """The folder key (a FLOORS key) of a file path relative to src/lenbatch."""
    parts = Path(rel).parts
    if len(parts) == 1:
        return Path(rel).stem  # config.py -> "config", __init__.py -> ROOT
    return parts[0]


def folder_of_module(module: str) -> str | None:
    """The folder key of an absolute lenbatch module name; None if not inside lenbatch."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    return parts[1] if len(parts) > 1 else ROOT


def imports_of(source: str, rel: str) -> list[Import]:
    """Every import in `source` (the file `rel` under src/lenbatch), relative ones resolved.

    `from pkg import sub` where `sub` is a submodule is recorded as the module `pkg.sub`.
    """
    this = module_name(rel)
    package = this if Path(rel).name == "__init__.py" else this.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if folder_of_module(module) is not None and is_lenbatch_module(sub):
                    found.append(Import(sub, alias.name, node.lineno))
                else:
                    found.append(Import(module, alias.name, node.lineno))
    return found


def is_lenbatch_module(module: str) -> bool:
    """Whether `module` names a module or package that exists under src/lenbatch."""
    rel = Path(*module.split(".")[1:])
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def check(source: str, rel: str) -> dict[str, list[str]]:
    """Layout violations of one module, by rule; each message names the file and the import."""
    folder = folder_of(rel)
    this = module_name(rel)
    out: dict[str, list[str]] = {"core_deps": [], "serving_side": [], "floors": [], "private": []}
    for imp in imports_of(source, rel):
        where = f"src/{PACKAGE}/{rel}: {imp}"
        top = imp.module.split(".")[0]
        if folder == "core" and top in CORE_FORBIDDEN:
            out["core_deps"].append(f"{where}: core/ stays free of {top}")
        target = folder_of_module(imp.module)
        if target is None:
            continue
        name = imp.name or ""
        private = name.startswith("_") and not name.startswith("__")
        if private and imp.module != this:
            out["private"].append(f"{where}: a private name of another module")
        if folder in SERVING_SIDE and target in OFFLINE_SIDE:
            out["serving_side"].append(f"{where}: {folder}/ never imports from {target}/")
        if target not in FLOORS:
            out["floors"].append(f"{where}: {imp.module} is in no known folder")
        elif folder == "config" and target != "config":
            out["floors"].append(f"{where}: config/ imports nothing else from lenbatch")
        elif target != folder and FLOORS[target] >= FLOORS[folder]:
            out["floors"].append(
                f"{where}: {folder}/ (floor {FLOORS[folder]}) may not import from "
                f"{target} (floor {FLOORS[target]})"
            )
    return out


def private_attributes(source: str, rel: str) -> list[str]:
    """Reads of `module._name` where `module` is a lenbatch module this file imported (`import
    lenbatch.x.y [as m]`, `from lenbatch.x import y`, `from . import y`)."""
    tree = ast.parse(source, filename=rel)
    bound: dict[str, str] = {}  # local name (or dotted path) -> lenbatch module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if folder_of_module(alias.name) is not None:
                    bound[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            for imp in imports_of(ast.unparse(node), rel):
                if imp.name is not None and imp.module.endswith(f".{imp.name}"):
                    alias = next(a for a in node.names if a.name == imp.name)
                    bound[alias.asname or alias.name] = imp.module
    found: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__"):
            continue
        owner = bound.get(ast.unparse(node.value))
        if owner is not None:
            found.append(
                f"src/{PACKAGE}/{rel}: line {node.lineno}: `{ast.unparse(node)}` reads a private "
                f"name of {owner}"
            )
    return found


QUEUE_STATE = frozenset({"size", "inflight", "inflight_total", "lanes"})
DEQUE_WRITES = frozenset(
    {"append", "appendleft", "clear", "extend", "extendleft", "insert", "pop", "popleft"}
    | {"remove", "rotate"}
)


def queue_writes(source: str, rel: str) -> list[str]:
    """Writes to a `Queues`' state from outside `core/queues.py`: an assignment to (or into)
    `x.size`, `x.inflight`, `x.inflight_total`, `x.lanes` for any `x` but `self`, and a call
    that mutates a lane (`x.lanes[i].popleft()`, ...)."""
    if rel == "core/queues.py":
        return []

    def queue_attribute(node: ast.expr) -> str | None:
        while isinstance(node, ast.Subscript):
            node = node.value
        if (
            isinstance(node, ast.Attribute)
            and node.attr in QUEUE_STATE
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")
        ):
            return ast.unparse(node)
        return None

    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in DEQUE_WRITES
            and isinstance(node.func.value, ast.Subscript)
        ):
            targets = [node.func.value]
        for target in targets:
            what = queue_attribute(target)
            if what is not None:
                found.append((node.lineno, f"`{ast.unparse(node)}` writes {what}"))
    return [f"src/{PACKAGE}/{rel}: line {n}: {what}: only Queues does" for n, what in sorted(found)]


def import_graph(texts: Mapping[str, str]) -> dict[str, set[str]]:
    """Module -> the lenbatch modules it imports (every import, as `imports_of` finds them)."""
    modules = {module_name(rel) for rel in texts}
    graph: dict[str, set[str]] = {}
    for rel, text in texts.items():
        this = module_name(rel)
        graph[this] = {imp.module for imp in imports_of(text, rel) if imp.module in modules} - {
            this
        }
    return graph


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle (`[a, b, ..., a]`) per strongly connected group of modules that import each
    other, found with Tarjan's algorithm; empty when the graph has none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
            visit(v)
    return [_cycle_through(graph, set(group), group[0]) for group in sorted(groups)]


def _cycle_through(graph: Mapping[str, set[str]], group: set[str], start: str) -> list[str]:
    """A shortest import path from `start` back to itself inside `group` (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for v in frontier:
            for w in sorted(graph.get(v, set()) & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"bug: no cycle through {start}")


def is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def check_init(source: str, rel: str) -> list[str]:
    """Violations of 'an `__init__.py` only re-exports' (docstring, imports, `__all__`, and
    a string `__version__`)."""
    problems: list[str] = []
    has_all = False
    for i, node in enumerate(ast.parse(source, filename=rel).body):
        if i == 0 and is_docstring(node):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if len(targets) == 1 and isinstance(targets[0], ast.Name) and targets[0].id == "__all__":
            has_all = True
            continue
        # The package version, a plain string, is metadata rather than code.
        if (
            len(targets) == 1
            and isinstance(targets[0], ast.Name)
            and targets[0].id == "__version__"
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            continue
        what = ast.unparse(node).splitlines()[0]
        problems.append(
            f"src/{PACKAGE}/{rel}: line {node.lineno}: `{what}`: an __init__.py holds only a "
            "docstring, imports and __all__"
        )
    if not has_all:
        problems.append(f"src/{PACKAGE}/{rel}: defines no __all__")
    return problems


@cache
def sources() -> dict[str, str]:
    """Every module's source, keyed by its path relative to src/lenbatch."""
    return {
        p.relative_to(SRC).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(SRC.rglob("*.py"))
    }


@cache
def all_violations() -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {
        "core_deps": [],
        "serving_side": [],
        "floors": [],
        "private": [],
        "private_attributes": [],
        "queue_writes": [],
        "inits": [],
    }
    for rel, text in sources().items():
        for rule, found in check(text, rel).items():
            merged[rule].extend(found)
        merged["private_attributes"].extend(private_attributes(text, rel))
        merged["queue_writes"].extend(queue_writes(text, rel))
        if Path(rel).name == "__init__.py":
            merged["inits"].extend(check_init(text, rel))
    return merged


# The checker itself: it must catch what it is meant to catch.


def test_scanner_sees_every_kind_of_import() -> None:
    source = (
        "from __future__ import annotations\n"
        "import os.path\n"
        "from typing import TYPE_CHECKING\n"
        "from . import buckets\n"
        "from .queues import Queues\n"
        "if TYPE_CHECKING:\n"
        "    from lenbatch.plan import sim\n"
        "def f():\n"
        "    import torch\n"
        "    from ..runners.base import ModelInfo\n"
    )
    found = {(i.module, i.name) for i in imports_of(source, "core/scheduler.py")}
    assert ("os.path", None) in found
    assert ("lenbatch.core.buckets", "buckets") in found
    assert ("lenbatch.core.queues", "Queues") in found
    assert ("lenbatch.plan.sim", "sim") in found
    assert ("torch", None) in found
    assert ("lenbatch.runners.base", "ModelInfo") in found


def test_scanner_catches_violations() -> None:
    bad_core = (
        "import asyncio\n"
        "def f():\n"
        "    from torch import nn\n"
        "    from lenbatch.replay.driver import replay\n"
        "from lenbatch.runners.base import ModelInfo\n"
        "from lenbatch.core.buckets import _private\n"
    )
    found = check(bad_core, "core/bad.py")
    assert len(found["core_deps"]) == 2
    assert all("src/lenbatch/core/bad.py" in m for m in found["core_deps"])
    assert any("asyncio" in m for m in found["core_deps"])
    assert any("torch" in m and "line 3" in m for m in found["core_deps"])
    assert any("lenbatch.replay.driver" in m for m in found["serving_side"])
    assert any("lenbatch.runners.base" in m for m in found["floors"])
    assert any("_private" in m for m in found["private"])

    sibling = check("from lenbatch.generate.sampling import SamplingParams\n", "embed/x.py")
    assert sibling["floors"] and "generate" in sibling["floors"][0]
    assert check("from lenbatch.core import Request\n", "config/x.py")["floors"]
    assert not check("from lenbatch.config.fields import FROZEN\n", "config/x.py")["floors"]
    assert check("import lenbatch\n", "plan/x.py")["floors"]  # the root sits above all
    assert check("from lenbatch.engine import Engine\n", "cli/x.py")["floors"]  # old name

    bad_init = '"""Doc."""\nimport os\n__all__ = ["x"]\nX = 1\ndef main(): ...\n'
    problems = check_init(bad_init, "core/__init__.py")
    assert len(problems) == 2
    assert any("line 4" in p and "X = 1" in p for p in problems)
    assert check_init('"""Doc."""\n', "x/__init__.py") == [
        "src/lenbatch/x/__init__.py: defines no __all__"
    ]


def test_scanner_accepts_allowed_imports() -> None:
    good = (
        "from __future__ import annotations\n"
        "import asyncio\n"
        "from lenbatch.config import Settings\n"
        "from lenbatch.core import Request\n"
        "from lenbatch.runners.base import ModelInfo\n"
        "from lenbatch.serving.http import new_app\n"
        "from lenbatch.generate.sampling import SamplingParams\n"
        "from lenbatch.generate import engine\n"
        "from lenbatch import config\n"
        "from . import sampling\n"
    )
    assert not any(check(good, "generate/api.py").values())
    init = '"""Doc."""\nfrom __future__ import annotations\nimport os\n__all__: list[str] = []\n'
    assert check_init(init, "plan/__init__.py") == []


def test_scanner_catches_private_attributes_of_imported_modules() -> None:
    source = (
        "import os\n"
        "import lenbatch.core.queues\n"
        "import lenbatch.core.buckets as b\n"
        "from lenbatch.plan import sim\n"
        "from . import lanes\n"
        "x = lenbatch.core.queues._queued_order\n"
        "y = b._private\n"
        "def f():\n"
        "    return sim._Replay, lanes._scheduler_config\n"
        "ok = os._exit, sim.simulate, b.__name__, sim.SimRun._fields, lanes.Lanes\n"
    )
    found = private_attributes(source, "core/x.py")
    assert len(found) == 4
    assert any("line 6" in m and "lenbatch.core.queues._queued_order" in m for m in found)
    assert any("`b._private`" in m and "lenbatch.core.buckets" in m for m in found)
    assert any("`sim._Replay`" in m for m in found)
    assert any("`lanes._scheduler_config`" in m and "lenbatch.core.lanes" in m for m in found)


def test_scanner_catches_writes_to_queue_state() -> None:
    source = (
        "def take(queues, q, lane):\n"
        "    queues.size -= 2\n"
        "    queues.inflight[lane] += 1\n"
        "    queues.lanes[lane].popleft()\n"
        "    self.queues.inflight_total = 0\n"
        "    queues.lanes = []\n"
        "    ok = queues.size, len(queues.lanes[lane]), queues.lanes[lane][0]\n"
        "    self.size = 1\n"
        "    q.popleft()\n"  # a lane read into a name: not seen, the rule is best effort
        "    queues.remove_front(lane, 2)\n"
    )
    found = queue_writes(source, "core/scheduler.py")
    assert [m.split(": ")[1] for m in found] == ["line 2", "line 3", "line 4", "line 5", "line 6"]
    assert queue_writes(source, "core/queues.py") == []


def test_cycle_finder_names_one_cycle_per_group() -> None:
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"f"}, "f": {"e", "a"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_type_checking_and_function_imports_close_a_cycle() -> None:
    texts = {
        "core/scheduler.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from lenbatch.core.adaptive import AdaptiveState\n"
        ),
        "core/adaptive.py": "def f():\n    from lenbatch.core import scheduler\n",
        "core/queues.py": "from lenbatch.core.request import Request\n",
    }
    graph = import_graph(texts)
    assert graph["lenbatch.core.queues"] == set()  # request.py is not among the texts
    assert import_cycles(graph) == [
        ["lenbatch.core.adaptive", "lenbatch.core.scheduler", "lenbatch.core.adaptive"]
    ]


# The real tree.


def test_tree_is_scanned() -> None:
    assert "core/scheduler.py" in sources()
    assert "config/settings.py" in sources()
    assert {folder_of(rel) for rel in sources()} <= FLOORS.keys()


@pytest.mark.parametrize(
    "rule",
    [
        pytest.param("core_deps", id="core-has-no-asyncio-torch-web"),
        pytest.param("serving_side", id="serving-side-never-imports-plan-replay-cli"),
        pytest.param("floors", id="imports-only-go-down"),
        pytest.param("private", id="no-private-names-across-modules"),
        pytest.param("private_attributes", id="no-module-private-attributes-across-modules"),
        pytest.param("queue_writes", id="only-queues-writes-its-lanes-and-counters"),
        pytest.param("inits", id="init-files-only-re-export"),
    ],
)
def test_layout(rule: str) -> None:
    found = all_violations()[rule]
    if found:
        pytest.fail(f"{len(found)} layout violation(s):\n" + "\n".join(found), pytrace=False)


def test_no_import_cycles() -> None:
    """No modules import each other, directly or through others, at run time, inside a
    function or under `TYPE_CHECKING`."""
    cycles = import_cycles(import_graph(sources()))
    if cycles:
        named = "\n".join(" -> ".join(c) for c in cycles)
        pytest.fail(f"{len(cycles)} import cycle(s):\n{named}", pytrace=False)
