"""systemd's notify protocol (sd_notify(3)) without a dependency: READY=1 once the model serves, STOPPING=1 on a
stop, and WATCHDOG=1 keep-alives fed by the engine's heartbeat, so systemd (`Type=notify`, `WatchdogSec=`) restarts
a server whose engine is wedged, not only one that exited. A no-op when $NOTIFY_SOCKET is unset (a terminal,
Docker, tests that do not ask for it).

The protocol is one datagram per message on the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or `@name` for
the abstract namespace), newline-separated VAR=value lines. systemd checks the sender: with NotifyAccess=main
only this process (the engine process, the unit's main PID) may speak. So the variables are moved out of
os.environ at the first call (sd_notify's `unset_environment`): gunicorn, our child, would otherwise inherit
NOTIFY_SOCKET and its arbiter sends its own READY=1 as soon as it binds, before any model is loaded
(gunicorn/arbiter.py, 27.0); systemd would then log a refused message on every start.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("appliance.serve")

_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
_claimed: dict[str, str] = {}


def _environment() -> dict[str, str]:
    """systemd's variables, taken out of os.environ the first time (and again if a caller sets them anew)."""
    if "NOTIFY_SOCKET" in os.environ or "WATCHDOG_USEC" in os.environ:
        _claimed.clear()
        for name in _ENV:
            value = os.environ.pop(name, None)
            if value:
                _claimed[name] = value
    return _claimed


def _address(name: str) -> str | None:
    """$NOTIFY_SOCKET as a socket address: `@x` is the abstract "\\0x"; only absolute paths otherwise (sd_notify's
    rule: a relative path would depend on our working directory)."""
    if name.startswith("@"):
        return "\0" + name[1:]
    return name if name.startswith("/") else None


def notify(state: str) -> bool:
    """Sends one notification (e.g. "READY=1"); False when there is no $NOTIFY_SOCKET or the send failed."""
    name = _environment().get("NOTIFY_SOCKET")
    address = _address(name) if name else None
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
        return True
    except OSError as exc:  # systemd gone or restarting: nothing to do but note it
        log.warning("sd_notify failed", extra={"state": state.split("\n", 1)[0], "error": str(exc)})
        return False


def ready() -> None:
    notify("READY=1\nSTATUS=serving")


def stopping() -> None:
    notify("STOPPING=1\nSTATUS=stopping: finishing in-flight requests")


def watchdog_interval() -> float | None:
    """Seconds between keep-alives (half of WatchdogSec=), or None when systemd asked for no watchdog or asked
    another process ($WATCHDOG_PID names someone else)."""
    env = _environment()
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    if not usec or "NOTIFY_SOCKET" not in env or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2 / 1e6 if int(usec) > 0 else None
    except ValueError:
        return None


def start_watchdog(healthy: Callable[[], bool]) -> threading.Thread | None:
    """When systemd asked for a watchdog ($WATCHDOG_USEC, $WATCHDOG_PID): a daemon thread sends WATCHDOG=1 every
    half period while `healthy()` is true; a wedged or dead engine stops the keep-alives and systemd restarts us.

    An unhealthy spell only pauses the keep-alives: if it ends within WatchdogSec= (a slow step under
    ENGINE_STALL_SECONDS' limit recovering) nothing happens. Also claims the notify variables from os.environ,
    so call it before starting children. Returns the thread (None: no watchdog)."""
    notify("STATUS=loading the model")
    interval = watchdog_interval()
    if interval is None:
        return None

    def keep_alive() -> None:
        was_healthy = True
        while True:
            try:
                ok = healthy()
            except Exception:  # a broken health check is an unhealthy server, not a dead watchdog thread
                log.exception("the watchdog's health check failed")
                ok = False
            if ok:
                notify("WATCHDOG=1" if was_healthy else "WATCHDOG=1\nSTATUS=serving")
            elif was_healthy:
                notify("STATUS=unhealthy: the engine loop died or stalled; keep-alives stopped")
            was_healthy = ok
            time.sleep(interval)

    thread = threading.Thread(target=keep_alive, name="sd-watchdog", daemon=True)
    thread.start()
    return thread
