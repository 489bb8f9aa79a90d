"""The access log (gunicorn's, through appliance.http.access_log.AccessLogger and logs.dict_config): off by
default, where no request may pay for building its fields; on with --access-log, with gunicorn's own fields.

Each check runs in a fresh interpreter: gunicorn's logger applies the logging config to the process's loggers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import datetime, io, json, logging, sys
    from gunicorn import glogging
    from gunicorn.config import Config
    from appliance.http.access_log import AccessLogger
    from appliance.logs import JsonFormatter, dict_config

    cls, on = {"ours": AccessLogger, "gunicorn": glogging.Logger}[sys.argv[1]], sys.argv[2] == "on"
    cfg = Config()
    cfg.set("accesslog", "-" if on else None)
    cfg.set("logconfig_dict", dict_config("info", on))
    logger = cls(cfg)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logging.getLogger("gunicorn.access").handlers = [handler]
    built = []
    atoms = logger.atoms
    logger.atoms = lambda *a: built.append(1) or atoms(*a)

    class Resp:
        status, sent, headers = "200 OK", 123, [("Content-Type", "application/json")]

    class Req:
        headers = [("HOST", "127.0.0.1:8000"), ("USER-AGENT", "probe")]

    environ = {"REMOTE_ADDR": "127.0.0.1", "REQUEST_METHOD": "POST", "RAW_URI": "/v3/embeddings",
               "PATH_INFO": "/v3/embeddings", "QUERY_STRING": "", "SERVER_PROTOCOL": "HTTP/1.1",
               "HTTP_USER_AGENT": "probe"}
    logger.access(Resp(), Req(), environ, datetime.timedelta(microseconds=1500))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    for line in lines:
        line.pop("ts"), line.pop("pid")
        line["msg"] = line["msg"].split("[", 1)[0] + line["msg"].split("]", 1)[1]  # the time of day
    print(json.dumps({"built": len(built), "lines": lines}))
    """
)


def run(logger: str, access_log: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, logger, "on" if access_log else "off"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_with_the_access_log_off_no_request_builds_its_fields():
    assert run("ours", access_log=False) == {"built": 0, "lines": []}


@pytest.mark.parametrize("access_log", [True, False])
def test_the_lines_are_gunicorns_own(access_log):
    ours, theirs = run("ours", access_log), run("gunicorn", access_log)
    assert ours["lines"] == theirs["lines"]
    if access_log:
        assert len(ours["lines"]) == 1
        line = ours["lines"][0]
        assert line["logger"] == "gunicorn.access"
        assert '"POST /v3/embeddings HTTP/1.1" 200 123' in line["msg"], line
