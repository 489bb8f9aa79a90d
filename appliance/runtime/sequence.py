"""One generation in flight: its tokens, KV blocks, and the per-sequence processors (sampler, detokenizer,
stop matcher); and a beam search's group of them (BeamGroup). Owned by the engine thread only.

BeamGroup is a record of sequences like Sequence itself, so it lives here, the lowest layer, where the scheduler
(make_room, prioritize) and the engine's parts can name it without importing the engine."""

from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from appliance.outputs import Chunk, Timing, TokenLogprob
from appliance.params import SamplingParams
from appliance.runtime.beam_search import BeamSearch

if TYPE_CHECKING:
    from collections.abc import Sequence as Sequence_

    import numpy as np

    from appliance.runtime.detokenizer import IncrementalDetokenizer
    from appliance.runtime.kv_cache import BlockChain
    from appliance.runtime.media import Media
    from appliance.runtime.sampling import SequenceSampler
    from appliance.runtime.speculative.state import SpecState
    from appliance.runtime.stopping import StopStringMatcher


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Prebuilt:
    """A sequence's set-up built off the engine thread (Admission._prebuild): its ban table (None: nothing
    banned). Typed loosely: bans.py sits above this module (it reads sequences)."""

    __slots__ = ("bans",)

    def __init__(self, bans: Any):
        self.bans = bans


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
    # the prompt's block names, hashed once at submission (BlockPool.prefetch) for the admission's match_prefix
    prompt_chain: BlockChain | None = None
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
    # what the caller's thread built for the engine thread's start (Admission._prebuild); None: build it there
    prebuilt: Prebuilt | None = None
    # a vision-language prompt's images (runtime/media.py), kept until the sequence ends: a chunk of the prompt, or
    # its recomputation after a preemption, feeds the same feature rows; its n > 1 choices and beams share it
    media: Media | None = None

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

    def cache_tokens(self, begin: int, end: int) -> tuple[int, ...]:
        """What the prefix cache hashes for positions [begin, end): the token ids, with an image's placeholder
        tokens keyed by the picture (Media.key_tokens), so only the same picture hits."""
        tokens = self.token_ids[begin:end]
        return self.media.key_tokens(tokens, begin) if self.media is not None else tuple(tokens)

    @property
    def prefix_tokens(self) -> Sequence_[int]:
        """cache_tokens of every position; a text sequence's own token list, not copied (match_prefix, prefetch)."""
        return self.token_ids if self.media is None else self.media.key_tokens(self.token_ids, 0)

    def emit(self, chunk: Chunk) -> None:
        self.out.put(chunk)

    def set_timing(self) -> None:
        """The request ends now: its queue, prompt, completion and total times."""
        t = self.timing
        end = time.monotonic()
        start = self.first_scheduled or end
        first = self.first_token or end
        t.queue_time, t.prompt_time = start - self.arrived, first - start
        t.completion_time, t.total_time = end - first, end - self.arrived


STOP_WINDOW_TOKENS = 256  # most tokens decoded per candidate to look for a stop string

# what a finished hypothesis carries: its generated tokens, their logprob entries (params.logprobs set), its reason
BeamPayload = tuple[list[int], list[TokenLogprob] | None, str]


class BeamGroup:
    """One beam search inside the engine: its live beams (Sequences that share KV blocks), the logits they
    produced for the next step so far, the search state. Engine thread only, except `out`."""

    def __init__(self, root: Sequence, num_stop_tokens: int):
        self.root, self.params = root, root.params
        assert root.params.best_of is not None  # a BeamGroup is made for best_of > 1 only (Admission.submit)
        self.search: BeamSearch[BeamPayload] = BeamSearch(
            root.params.best_of, root.params.length_penalty, num_stop_tokens, root.params.early_stopping
        )
        # tokens decoded per candidate to find a stop string ending there: enough for the longest one (a token is
        # at least one character, 8 spare for byte pieces), bounded so that no stop string makes a step costly
        longest = max((len(s) for s in root.params.stop), default=0)
        self.stop_window = min(longest + 8, STOP_WINDOW_TOKENS)
        self.beams: list[Sequence] = [root]
        self.logits: dict[Sequence, np.ndarray] = {}
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # once: the n result Chunks
        self.done = False
