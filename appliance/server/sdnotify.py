"""systemd's notify protocol (sd_notify(3)) without a dependency: READY=1 once the model serves, STOPPING=1 on a
stop, and WATCHDOG=1 keep-alives fed by the engine's heartbeat, so systemd (`Type=notify`, `WatchdogSec=`) restarts
a server whose engine is wedged, not only one that exited. A no-op when $NOTIFY_SOCKET is unset (a terminal,
Docker, tests that do not ask for it).

SCAFFOLD (issue #13): the interface below is what appliance/server/supervisor.py calls; the service helper
implements it.
"""

from __future__ import annotations

from collections.abc import Callable


def notify(state: str) -> bool:
    """Sends one notification (e.g. "READY=1"); False when there is no $NOTIFY_SOCKET or the send failed."""
    return False


def ready() -> None:
    notify("READY=1")


def stopping() -> None:
    notify("STOPPING=1")


def start_watchdog(healthy: Callable[[], bool]) -> None:
    """When systemd asked for a watchdog ($WATCHDOG_USEC, $WATCHDOG_PID): a daemon thread sends WATCHDOG=1 every
    half period while `healthy()` is true; a wedged or dead engine stops the keep-alives and systemd restarts us."""
