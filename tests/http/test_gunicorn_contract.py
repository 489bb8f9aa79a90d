"""The gunicorn internals the edge worker (appliance/http/worker.py) stands on, named once, checked in seconds.

worker.py subclasses gunicorn's gthread worker and connection and overrides private methods; gunicorn is pinned
exactly (pyproject.toml). An upgrade (a security release is the likely one) can rename or reshape any of them, and
the server tests would then fail as timeouts or dropped connections. Here each one fails by name, with no server:

- CONTRACT: every gunicorn module, function, method, attribute and setting worker.py uses, with the signature of
  each callable, and how worker.py relies on it;
- CALLED_FROM: where gunicorn calls what worker.py overrides (an override gunicorn no longer calls is dead code);
- worker.py is scanned (its AST) so that it uses nothing of gunicorn's outside CONTRACT, its own attributes and
  methods shadow nothing of gunicorn's, and each override notes the gunicorn behaviour it replaces, naming the
  pinned version.

After an upgrade: re-read gthread.py (ThreadWorker, TConn) against the notes in worker.py, update CONTRACT and the
notes, then PIN.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from functools import cache
from pathlib import Path

import gunicorn
import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "appliance" / "http" / "worker.py"
PIN = "27.0.1"  # the gunicorn release CONTRACT and worker.py's notes were checked against

GTHREAD = "gunicorn.workers.gthread"
WORKER_CLS, CONN_CLS = f"{GTHREAD}.ThreadWorker", f"{GTHREAD}.TConn"
CONFIG = "gunicorn.config.Config"
PARSER, UNREADER, QUEUE = (
    "gunicorn.http.parser.Parser",
    "gunicorn.http.unreader.SocketUnreader",
    f"{GTHREAD}.PollableMethodQueue",
)

# name -> signature for a callable, None for a constant, attribute or setting; the comment: how worker.py uses it.
CONTRACT: dict[str, str | None] = {
    # the worker (EdgeWorker)
    f"{WORKER_CLS}": None,  # subclassed
    f"{WORKER_CLS}.__init__": "(self, *args, **kwargs)",  # extended: the edge's state
    f"{WORKER_CLS}.init_process": "(self)",  # overridden: settings and pools before gthread's own
    f"{WORKER_CLS}.load_wsgi": "(self)",  # overridden: the app wrapped in edge_policy.paced
    f"{WORKER_CLS}.accept": "(self, listener)",  # overridden: per-address caps, TLS wrap without handshake
    f"{WORKER_CLS}.enqueue_req": "(self, conn)",  # overridden: the one door; the request is read in the loop
    f"{WORKER_CLS}.handle": "(self, conn)",  # called: what a pool thread runs for a connection
    f"{WORKER_CLS}.finish_request": "(self, conn, fs)",  # overridden; its keep-alive path is called
    f"{WORKER_CLS}.handle_request": "(self, req, conn)",  # overridden: bounded sends around it
    f"{WORKER_CLS}.murder_pending": "(self)",  # overridden: the loop's once-a-second hook for deadlines
    f"{WORKER_CLS}.handle_quit": "(self, sig, frame)",  # overridden: the probe pool shut down too
    f"{WORKER_CLS}.notify": "(self)",  # overridden: the heartbeat at most once a second, not per loop pass
    f"{WORKER_CLS}.alive": None,  # read: False once stopping
    f"{WORKER_CLS}.cfg": None,  # read
    f"{WORKER_CLS}.wsgi": None,  # replaced by the paced app in load_wsgi
    f"{WORKER_CLS}.poller": None,  # the selector: sockets being read, handshaking or lingering are registered
    f"{WORKER_CLS}.tpool": None,  # the generation threads
    f"{WORKER_CLS}.method_queue": None,  # finish_request deferred to the loop
    f"{WORKER_CLS}.nr_conns": None,  # counted as gthread does: +1 per accept, -1 per close
    f"{WORKER_CLS}.worker_connections": None,  # where gthread stops accepting
    f"{WORKER_CLS}.keepalived_conns": None,  # idle kept-alive connections (a deque), oldest shed first
    f"{QUEUE}.defer": "(self, callback, *args)",
    f"{GTHREAD}.STOP_KEEPALIVE_LINGER": None,  # how long a stopping worker keeps a request under way
    # the connection (EdgeConn)
    f"{CONN_CLS}": None,  # subclassed
    f"{CONN_CLS}.__init__": "(self, cfg, sock, client, server)",
    f"{CONN_CLS}.init": "(self)",  # overridden; returns at once when `initialized` (TLS done by the loop)
    f"{CONN_CLS}.close": "(self, graceful=False)",  # overridden: counts released first
    f"{CONN_CLS}.cfg": None,
    f"{CONN_CLS}.sock": None,
    f"{CONN_CLS}.client": None,  # the peer address
    f"{CONN_CLS}.parser": None,  # None until init
    f"{CONN_CLS}.initialized": None,  # set by the loop's TLS path
    f"{CONN_CLS}.is_http2": None,  # HTTP/2 connections take gunicorn's own path
    f"{CONN_CLS}.data_ready": None,  # set on dispatch: handle() must not wait for data again
    # the parser's reads
    f"{PARSER}.unreader": None,
    f"{UNREADER}.sock": None,  # present on socket readers (whose chunk() is bounded by the request's deadline)
    f"{UNREADER}.chunk": "(self, size_hint=None)",  # wrapped: each read under the request's deadline
    f"{UNREADER}.unread": "(self, data)",  # the request read by the loop, handed to the parser
    f"{UNREADER}.take_buffered": "(self)",  # a pipelined request's bytes read ahead
    "gunicorn.glogging.Logger._compute_access_log_enabled": "(self)",  # gunicorn_conf.AccessLogger overrides it
    # settings
    f"{CONFIG}.worker_connections": None,
    f"{CONFIG}.is_ssl": None,
    f"{CONFIG}.suppress_ragged_eofs": None,
    # modules and functions
    "gunicorn.http": None,
    "gunicorn.http.get_parser": "(cfg, source, source_addr, http2_connection=False)",  # for the loop's TLS path
    "gunicorn.sock": None,
    "gunicorn.sock.ssl_context": "(conf)",  # one SSL context per worker
    "gunicorn.http2.negotiation": None,
    "gunicorn.http2.negotiation.prior_knowledge_allowed": "(cfg, peer_addr)",  # h2c: gunicorn's own path
}

# Where gunicorn calls (or registers) what worker.py overrides: (gunicorn function, the name it must reference).
CALLED_FROM = [
    (f"{WORKER_CLS}.on_client_socket_readable", "enqueue_req"),  # a kept-alive connection's next request
    (f"{WORKER_CLS}.finish_request", "enqueue_req"),  # pipelined bytes left in the parser
    (f"{WORKER_CLS}.set_accept_enabled", "accept"),
    (f"{WORKER_CLS}.run", "murder_pending"),
    (f"{WORKER_CLS}.handle", "init"),  # conn.init() in the thread
    (f"{WORKER_CLS}.handle", "handle_request"),
    (f"{CONN_CLS}.init", "initialized"),  # the guard EdgeConn.init relies on for TLS
    ("gunicorn.workers.base.Worker.init_process", "load_wsgi"),
    ("gunicorn.workers.base.Worker.init_process", "run"),
    ("gunicorn.workers.base.Worker.init_signals", "handle_quit"),
    ("gunicorn.http.wsgi.default_environ", "gunicorn.socket"),  # the socket edge_policy.paced bounds
    (f"{WORKER_CLS}.run", "notify"),  # the loop's heartbeat
    ("gunicorn.glogging.Logger.access", "access_log_enabled"),  # gunicorn_conf.AccessLogger's switch
]

# Names worker.py uses on objects of its own that gunicorn's classes also have.
NOT_GUNICORN = {"buf": "edge.Request's bytes (worker.py never reads the unreader's buffer)"}


def resolve(path: str) -> object:
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


@cache
def instance_attributes(cls: type) -> frozenset[str]:
    """The attributes gunicorn's code assigns on `self` in `cls` and its bases (set in __init__ or later)."""
    names = set()
    for klass in cls.__mro__[:-1]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return frozenset(names)


