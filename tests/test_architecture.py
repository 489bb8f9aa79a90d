"""The package's import boundaries, checked so that they hold as code moves.

`appliance/` has four roles (README "Layout"): the runtime (every module outside the three packages below, and
`backends/`), the serving processes (`server/`), the HTTP edge in the gunicorn workers (`openai_api/`) and the
harness tests and bench share (`testing/`). Two properties matter and nothing else enforces them:

- the runtime is a library: it never imports the server or the HTTP edge, and nothing in the package imports the
  test harness;
- a gunicorn worker stays light (about 32 MB, docs/serving.md): it loads neither numpy nor OpenVINO, and of the
  runtime only the wire types and bounds (`params`, `outputs`, `limits`).

The static checks read every module's AST (imports inside functions count too, as do module paths handed to
gunicorn as strings); the last test imports what a worker imports in a fresh interpreter and looks at sys.modules.
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

SERVER, HTTP, TESTING = "appliance.server", "appliance.openai_api", "appliance.testing"
ENTRY_POINT = "appliance.cli"  # glue: flags -> settings, then starts the server; belongs to no layer
# What a gunicorn worker runs: the HTTP edge plus the light half of server/ (gunicorn's config and worker class,
# the engine client and what it needs).
WORKER_SERVER_MODULES = {
    f"{SERVER}.{name}"
    for name in ("client", "protocol", "settings", "logs", "worker", "edge_policy", "gunicorn_conf", "auth")
}
# The runtime modules a worker may import: the package root (`__version__`), the wire types and the bounds.
WORKER_RUNTIME_MODULES = {"appliance", "appliance.params", "appliance.outputs", "appliance.limits", "appliance.config"}
HEAVY = ("numpy", "openvino", "onnxruntime", "tokenizers")

# A module path given as a string: "python:appliance.x" (gunicorn --config), "appliance.x:app()" (wsgi_app),
# "appliance.x.Class" (worker_class). Logger names ("appliance.http") match none of these forms.
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
    for package in (SERVER, HTTP, TESTING):
        if within(name, package):
            return package
    return ENTRY_POINT if name == ENTRY_POINT else "runtime"


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
    runtime = {name for name in modules() if role(name) == "runtime"}
    assert {
        "appliance",
        "appliance.engine",
        "appliance.scheduler",
        "appliance.params",
        "appliance.backends",
        "appliance.backends.base",
        "appliance.backends.kv_budget",
    } <= runtime
    assert not runtime & {
        "appliance.cli",
        "appliance.server.metrics",
        "appliance.server.gunicorn_conf",
        "appliance.openai_api.app",
        "appliance.testing.loopback",
    }
    assert WORKER_SERVER_MODULES <= set(modules()), "a worker module named above no longer exists"
    # Known edges are seen, lazy ones (inside a function) and string ones included.
    assert "appliance.engine" in graph()["appliance.server.supervisor"]
    assert "appliance.server.supervisor" in graph()["appliance.cli"]
    assert {"appliance.openai_api.app", "appliance.server.worker"} <= graph()["appliance.server.gunicorn_conf"]


def test_the_checker_sees_every_form_of_import():
    source = '''"""Docstrings are prose: appliance.server.nothing:here is not a reference."""
import appliance.server.client
from appliance.openai_api import app
from appliance import params, __version__
from .sibling import thing
def lazy():
    from appliance.testing.procinfo import children
    return "python:appliance.server.gunicorn_conf", "appliance.server.worker.EdgeWorker", "appliance.http"
'''
    found = imported(source, "appliance.backends.example")
    assert found == {
        "appliance.server.client",
        "appliance.openai_api.app",
        "appliance.params",
        "appliance",
        "appliance.backends.sibling",
        "appliance.testing.procinfo",
        "appliance.server.gunicorn_conf",
        "appliance.server.worker",
    }


def test_every_module_imported_or_named_exists():
    """Imports, and the strings gunicorn is started with (--config python:..., wsgi_app, worker_class), name
    modules that exist: a module moved without updating a string that names it fails here, not in production."""
    named = {target for targets in graph().values() for target in targets}
    assert "appliance.server.gunicorn_conf" in graph()["appliance.server.supervisor"]
    assert not named - set(modules()), f"no such module: {sorted(named - set(modules()))}"


# ---------------------------------------------------------------- the boundaries


def test_the_runtime_never_imports_the_server_or_the_http_edge():
    def allowed(name: str, target: str) -> bool:
        return role(name) != "runtime" or role(target) not in (SERVER, HTTP)

    assert violations(allowed) == []


def test_nothing_in_the_package_imports_the_test_harness():
    def allowed(name: str, target: str) -> bool:
        return role(target) != TESTING or role(name) == TESTING

    assert violations(allowed) == []


def test_worker_modules_import_only_worker_modules_and_the_wire_types():
    """Statically, so an import inside a request handler counts too (the subprocess test below only sees
    module-level imports)."""
    worker = {name for name in modules() if role(name) == HTTP} | WORKER_SERVER_MODULES

    def allowed(name: str, target: str) -> bool:
        return name not in worker or target in worker or target in WORKER_RUNTIME_MODULES

    assert violations(allowed) == []


def test_a_worker_loads_neither_numpy_nor_openvino(tmp_path):
    """What a gunicorn worker imports (its config, worker class, app and engine client), in a fresh interpreter.
    gunicorn_conf reads the settings file at import, so one is written first."""
    code = f"""
import json, os, sys
from appliance.server.settings import RUNTIME_DIR_ENV, ServeSettings
ServeSettings(model_dir={str(tmp_path)!r}, served_model_name="m", model_created=0, runtime_dir={str(tmp_path)!r}).save()
os.environ[RUNTIME_DIR_ENV] = {str(tmp_path)!r}
import appliance.server.gunicorn_conf, appliance.server.worker, appliance.openai_api.app, appliance.server.client
print(json.dumps(sorted(sys.modules)))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert "appliance.openai_api.app" in loaded and "flask" in loaded  # it did import the worker's code
    assert sorted(m for m in loaded if m.split(".")[0] in HEAVY) == []
    runtime = {m for m in loaded if within(m, "appliance") and role(m) == "runtime"}
    assert runtime <= WORKER_RUNTIME_MODULES, f"a worker loads runtime modules: {sorted(runtime)}"
