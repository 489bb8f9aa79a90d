"""gunicorn's logger for `appliance serve`, building access-log lines only when there is an access log.

gunicorn builds every access-log field of a request (a dict of ~30 atoms plus one per request header, response
header and environ key) whenever any log config is set, and then hands the line to the `gunicorn.access` logger,
which drops it at its level when --access-log is off. Our log config is always set (logs.dict_config, for one JSON
format from the whole server), so every request paid for fields nobody read: 25 us of CPU per request on this box
(`Logger.access` of a 5-header request, timed in process), 1.5% of a worker's CPU per embeddings request. With
--access-log on, the lines are gunicorn's own, unchanged (tests/http/test_access_log.py).
"""

from __future__ import annotations

from gunicorn import glogging


class AccessLogger(glogging.Logger):
    def _compute_access_log_enabled(self) -> bool:
        # gunicorn 27.0.1: enabled whenever any log config is set (ours always is: logconfig_dict); here only
        # with an access log to write to (--access-log: accesslog "-").
        return bool(self.cfg.accesslog) and super()._compute_access_log_enabled()