def members(cls: type) -> set[str]:
    return {name for klass in cls.__mro__[:-1] for name in vars(klass)} | set(instance_attributes(cls))


def exists(path: str) -> bool:
    owner, _, name = path.rpartition(".")
    if owner == CONFIG:
        from gunicorn.config import Config

        return hasattr(Config(), name)
    try:
        resolve(path)
        return True
    except (ImportError, AttributeError):
        pass
    try:
        cls = resolve(owner)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and name in instance_attributes(cls)


@pytest.mark.parametrize("path", list(CONTRACT))
def test_each_internal_still_exists_with_its_signature(path):
    assert exists(path), f"gunicorn {gunicorn.__version__} has no {path} (worker.py uses it)"
    expected = CONTRACT[path]
    if expected is not None:
        actual = str(inspect.signature(resolve(path)))
        assert actual == expected, f"{path} is now {actual}, worker.py was written for {expected}"


@pytest.mark.parametrize(("caller", "name"), CALLED_FROM)
def test_gunicorn_still_calls_what_worker_py_overrides_from_where_it_did(caller, name):
    assert exists(caller), f"gunicorn {gunicorn.__version__} has no {caller}"
    tree = ast.parse(textwrap.dedent(inspect.getsource(resolve(caller))))
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert name in names, f"{caller} no longer reaches {name} (worker.py relies on it)"


