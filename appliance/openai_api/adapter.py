"""What a client API's routes use of the app (appliance/openai_api/app.py's `Api`): its settings, engine client,
request bounds, body reader and readiness check. A Protocol, not an import of app.py: the app imports each API's
routes to register them, so the routes naming the app would be an import cycle (tests/test_architecture.py)."""

from __future__ import annotations

from typing import Any, Protocol

from appliance.http.client import EngineClient
from appliance.limits import Limits
from appliance.protocol import EngineStatus
from appliance.settings import ServeSettings


class AppApi(Protocol):
    settings: ServeSettings
    client: EngineClient
    limits: Limits

    def json_body(self) -> Any: ...
    def ready_status(self, model: str, fresh: bool = True) -> EngineStatus: ...
