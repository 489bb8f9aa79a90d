"""Ollama's `keep_alive`: how long a model stays loaded after its last request, in one parser shared by the serve
flag (`--keep-alive`), a config file's per-model `keep_alive` and the Ollama requests' field, so all three read the
same spellings.

Ollama's rules (its api.Duration): a JSON number is seconds (a fraction allowed), a string is a Go duration ("5m",
"30s", "1h30m", "1.5h", "300ms"), a negative value of either kind means "keep loaded forever", 0 means "unload as
soon as this request ends". A bare number written as a string ("300") is seconds too, as Ollama's
OLLAMA_KEEP_ALIVE reads it. Anything else is refused (a ValueError naming the spellings), NaN too. Forever is
FOREVER (math.inf) in seconds, so callers compare numbers only.

Bounded: a duration of LONGEST or more (`1e300`, `"9999999999h"`, an integer too large for a float) is forever
too, so every finite keep_alive, added to now, is still a date: /api/ps shows a model's `expires_at`, and a
keep_alive of 1e300 once made it fail for everyone (a timestamp out of range).
"""

from __future__ import annotations

import math
import re

FOREVER = math.inf
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
LONGEST = 100 * 365 * 86400.0  # 100 years: no box stays up this long, and now + this is a date (year < 9999)
HELP = 'a duration ("5m", "30s", "1h30m") or seconds as a number; 0: unload after the request; negative: forever'


def parse_keep_alive(value: object) -> float:
    """Seconds (FOREVER for a negative value); ValueError for anything Ollama would not read as a duration."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be {HELP}")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:  # an integer past float's range: past LONGEST either way
            seconds = math.inf if value > 0 else -math.inf
    elif isinstance(value, str):
        seconds = _parse_text(value.strip())
    else:
        raise ValueError(f"keep_alive must be {HELP}")
    if math.isnan(seconds):
        raise ValueError(f"keep_alive must be {HELP}")
    return FOREVER if seconds < 0 or seconds >= LONGEST else seconds


def _parse_text(text: str) -> float:
    try:
        return float(text)  # a bare number: seconds (OLLAMA_KEEP_ALIVE's reading)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    total, pos = 0.0, 0
    for m in _PART.finditer(body):
        if m.start() != pos:
            break
        total += float(m[1]) * _UNIT_SECONDS[m[2]]
        pos = m.end()
    if not body or pos != len(body):
        raise ValueError(f"keep_alive {text!r} is not {HELP}")
    return sign * total


def show(seconds: float) -> str:
    """Seconds as the flag shows them: "forever", or a number."""
    return "forever" if seconds == FOREVER else f"{seconds:g}s"
