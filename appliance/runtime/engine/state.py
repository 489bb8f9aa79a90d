"""What the parts of Engine share, declared once: Engine is assembled from parts (admission.py, choices.py,
beams.py, liveness.py, core.py), each a class of methods over the state Engine.__init__ sets. This base names that
state and the methods one part calls on another, so that each part reads (and type-checks) on its own."""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from appliance.config import EngineConfig
from appliance.outputs import Chunk
from appliance.params import SamplingParams
from appliance.runtime.backends.base import Backend
from appliance.runtime.engine.speculation import Speculation
from appliance.runtime.grammar import GrammarCompiler
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import Sequence
from appliance.runtime.speculative.base import Proposer
from appliance.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from appliance.runtime.engine.beams import BeamGroup


class EngineState:
    model_dir: Path
    config: EngineConfig
    tokenizer: Tokenizer
    grammars: GrammarCompiler  # structured output: compiles grammars, hands out per-sequence matchers
    eos_token_ids: list[int]
    backend: Backend
    max_context: int
    pool: BlockPool
    scheduler: Scheduler
    counters: dict[str, int]
    proposers: dict[str, Proposer]  # speculative decoding (speculation.py): by name, prompt_lookup / draft
    speculation: Speculation
    _wake: threading.Event  # set: the engine thread has something to do
    _stop: bool
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

    if TYPE_CHECKING:  # defined by the parts; named here for the others

        def step(self) -> None: ...
        def token_text(self, token: int) -> str: ...
        def _queued(self) -> int: ...
        def _cancel(self, target: Sequence | BeamGroup) -> None: ...
        def _drain_inbox(self) -> None: ...
        def _injected(self, kind: str) -> None: ...
        def _isolated(self, seq: Sequence) -> AbstractContextManager[None]: ...
        def _fail(self, seq: Sequence, error: str) -> None: ...
        def _try_fail(self, seq: Sequence, error: str) -> None: ...
        def _finish(self, seq: Sequence, reason: str, chunk: Chunk | None = None, error: str | None = None) -> None: ...
        def _finish_group(
            self, group: BeamGroup, chunks: list[Chunk] | None = None, error: str | None = None
        ) -> None: ...
        def _finish_prompt_only(self, seq: Sequence) -> None: ...
        @staticmethod
        def _set_timing(seq: Sequence) -> None: ...
        def _copy_tails(self, copies: list[tuple[int, int, int]]) -> None: ...
        def _beam_logits(self, beams: list[tuple[Sequence, int]], logits: np.ndarray) -> None: ...
        def _unstall(self) -> None: ...
        def _beam_max_len(self, prompt_len: int, params: SamplingParams, max_len: int) -> int: ...
