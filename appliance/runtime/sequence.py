"""One generation in flight: its tokens, KV blocks, and the per-sequence processors (sampler, detokenizer,
stop matcher). Owned by the engine thread only."""

from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from appliance.outputs import Chunk, Timing, TokenLogprob
from appliance.params import SamplingParams

if TYPE_CHECKING:
    from appliance.runtime.detokenizer import IncrementalDetokenizer
    from appliance.runtime.engine.beams import BeamGroup
    from appliance.runtime.sampling import SequenceSampler
    from appliance.runtime.speculative.state import SpecState
    from appliance.runtime.stopping import StopStringMatcher


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt + generated
    params: SamplingParams
    max_len: int  # prompt + max_tokens, capped by the context
    out: queue.SimpleQueue  # Chunks for the requester
    timing: Timing
    # set when the engine thread starts the sequence (Engine._start), before any step uses them
    sampler: SequenceSampler = None  # type: ignore[assignment]
    detok: IncrementalDetokenizer = None  # type: ignore[assignment]
    stop: StopStringMatcher | None = None
    num_computed: int = 0  # positions whose KV is in the cache
    num_cached: int = 0  # prompt positions whose KV the prefix cache supplied (usage.prompt_tokens_details)
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    arrived: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache names of the full blocks, in order
    # prompt logprobs (params.prompt_logprobs): TokenLogprobs of the prompt tokens so far (the first: logprob None)
    prompt_logprobs: list[TokenLogprob] | None = None
    # beam search (params.best_of > 1): the request's BeamGroup, this beam's running sum of log-probabilities
    # and its tokens' logprob entries (when params.logprobs is set)
    group: BeamGroup | None = None
    beam_score: float = 0.0
    beam_logprobs: list[TokenLogprob] | None = None
    # n > 1: the request's other choices, waiting for this sequence's prompt KV to start from (copy-on-write)
    followers: list[Sequence] | None = None

    # speculative decoding: the sequence's state (None: it does not speculate) and the draft tokens proposed for
    # this step, fed after token_ids[num_computed:] and verified in the step's postprocess
    spec: SpecState | None = None
    draft: list[int] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def feed(self, n: int) -> list[int]:
        """The n tokens this step feeds: the uncomputed ones, then the draft's."""
        ids = self.token_ids[self.num_computed : self.num_computed + n]
        return ids + self.draft[: n - len(ids)] if len(ids) < n else ids

    def emit(self, chunk: Chunk) -> None:
        self.out.put(chunk)