def test_the_contract_was_checked_against_the_pinned_gunicorn():
    pin = re.search(r'"gunicorn==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None
    assert gunicorn.__version__ == pin[1] == PIN, (
        f"gunicorn {gunicorn.__version__} installed, {pin[1]} pinned, contract checked against {PIN}: "
        "re-read gthread.py against worker.py's notes, then update CONTRACT, the notes and PIN"
    )


# ---- worker.py, scanned


@cache
def worker_tree() -> ast.Module:
    return ast.parse(WORKER.read_text())


def gunicorn_imports() -> dict[str, str]:
    """worker.py's names bound to gunicorn modules or objects: local name -> dotted path."""
    bound = {}
    for node in ast.walk(worker_tree()):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gunicorn":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gunicorn":
                    bound[alias.asname or alias.name] = alias.name
    return bound


def own_classes() -> dict[str, tuple[str, ast.ClassDef]]:
    """worker.py's subclasses of gunicorn classes: name -> (the gunicorn base's path, the class)."""
    bound = gunicorn_imports()
    return {
        node.name: (bound[base.id], node)
        for node in worker_tree().body
        if isinstance(node, ast.ClassDef)
        for base in node.bases
        if isinstance(base, ast.Name) and base.id in bound
    }


def own_names(cls: ast.ClassDef) -> tuple[set[str], set[str]]:
    """A subclass's methods, and the attributes its __init__ sets (its own state)."""
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    attributes = set()
    for method in cls.body:
        if isinstance(method, ast.FunctionDef) and method.name == "__init__":
            for node in ast.walk(method):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    if isinstance(node.value, ast.Name) and node.value.id == "self":
                        attributes.add(node.attr)
    return methods, attributes


def used_names() -> set[str]:
    """Every attribute name worker.py reads or writes, and names given to getattr/hasattr."""
    names = set()
    for node in ast.walk(worker_tree()):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                names.add(node.args[1].value)
    return names


def test_worker_py_uses_nothing_of_gunicorns_outside_the_contract():
    """By name: any attribute worker.py touches that a gunicorn class it deals with has (the worker, connection,
    parser, reader, method queue, settings), any gunicorn module or name it imports, any function it calls on
    one, must be in CONTRACT (or be one of worker.py's own, or in NOT_GUNICORN)."""
    bound = gunicorn_imports()
    missing = {path for path in bound.values() if path not in CONTRACT}
    for node in ast.walk(worker_tree()):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            path = f"{bound[node.value.id]}.{node.attr}"
            missing |= {path} - CONTRACT.keys()
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "cfg":
            missing |= {f"{CONFIG}.{node.attr}"} - CONTRACT.keys()
    own = set()
    for _, cls in own_classes().values():
        methods, attributes = own_names(cls)
        own |= attributes | {m for m in methods if m.startswith("_") and not m.startswith("__")}
    listed = {path.rpartition(".")[2] for path in CONTRACT}
    for path in (WORKER_CLS, CONN_CLS, PARSER, UNREADER, QUEUE):
        for name in (used_names() & members(resolve(path))) - own - NOT_GUNICORN.keys():
            if name not in listed:  # listed for any class: `close` of a socket is TConn.close by name
                missing.add(f"{path}.{name}")
    assert not missing, f"worker.py uses gunicorn internals not in CONTRACT: {sorted(missing)}"


def test_worker_py_shadows_nothing_of_gunicorns_but_its_listed_overrides():
    """An attribute or helper method of worker.py's that gunicorn's class also has (after an upgrade, say) would
    silently replace gunicorn's: only the overrides listed in CONTRACT may."""
    clashes = []
    for name, (base, cls) in own_classes().items():
        methods, attributes = own_names(cls)
        for own in sorted(methods | attributes):
            if own in members(resolve(base)) and f"{base}.{own}" not in CONTRACT:
                clashes.append(f"{name}.{own} shadows gunicorn's {base}.{own}")
    assert not clashes


def test_each_override_notes_the_gunicorn_behaviour_it_replaces():
    """Each listed method worker.py overrides (not __init__, which only adds state) says, in a comment or its
    docstring, what gunicorn PIN does there."""
    source = WORKER.read_text()
    unnoted = []
    for name, (base, cls) in own_classes().items():
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef) or method.name == "__init__":
                continue
            if f"{base}.{method.name}" in CONTRACT:
                text = ast.get_source_segment(source, method) or ""
                if f"gunicorn {PIN}:" not in text:
                    unnoted.append(f"{name}.{method.name}")
    assert not unnoted, f"overrides without a 'gunicorn {PIN}:' note: {unnoted}"
