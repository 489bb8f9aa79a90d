"""Draft-model speculative decoding: a second, small exported model with the same tokenizer drafts tokens.

(Scaffold: the draft helper fills this in.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from appliance.config import EngineConfig
from appliance.speculative.base import Proposer

if TYPE_CHECKING:
    from appliance.sequence import Sequence


class DraftModel(Proposer):
    """Loads `model_dir` (an export, same tokenizer as the target: refused otherwise) on config.draft_device (or
    config.device) with its own paged KV pool, and keeps one draft KV table per speculating sequence."""

    name = "draft"

    def __init__(self, model_dir: str | Path, config: EngineConfig, target_dir: Path, max_tokens_per_step: int):
        raise NotImplementedError("draft-model speculation is not built yet")

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
        raise NotImplementedError
