"""The server's state directory, checked once at start-up: where the Responses store and pulled models are written
(appliance/paths.py `state_dir`; the systemd unit and the image put the KV disk tier there too).

Why at start-up: the store writes after a generation, so a directory it cannot write would otherwise show up as a
500 after the work is done (a stream cut without a terminal event), on every request. The check writes a probe
file there (what the store will do), so a read-only mount, a missing permission or a full disk are all found,
then:
- a state dir given explicitly (--state-dir / APPLIANCE_STATE_DIR) that cannot be written refuses the start with
  one line (exit 78): the operator asked for state there, and a service that cannot keep it is misconfigured;
- the default (the data dir, which a service keeps read-only) logs one warning and the server serves without a
  store: `store: true` Responses requests are refused before any work (503), `store: false` ones are served.
Either way the directory, once checked, is exported as APPLIANCE_STATE_DIR, so the engine process, the HTTP
workers and a pull's subprocess all use the same one.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from appliance import paths
from appliance.settings import ConfigError, ServeSettings

log = logging.getLogger("appliance.serve")


def write_problem(directory: Path) -> str:
    """Why `directory` cannot hold state ("" when it can): it is made if missing, then a probe file is written,
    synced and removed."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-") as probe:
            probe.write(b"0")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def check_state_dir(settings: ServeSettings) -> None:
    """Resolves and checks the state dir for `serve` (the module's docstring says what follows a failure); sets
    `settings.state_dir` (absolute) and `settings.state_problem`."""
    explicit = settings.state_dir
    directory = Path(explicit).expanduser().resolve() if explicit else paths.state_dir().resolve()
    problem = write_problem(directory)
    if problem and explicit:
        raise ConfigError(
            f"--state-dir {directory} cannot be written ({problem}): give the service user a writable directory "
            "(docs/deploy.md, State)"
        )
    settings.state_dir = str(directory)
    settings.state_problem = f"the state dir {directory} cannot be written ({problem})" if problem else ""
    if problem:
        log.warning(
            f"{settings.state_problem}: the Responses API's store (store: true) and pulls are off; give a writable "
            "--state-dir (APPLIANCE_STATE_DIR)",
            extra={"state_dir": str(directory)},
        )
    os.environ[paths.STATE_DIR_ENV] = str(directory)
