"""What Engine's classes share, declared once: Engine (core.py) is one class over the loop's state, written in
three files (core.py: the step; admission.py: submissions and the inbox; liveness.py: the loop and its failure
paths), because all three work on that state (the inbox, `_admit`, `dead`, the counters). This base names the state
and the few methods one file calls on another, so that each file reads (and type-checks) on its own.

The engine's features are not part of it: n > 1 choices, speculative decoding and beam search are objects
(choices.py, speculation.py, beams.py) built in Engine.__init__ with what each uses as its constructor's arguments."""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.config import EngineConfig
from appliance.manifest import Manifest
from appliance.outputs import Chunk
from appliance.runtime.backends.base import Backend
from appliance.runtime.engine.beams import BeamSearches
from appliance.runtime.engine.choices import FollowerForks
from appliance.runtime.engine.speculation import Speculation
from appliance.runtime.grammar import GrammarCompiler
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import Sequence
from appliance.runtime.speculative.base import Proposer
from appliance.runtime.tokenizer import Tokenizer


class EngineState:
    model_dir: Path
    config: EngineConfig
    manifest: Manifest
    tokenizer: Tokenizer
    grammars: GrammarCompiler  # structured output: compiles grammars, hands out per-sequence matchers
    eos_token_ids: list[int]
    backend: Backend
    max_context: int
    pool: BlockPool
    scheduler: Scheduler
    counters: dict[str, int]
    proposers: dict[str, Proposer]  # speculative decoding (speculation.py): by name, prompt_lookup / draft
    _wake: threading.Event  # set: the engine thread has something to do
    _stop: bool
    _stop_reason: str
    _inbox: queue.SimpleQueue  # ("add", groups of sequences) or ("cancel", a Sequence or BeamGroup)
    _inbox_seqs: int  # sequences submitted, not yet taken by the engine thread
    _backlog: deque  # inbox entries drained but not taken yet (the drain's time budget), in order
    _admit: threading.Lock  # check and count a submission at once (no two pass on one slot)
    _ids: itertools.count
    # liveness: time.monotonic() of the loop's last iteration (at least every IDLE_WAIT s when idle, every step
    # when busy); what ended the engine thread (None: running); called from the engine thread when it dies
    heartbeat: float
    dead: BaseException | None
    on_death: Callable[[BaseException], None] | None
    _thread: threading.Thread
    _faults: set[str]  # inject_fault: pending injected faults

    choices: FollowerForks  # n > 1 (choices.py)
    speculation: Speculation  # speculative decoding (speculation.py)
    beams: BeamSearches  # beam search (beams.py)

    if TYPE_CHECKING:  # defined by one of Engine's classes (core.py, admission.py, liveness.py); named for the others

        def step(self) -> None: ...
        def _drain_inbox(self) -> None: ...
        def _try_fail(self, seq: Sequence, error: str) -> None: ...
        def _finish(self, seq: Sequence, reason: str, chunk: Chunk | None = None, error: str | None = None) -> None: ...
