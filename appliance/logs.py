"""Structured logs: one JSON object per line on stderr, quiet by default.

The same configuration serves the engine process (`setup`) and gunicorn's processes (`dict_config`, used as
gunicorn's logconfig_dict), so an operator gets one format from the whole server. At the default level "info"
only start-up, readiness and shutdown are logged; request details are at debug; gunicorn's own chatter and
the access log are off unless asked for.
"""

from __future__ import annotations

import json
import logging
import logging.config
import time

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def dict_config(level: str = "info", access_log: bool = False) -> dict:
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "root": {"level": "WARNING", "handlers": ["stderr"]},
        "loggers": {
            "appliance": {"level": level, "handlers": ["stderr"], "propagate": False},
            "gunicorn.error": {
                "level": "WARNING" if level != "DEBUG" else "DEBUG",
                "handlers": ["stderr"],
                "propagate": False,
            },
            "gunicorn.access": {
                "level": "INFO" if access_log else "WARNING",
                "handlers": ["stderr"],
                "propagate": False,
            },
        },
    }


def setup(level: str = "info") -> None:
    logging.config.dictConfig(dict_config(level))
