"""Who may talk to the server (HTTP worker side: no numpy/OpenVINO here). SCAFFOLD (issue #13): API keys (one per
line, constant-time compare), the Host-header allow-list, and the refusal of an unauthenticated non-loopback bind
land here; app.py's `authorize` and cli.py call it."""

from __future__ import annotations
