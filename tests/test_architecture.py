"""The package's import boundaries, checked so that they hold as code moves.

The tree shows the processes (README "Layout"): each package under `appliance/` runs in one process, and the
modules at the package root are what more than one of them share.

- the root modules (`params`, `outputs`, `limits`, `config`, `options`, `protocol`, `settings`, `logs`, `auth`,
  `manifest`, `paths`, `host`, `cpu_isa`, `devices`) run in any process and import only the root;
- `runtime/` (engine, scheduler, KV, sampling, backends, ...) runs in the engine process: itself and the root;
- `server/` (supervisor, engine service, jobs, slots, metrics) is the engine process's serving code: itself,
  `runtime/` and the root; of `http/` only the gunicorn config it launches, by name;
- `pull/` is a process of its own (`appliance pull`, and `/api/pull`'s child `python -m appliance.pull`): itself and
  the root; the engine's model listing reads its store;
- the gunicorn workers run `http/` (gunicorn config, edge worker, engine client: itself and the root), `api/` (the
  front every client API shares: `http/` and the root), the client API adapters `openai_api/`, `anthropic_api/`,
  `ollama_api/` and the web page `web/` (each: `api/`, `http/` and the root, never another adapter, except that
  `ollama_api/` is defined as a translation of OpenAI's bodies and may import `openai_api/`), and `wsgi/` (the app
  and the OpenAPI document: the only package that imports every adapter); gunicorn's config names the app by string;
- `cli` is the entry point (anything but the test harness); `testing/` serves tests and bench (anything).

A gunicorn worker stays light (about 32 MB, docs/serving.md): the last test imports what a worker imports in a
fresh interpreter and checks that neither numpy nor OpenVINO nor any runtime module loaded. The static checks
read every module's AST (imports inside functions count too, as do module paths handed to gunicorn as strings).
Roles are derived from paths, so a new module is covered without editing this file.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "appliance"

RUNTIME, SERVER, HTTP, TESTING = "appliance.runtime", "appliance.server", "appliance.http", "appliance.testing"
PULL = "appliance.pull"  # a process of its own
API, WSGI = "appliance.api", "appliance.wsgi"  # the workers' shared front, and the app above every adapter
# the client API adapters (the web page is one: its own routes over the front): each its own role, in the workers
ADAPTERS = ("appliance.openai_api", "appliance.anthropic_api", "appliance.ollama_api", "appliance.web")
# the one adapter-to-adapter edge: Ollama's bodies are translated into OpenAI's and checked by its rules
TRANSLATES = {("appliance.ollama_api", "appliance.openai_api")}
WORKER_ROLES = {HTTP, API, WSGI, *ADAPTERS}
SHARED, ENTRY_POINT = "shared", "appliance.cli"  # the package root's modules; glue: flags -> settings -> server
# The edges by name across processes: the supervisor starts gunicorn with this config, which names the app.
LAUNCHES = {
    ("appliance.server.supervisor", "appliance.http.gunicorn_conf"),
    ("appliance.http.gunicorn_conf", "appliance.wsgi.app"),
}
HEAVY = ("numpy", "openvino", "onnxruntime", "tokenizers")

# A module path given as a string: "python:appliance.x" (gunicorn --config), "appliance.x:app()" (wsgi_app),
# "appliance.x.Class" (worker_class). Logger names ("appliance.edge") match none of these forms.
MODULE_STRING = re.compile(r"^python:(appliance(?:\.\w+)+)$|^(appliance(?:\.\w+)*?)(?::.+|\.[A-Z]\w*)$")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def role(name: str) -> str:
    """A module's role, from its path: its package's name (each adapter its own), SHARED for the package root's
    modules, ENTRY_POINT for the CLI."""
    for package in (RUNTIME, SERVER, HTTP, TESTING, PULL, API, WSGI, *ADAPTERS):
        if within(name, package):
            return package
    return ENTRY_POINT if name == ENTRY_POINT else SHARED


def docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes (module, class, function): prose, not references."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def imported(source: str, name: str, is_package: bool = False) -> set[str]:
    """The appliance modules `source` (module `name`) imports anywhere in its body, or names in a module string.
    `from X import Y` counts as X.Y when that is a module of the package, else as X."""
    known = modules()
    tree = ast.parse(source)
    prose = docstrings(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            match = MODULE_STRING.match(node.value)
            if match:
                found.add(match.group(1) or match.group(2))
    return {module for module in found if within(module, "appliance")}


@cache
def graph() -> dict[str, set[str]]:
    return {name: imported(path.read_text(), name, path.name == "__init__.py") for name, path in modules().items()}


def violations(allowed: Callable[[str, str], bool]) -> list[str]:
    return [
        f"{name} imports {target}"
        for name, targets in sorted(graph().items())
        for target in sorted(targets)
        if not allowed(name, target)
    ]


# ---------------------------------------------------------------- the checker itself


def test_the_roles_are_derived_from_the_package():
    roles = {name: role(name) for name in modules()}
    assert {
        roles[n]
        for n in ("appliance.runtime.engine", "appliance.runtime.scheduler", "appliance.runtime.backends.kv_budget")
    } == {RUNTIME}
    assert {roles[n] for n in ("appliance", "appliance.params", "appliance.protocol", "appliance.settings")} == {SHARED}
    assert {roles[n] for n in ("appliance.server.metrics", "appliance.server.supervisor")} == {SERVER}
    assert roles["appliance.http.worker"] == HTTP and roles["appliance.wsgi.app"] == WSGI
    assert roles["appliance.api.generation"] == API and roles["appliance.pull.store"] == PULL
    assert [roles[n] for n in ("appliance.openai_api.chat", "appliance.anthropic_api.shape")] == list(ADAPTERS[:2])
    assert [roles[n] for n in ("appliance.ollama_api.wire", "appliance.web")] == list(ADAPTERS[2:])
    assert roles["appliance.cli"] == ENTRY_POINT and roles["appliance.testing.loopback"] == TESTING
    # Known edges are seen, lazy ones (inside a function) and string ones included.
    assert "appliance.runtime.engine" in graph()["appliance.server.supervisor"]
    assert "appliance.server.supervisor" in graph()["appliance.cli"]
    assert {"appliance.wsgi.app", "appliance.http.worker"} <= graph()["appliance.http.gunicorn_conf"]
    assert LAUNCHES <= {(name, target) for name, targets in graph().items() for target in targets}


def test_the_checker_sees_every_form_of_import():
    source = '''"""Docstrings are prose: appliance.server.nothing:here is not a reference."""
import appliance.http.client
from appliance.wsgi import app
from appliance import params, __version__
from .sibling import thing
def lazy():
    from appliance.testing.procinfo import children
    return "python:appliance.http.gunicorn_conf", "appliance.http.worker.EdgeWorker", "appliance.http"
'''
    found = imported(source, "appliance.runtime.backends.example")
    assert found == {
        "appliance.http.client",
        "appliance.wsgi.app",
        "appliance.params",
        "appliance",
        "appliance.runtime.backends.sibling",
        "appliance.testing.procinfo",
        "appliance.http.gunicorn_conf",
        "appliance.http.worker",
    }


def test_every_module_imported_or_named_exists():
    """Imports, and the strings gunicorn is started with (--config python:..., wsgi_app, worker_class), name
    modules that exist: a module moved without updating a string that names it fails here, not in production."""
    named = {target for targets in graph().values() for target in targets}
    assert "appliance.http.gunicorn_conf" in graph()["appliance.server.supervisor"]
    assert not named - set(modules()), f"no such module: {sorted(named - set(modules()))}"


# ---------------------------------------------------------------- the boundaries

# What each process's package may import (besides itself): the table in the module docstring.
MAY_IMPORT = {
    SHARED: {SHARED},
    RUNTIME: {RUNTIME, SHARED},
    PULL: {PULL, SHARED},
    SERVER: {SERVER, RUNTIME, PULL, SHARED},  # the engine's model listing reads the pull store
    HTTP: {HTTP, SHARED},
    API: {API, HTTP, SHARED},
    **{adapter: {adapter, API, HTTP, SHARED} for adapter in ADAPTERS},
    WSGI: {WSGI, *ADAPTERS, API, HTTP, SHARED},
    ENTRY_POINT: {ENTRY_POINT, SHARED, RUNTIME, SERVER, PULL, HTTP},
    TESTING: {TESTING, ENTRY_POINT, SHARED, RUNTIME, SERVER, PULL, *WORKER_ROLES},
}


def test_each_package_imports_only_what_its_process_may():
    def allowed(name: str, target: str) -> bool:
        return (
            role(target) in MAY_IMPORT[role(name)]
            or (name, target) in LAUNCHES
            or (role(name), role(target)) in TRANSLATES
        )

    assert violations(allowed) == []


def test_adapters_are_peers_and_only_wsgi_imports_them_all():
    """An adapter imports the front (api/), never another adapter (but Ollama's translation of OpenAI bodies);
    the app (wsgi/) registers every one. A module that needs two adapters belongs in wsgi/."""
    crossings = [
        f"{name} imports {target}"
        for name, targets in sorted(graph().items())
        for target in sorted(targets)
        if role(name) in ADAPTERS
        and role(target) in ADAPTERS
        and role(name) != role(target)
        and (role(name), role(target)) not in TRANSLATES
    ]
    assert crossings == []
    assert {role(t) for t in graph()["appliance.wsgi.app"]} >= set(ADAPTERS)
    for name, targets in graph().items():
        if role(name) not in (WSGI, TESTING, ENTRY_POINT):
            assert len({role(t) for t in targets} & set(ADAPTERS) - {role(name)}) <= 1, name


def test_the_shared_root_loads_nothing_heavy(tmp_path):
    """The root's modules are imported by every process, the workers included: none may pull in numpy or
    OpenVINO (a worker would grow by ~100 MB and seconds of start-up)."""
    shared = sorted(name for name in modules() if role(name) == SHARED)
    code = (
        f"import importlib, json, sys\nfor m in {shared!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(m for m in json.loads(result.stdout) if m.split(".")[0] in HEAVY) == []


def test_a_worker_loads_neither_numpy_nor_openvino(tmp_path):
    """What a gunicorn worker imports (its config, worker class, app and engine client), in a fresh interpreter.
    gunicorn_conf reads the settings file at import, so one is written first."""
    code = f"""
import json, os, sys
from appliance.settings import RUNTIME_DIR_ENV, ServeSettings
ServeSettings(model_dir={str(tmp_path)!r}, served_model_name="m", model_created=0, runtime_dir={str(tmp_path)!r}).save()
os.environ[RUNTIME_DIR_ENV] = {str(tmp_path)!r}
import appliance.http.gunicorn_conf, appliance.http.worker, appliance.wsgi.app, appliance.http.client
print(json.dumps(sorted(sys.modules)))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert "appliance.wsgi.app" in loaded and "flask" in loaded  # it did import the worker's code
    assert sorted(m for m in loaded if m.split(".")[0] in HEAVY) == []
    others = {m for m in loaded if within(m, "appliance") and role(m) not in WORKER_ROLES | {SHARED}}
    assert others == set(), f"a worker loads modules of another process: {sorted(others)}"


# ---------------------------------------------------------------- no import cycles

CYCLE_ROOTS = ("appliance", "export", "bench")  # the packages whose import graph must be acyclic


@cache
def every_module() -> dict[str, Path]:
    return {module_name(path): path for root in CYCLE_ROOTS for path in sorted((ROOT / root).rglob("*.py"))}


def import_edges(name: str, path: Path) -> set[str]:
    """The modules of CYCLE_ROOTS that `name` imports by any statement: at the top, inside a function, under
    `if TYPE_CHECKING:` (an annotation-only cycle still says two modules are one unit). `from X import Y` is X.Y
    when that is a module, else X; a name that is no module of ours (a third-party package) is no edge."""
    known = every_module()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return {module for module in found if module in known and module != name}


def find_cycles(edges: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """For each strongly connected component of more than one module (Tarjan): a shortest cycle through its first
    module (a -> ... -> a), and all its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # recursion depth is bounded by the number of modules (a few hundred)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            connect(node)
    found = []
    for component in components:  # breadth first from the start, inside the component, back to the start
        start = min(component)
        came_from: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in came_from:
            following = []
            for node in frontier:
                for target in sorted(edges[node] & component):
                    if target not in came_from:
                        came_from[target] = node
                        following.append(target)
            frontier = following
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(came_from[path[-1]])
        found.append((path[::-1], sorted(component)))
    return sorted(found)


def test_the_checker_finds_cycles(tmp_path):
    assert find_cycles({"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"b"}, "e": {"a"}}) == [
        (["a", "b", "c", "a"], ["a", "b", "c", "d"])
    ]
    assert find_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    probe = tmp_path / "example.py"  # an annotation-only import and one inside a function are edges too
    probe.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from appliance.runtime.sequence import Sequence\n"
        "def lazy():\n    from bench import client\n    import numpy\n"
    )
    assert import_edges("appliance.runtime.example", probe) == {"appliance.runtime.sequence", "bench.client"}


def test_no_import_cycles():
    """No two modules of appliance/, export/ or bench/ import each other, directly or round a loop, by any import
    (top-level, inside a function, or for annotations only). A function-level import that only dodges a cycle at
    run time still ties two modules into one, and hides which one is the lower layer."""
    edges = {name: import_edges(name, path) for name, path in every_module().items()}
    found = find_cycles(edges)
    assert found == [], "import cycles:\n" + "\n".join(
        f"{' -> '.join(cycle)} (tied together: {', '.join(component)})" for cycle, component in found
    )
