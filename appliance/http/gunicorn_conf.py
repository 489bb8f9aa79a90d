"""Gunicorn settings for `appliance serve` (loaded as `python:appliance.http.gunicorn_conf`).

Everything comes from the settings file in the runtime directory the engine process made; this module only
maps it onto gunicorn. gthread workers: a streaming response holds a thread, not a process, and the threads
mostly wait on the engine socket, so a few processes with many threads each serve many clients. The worker class
is gthread's with edge timeouts (appliance/http/worker.py): requests are read without a thread, under
--request-timeout; writes are bounded by --send-timeout; health probes have their own threads.

The access log is gunicorn's, on with --access-log only. gunicorn builds every access-log field (a dict of ~30
atoms and the request's headers) for each request whenever any log config is set, even when the access logger
then drops the line at its level; `AccessLogger` (http/access_log.py) skips that work when --access-log is off.

TLS (--tls-certfile/--tls-keyfile) is gunicorn's own certfile/keyfile, HTTP/1.1 only (no ALPN h2); the worker does
the handshakes in its event loop, under --request-timeout (worker.py). Terminating TLS here rather than in a proxy
keeps the edge box one process tree; a proxy in front remains the choice for ACME renewal or client certificates.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

from appliance import auth
from appliance.http.access_log import AccessLogger
from appliance.logs import dict_config
from appliance.settings import ServeSettings

_settings = ServeSettings.load()

wsgi_app = "appliance.wsgi.app:create_app()"
bind = [f"[{_settings.host}]:{_settings.port}" if ":" in _settings.host else f"{_settings.host}:{_settings.port}"]
workers = _settings.workers
worker_class = "appliance.http.worker.EdgeWorker"  # gthread + edge timeouts (its docstring says why)
threads = _settings.threads
worker_connections = max(1000, 2 * _settings.threads)
graceful_timeout = max(1, int(_settings.graceful_timeout))
timeout = 60  # worker heartbeat; gthread beats from its event loop, not per request
keepalive = _settings.keepalive_timeout  # idle kept-alive connections wait in the worker's poller, not in a thread
proc_name = "appliance-http"
control_socket_disable = True  # gunicorn's default control socket path is shared by every instance
accesslog = "-" if _settings.access_log else None
loglevel = _settings.log_level
logconfig_dict = dict_config(_settings.log_level, _settings.access_log)
logger_class = AccessLogger
certfile = _settings.tls_certfile
keyfile = _settings.tls_keyfile

_PR_SET_PDEATHSIG = 1


def on_starting(server) -> None:
    """If the engine process dies, so do we (SIGTERM: graceful), rather than serving 503s forever."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if _settings.supervisor_pid and os.getppid() != _settings.supervisor_pid:
        server.log.error("the engine process is gone before gunicorn started")
        sys.exit(1)


def when_ready(server) -> None:
    """Listening: an open, unauthenticated server says so at every start (appliance/auth.py)."""
    warning = auth.exposure_warning(_settings)
    if warning:
        logging.getLogger("appliance.serve").warning(
            warning, extra={"host": _settings.host, "url": auth.base_url(_settings), "event": "unauthenticated"}
        )
