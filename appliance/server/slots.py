"""One served model in the engine process (engine_service.py): its ModelSpec, Engine, state and output parsers.

A plain `serve` has one slot; a config file's model_config_list one per model. A reload gives a changed model a new
slot (a new `serial`, which workers compare to drop a status they kept for the old one) and retires the old slot
once its `jobs` end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance import tool_prompt
from appliance.config import EngineConfig
from appliance.server import protocol as p
from appliance.server.settings import ModelSpec, ServeSettings

if TYPE_CHECKING:
    from appliance.engine import Engine

# A step that has not ended after this long means the engine is wedged (the longest legitimate step, a
# max_num_batched_tokens prefill of a large model on a slow CPU, is seconds). Readiness then answers 503.
ENGINE_STALL_SECONDS = 60.0


def single_spec(settings: ServeSettings, engine: EngineConfig | None = None) -> ModelSpec:
    """The one model of a plain `serve` (settings.models empty: callers that build ServeSettings by hand)."""
    return ModelSpec(
        settings.served_model_name,
        settings.model_dir,
        settings.model_created,
        engine or EngineConfig(),
        settings.tool_parser,
        settings.reasoning_parser,
    )


def model_not_found(name: str) -> p.Failed:
    return p.Failed(404, f"The model `{name}` does not exist", "model", "model_not_found")


@dataclass
class Slot:
    """One served model. `jobs` counts its jobs in flight (a retiring slot waits for them)."""

    spec: ModelSpec
    serial: int
    state: str = "loading"  # loading | ready | failed | stopping
    error: str | None = None
    engine: Engine | None = None
    device: str = ""
    jobs: int = 0
    _parsers: tuple[str, str] | None = None

    def parsers(self) -> tuple[str, str]:
        """(tool parser, reasoning parser): the spec's, `auto` resolved from the chat template once."""
        if self._parsers is None:
            assert self.engine is not None, "called with an attached engine"
            template = self.engine.tokenizer.chat_template
            self._parsers = (
                tool_prompt.choose_tool_parser(template, self.spec.tool_parser),
                tool_prompt.choose_reasoning_parser(template, self.spec.reasoning_parser),
            )
        return self._parsers

    def problem(self) -> str | None:
        """Why the attached engine cannot serve now (None: it can): its loop died, or one step has taken
        longer than ENGINE_STALL_SECONDS."""
        e = self.engine
        if e is None:
            return None
        if not e.alive:
            return f"the engine loop stopped: {type(e.dead).__name__ if e.dead else 'exited'}"
        stalled = time.monotonic() - e.heartbeat
        if stalled > ENGINE_STALL_SECONDS:
            return f"the engine loop has not advanced for {stalled:.0f} s"
        return None

    def live_state(self) -> tuple[str, str | None]:
        """(state, error) as they are now: a ready slot whose engine cannot serve reads as failed."""
        if self.state == "ready" and (problem := self.problem()):
            return "failed", problem
        return self.state, self.error

    def info(self) -> p.ModelInfo:
        state, error = self.live_state()
        return p.ModelInfo(self.spec.name, self.spec.created, state, error)
