"""Request admission: from a caller's thread into the engine thread.

The prompt's checks run on the caller's thread, so a bad request is refused (400) before anything is queued; the
queue bound is checked and counted under one lock, so two callers never pass on one slot (429). What passes goes
through an inbox the engine thread drains at the top of each iteration, where each request gets its per-sequence
processors (sampler, detokenizer, stop matcher) and enters the scheduler. Cancels take the same inbox, so a
request's KV is freed by the engine thread, between steps.

What can be done once per request is done on the caller's thread (`prepare`: bad words and the prediction
tokenized, without the GIL, and shared by every choice and prompt of the request), and so are the tables whose size
the request's `setup_work` bounds (appliance/limits.py): the ban table of each prompt (`_prebuild`, once per
prompt, shared by its choices), which the engine thread's start of a sequence only takes. The prompt-lookup index
of a prediction is built by the engine thread, a slice per lookup (speculative/ngram.py): lazily, since a sequence
in a batch too large to speculate never needs it. The drain itself has a time
budget (INBOX_BUDGET_SECONDS): a big submission is started a prompt at a time across iterations, with a step of
the running sequences between, so one request never holds the others' tokens back for long.
"""

from __future__ import annotations

import copy
import logging
import queue
import time
import uuid
from dataclasses import replace

from appliance.outputs import GenerationResult, Timing
from appliance.params import SamplingParams
from appliance.runtime.bans import Bans
from appliance.runtime.detokenizer import IncrementalDetokenizer
from appliance.runtime.engine.handles import RequestHandle
from appliance.runtime.engine.liveness import EngineDead
from appliance.runtime.engine.logprobs import first_prompt_logprob
from appliance.runtime.engine.state import EngineState
from appliance.runtime.media import Media
from appliance.runtime.sampling import SequenceSampler
from appliance.runtime.sequence import BeamGroup, Prebuilt, Sequence, Status
from appliance.runtime.stopping import StopStringMatcher, resolve_prompt_limits, stop_token_ids
from appliance.runtime.tokenizer import TextTooLong

log = logging.getLogger("appliance.runtime.engine")

# How long one drain of the inbox may start sequences before a step runs (when any sequence is running): a prompt's
# group of choices starts in about 1 ms (sampler, detokenizer, ban index), so this is tens of prompts per step.
INBOX_BUDGET_SECONDS = 0.02


class QueueFull(Exception):
    """More requests are waiting than `max_queued` allows (HTTP 429)."""


class PromptTooLong(ValueError):
    """Prompt (+ max_tokens) does not fit the context (HTTP 400)."""

    @classmethod
    def over_context(cls, prompt_tokens: int, max_tokens: int | None, limit: int) -> PromptTooLong:
        """OVMS's message for a prompt (+ max_tokens) past the model's context, the one wording both checks use."""
        return cls(
            f"Number of prompt tokens: {prompt_tokens} + max tokens value: {max_tokens or 0} exceeds model max "
            f"length: {limit}"
        )


class ParamInvalid(ValueError):
    """A request parameter the engine cannot serve (HTTP 400), with the name of the field at fault (`param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class Admission(EngineState):
    """Engine's submission side (a part of Engine: see state.py for the state it uses)."""

    # ---- requester side (any thread) ----
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        media: Media | None = None,
    ) -> RequestHandle:
        """One sequence (streaming Chunks), or with params.best_of > 1 a beam search (its params.n best beams
        arrive together): either way one RequestHandle. `media`: a vision-language prompt's images (its beams
        share them)."""
        if params.best_of is not None and params.best_of > 1 and params.grammar is not None:
            raise ValueError(
                "structured output (response_format / grammar) cannot be combined with beam search "
                f"(best_of {params.best_of}): use n for several choices"
            )
        seq = self._new_sequence(prompt_ids, params, request_id, media)
        self._prebuild([seq])
        if params.best_of is not None and params.best_of > 1:
            seq.max_len = self._beam_max_len(len(prompt_ids), seq.params, seq.max_len)  # limits resolved
            seq.group = BeamGroup(seq, len(stop_token_ids(params, self.eos_token_ids)))
        self._enqueue([[seq]])
        return RequestHandle(self._cancel, seq)

    def submit_choices(
        self,
        prompt_ids: list[int],
        params: list[SamplingParams],
        request_ids: list[str] | None = None,
        media: Media | None = None,
    ) -> list[RequestHandle]:
        """n sampled choices of one prompt (params[j] for choice j, e.g. seeds apart). The prompt is computed
        once: the other choices then share its KV blocks (copy-on-write: full blocks by reference, the partly
        filled last one copied) and sample their first token from the same logits."""
        return self.submit_prompts([(prompt_ids, params, request_ids)], [media])[0]

    def submit_prompts(
        self,
        requests: list[tuple[list[int], list[SamplingParams], list[str] | None]],
        media: list[Media | None] | None = None,
    ) -> list[list[RequestHandle]]:
        """Several prompts at once, each with its choices as in submit_choices (a completions request's prompt
        list, a burst of clients): all are queued or none (429), and they reach the scheduler in the same step,
        so their prefills batch together instead of the first one starting alone. `media[i]`: the images of
        requests[i] (a vision-language model), shared by its choices."""
        if media is not None and len(media) != len(requests):
            raise ValueError(f"{len(media)} media for {len(requests)} prompts")
        groups = []
        for (prompt_ids, params, request_ids), images in zip(requests, media or [None] * len(requests)):
            ids: list[str] | list[None] = request_ids or [None] * len(params)
            seqs = [self._new_sequence(prompt_ids, p, r, images) for p, r in zip(params, ids)]
            self._prebuild(seqs)
            if len(seqs) > 1 and self.backend.max_batch is None and all(p.max_tokens != 0 for p in params):
                seqs[0].followers = seqs[1:]
            groups.append(seqs)
        self._enqueue(groups)
        return [[RequestHandle(self._cancel, seq) for seq in seqs] for seqs in groups]

    def prepare(self, params: SamplingParams) -> SamplingParams:
        """`params` with its texts tokenized: `bad_words` (as written and with a leading space) added to
        `bad_word_tokens`, `prediction` as `prediction_ids`. Call it once per request on the caller's thread and
        share the result among the request's sequences (submit does it per sequence for a caller that did not).
        ParamInvalid (400) for a prediction that cannot fit the context, checked in characters before encoding."""
        words = [t for word in params.bad_words for t in (word, " " + word.lstrip())]
        wants_prediction = params.prediction is not None and params.prediction_ids is None
        if not words and not wants_prediction:
            return params
        changes: dict = {}
        if words:
            given = (tuple(int(t) for t in ids) for ids in params.bad_word_tokens)
            seqs = {*given, *map(tuple, self.tokenizer.encode_many(words))}
            changes.update(bad_words=[], bad_word_tokens=sorted(s for s in seqs if s and min(s) >= 0))
        if wants_prediction:
            assert params.prediction is not None
            text, limit = params.prediction, self.max_context
            try:
                ids = self.tokenizer.encode(text, token_budget=limit) if text else []
            except TextTooLong as exc:
                raise ParamInvalid(f"prediction: {exc}, the model's context", "prediction") from None
            if len(ids) > limit:
                raise ParamInvalid(
                    f"prediction: {len(ids)} tokens, more than the model max length: {limit} (an answer cannot be "
                    "longer)",
                    "prediction",
                )
            changes["prediction_ids"] = ids
        return replace(params, **changes)

    def _prebuild(self, seqs: list[Sequence]) -> None:
        """The ban table of one prompt's sequences (bad words, the no_repeat_ngram index of the prompt), built here
        on the caller's thread, once for the choices whose ban parameters are equal (n choices differ in their
        seed only); each further choice gets a fork (its own output index, the rest shared)."""
        built: dict[tuple, Bans | None] = {}
        prompt = seqs[0].token_ids[: seqs[0].prompt_len]
        for seq in seqs:
            p = seq.params
            key = (tuple(p.bad_words), tuple(map(tuple, p.bad_word_tokens)), p.no_repeat_ngram)
            if key in built:
                shared = built[key]
                seq.prebuilt = Prebuilt(copy.copy(shared) if shared is not None else None)
            else:
                built[key] = Bans.build(p, prompt, self.tokenizer)
                seq.prebuilt = Prebuilt(built[key])

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> list[GenerationResult]:
        """Submit and wait: the request's choices (one, or params.n for a beam search)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.submit(ids, params or SamplingParams()).results()

    def _enqueue(self, groups: list[list[Sequence]]) -> None:
        """Hands a submission to the engine thread, or refuses all of it (429) if its sequences would take the
        queue past max_queued. Counted in sequences, not submissions: a prompt list or n > 1 is several."""
        count = sum(map(len, groups))
        for seqs in groups:  # the disk tier reads the prompt's blocks while it waits for admission
            if seqs[0].params.prompt_logprobs is None:  # those compute every position (Scheduler)
                seqs[0].prompt_chain = self.pool.prefetch(seqs[0].prefix_tokens, seqs[0].params.cache_scope)
        with self._admit:
            if self.dead is not None:  # checked under the lock _die takes: nothing is queued after its drain
                raise EngineDead(f"the engine stopped: internal error: {type(self.dead).__name__}")
            if self._queued() + count > self.config.max_queued:
                raise QueueFull("the server is busy: too many queued requests, retry later")
            self._inbox_seqs += count
            self._inbox.put(("add", groups))
        self._wake.set()

    def _queued(self) -> int:
        """Sequences not started: in the inbox, or waiting in the scheduler (with their n > 1 choices)."""
        return self._inbox_seqs + self.scheduler.num_queued()

    def _new_sequence(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, media: Media | None = None
    ) -> Sequence:
        """The prompt's checks, made on the caller's thread (400 before anything is queued), then the Sequence."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if media is not None:
            self._check_media(prompt_ids, media)
        cap = self.backend.max_prompt
        if cap is not None and len(prompt_ids) > cap:  # static shapes (NPU): OVMS's max_prompt_len
            raise PromptTooLong(
                f"Number of prompt tokens: {len(prompt_ids)} exceeds the maximum prompt length of this server: "
                f"{cap} (static shapes / NPU: --max-prompt-len, OVMS's max_prompt_len)"
            )
        limit = self.max_context
        params = self.prepare(params)  # nothing to do when the caller prepared it (JobRunner does, once)
        params = resolve_prompt_limits(params, len(prompt_ids), limit)  # max/min_total_tokens, min_tokens -1
        if params.grammar is not None:  # compiled here, off the engine thread (cached per grammar): 400 if invalid
            self.grammars.check(params.grammar)
        self.speculation.check(params)
        if len(prompt_ids) + (params.max_tokens or 0) > limit or len(prompt_ids) >= limit:
            raise PromptTooLong.over_context(len(prompt_ids), params.max_tokens, limit)
        max_len = min(limit, len(prompt_ids) + params.max_tokens if params.max_tokens is not None else limit)
        return Sequence(
            request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            len(prompt_ids),
            list(prompt_ids),
            params,
            max_len,
            queue.SimpleQueue(),
            Timing(created=time.time()),
            media=media,
        )

    def _check_media(self, prompt_ids: list[int], media: Media) -> None:
        """Images that fit the prompt and the model, checked on the caller's thread: rows of another width or
        over other tokens would fail the whole step they are fed in, not only their own request."""
        vision = self.manifest.vision
        if vision is None:
            raise ValueError(f"the model {self.manifest.name!r} reads text only: it takes no images")
        if media.prompt_len != len(prompt_ids):
            raise ValueError(f"the images are laid out for {media.prompt_len} prompt tokens, not {len(prompt_ids)}")
        for image in media.images:
            if image.features.ndim != 2 or image.features.shape[1] != self.manifest.hidden_size:
                raise ValueError(f"image features must be [tokens, {self.manifest.hidden_size}]")
            if any(t != vision.image_token_id for t in prompt_ids[image.start : image.end]):
                raise ValueError("an image's span must hold the model's image tokens")

    def _beam_max_len(self, prompt_len: int, params: SamplingParams, max_len: int) -> int:
        """All beams of a search must fit in the KV pool and the sequence slots together, or they could wait on
        each other forever. Without max_tokens the search is capped at what fits."""
        beams, pool = params.best_of, self.pool
        assert beams is not None  # called for best_of > 1 only (submit)
        if params.n > beams:
            raise ValueError(f"n value cannot be greater than best_of ({params.n} > {beams})")
        if beams > self.scheduler.max_num_seqs:
            raise ValueError(
                f"best_of {beams} runs {beams} sequences at once; this server runs at most "
                f"{self.scheduler.max_num_seqs}"
            )
        fits = pool.num_blocks // beams * pool.block_size
        if max_len > fits and (params.max_tokens is not None or prompt_len >= fits):
            raise PromptTooLong(
                f"best_of {beams}: {beams} beams of {prompt_len} prompt tokens + max tokens value "
                f"{params.max_tokens or 0} do not fit the KV cache ({pool.num_blocks * pool.block_size}"
                " positions)"
            )
        return min(max_len, fits)

    def _cancel(self, target: Sequence | BeamGroup) -> None:
        self._inbox.put(("cancel", target))
        self._wake.set()

    # ---- engine thread ----
    def _drain_inbox(self) -> None:
        """Start what was submitted and apply cancels, in order, for at most INBOX_BUDGET_SECONDS while anything
        runs: the rest waits in `_backlog` for the next iteration (a submission split into its prompts' groups),
        so a step runs between two slices of a big submission."""
        backlog = self._backlog
        while True:  # everything the inbox holds, in order (cheap: no work yet)
            try:
                op, target = self._inbox.get_nowait()  # ("add", groups of sequences) or ("cancel", one)
            except queue.Empty:
                break
            if op == "add":
                backlog.extend(("add", [seqs]) for seqs in target)
            else:
                backlog.append((op, target))
        deadline = time.monotonic() + INBOX_BUDGET_SECONDS
        while backlog:
            if self.scheduler.running and time.monotonic() > deadline:
                self._wake.set()  # more to start: do not idle-wait before the next iteration
                return
            op, target = backlog.popleft()
            try:
                self._take(op, target)
            except Exception as exc:  # one submission or cancel fails alone
                log.exception("could not take %s from the inbox", op)
                if op == "add":
                    for seqs in target:
                        for seq in seqs:
                            self._try_fail(seq, f"internal error: {type(exc).__name__}")

    def _take(self, op: str, target) -> None:
        if op == "add":
            try:
                for seqs in target:
                    self._start_all(seqs)
            finally:
                with self._admit:  # after the start: counted as queued until in the scheduler's waiting list
                    self._inbox_seqs -= sum(map(len, target))
        elif isinstance(target, BeamGroup):
            if not target.done:
                self.counters["aborted"] += 1
                self.beams.finish(target)
        elif target.status is not Status.FINISHED:
            self.counters["aborted"] += 1
            self._finish(target, "abort")

    def _start_all(self, seqs: list[Sequence]) -> None:
        """A request's sequences: the first is scheduled, its followers (n > 1) wait for its prompt KV. They
        start first, so that a leader failing to start hands ready followers to the scheduler (_finish)."""
        share = bool(seqs[0].followers)
        self.counters["requests"] += 1  # one prompt, however many choices
        self.counters["prompt_tokens"] += seqs[0].prompt_len
        for seq in seqs[1:] + seqs[:1] if share else seqs:
            try:
                self._start(seq, scheduled=seq is seqs[0] or not share)
            except Exception as exc:  # one bad request fails alone; the engine thread goes on
                log.exception("could not start request %s", seq.request_id)
                self._finish(seq, "abort", error=f"internal error: {type(exc).__name__}")

    def _start(self, seq: Sequence, scheduled: bool = True) -> None:
        p = seq.params
        seq.sampler = SequenceSampler(p, seq.token_ids[: seq.prompt_len], self.eos_token_ids)
        if p.grammar is not None:
            seq.sampler.grammar = self.grammars.matcher(p.grammar)
        if seq.prebuilt is not None:  # built by the caller's thread (_prebuild)
            seq.sampler.bans = seq.prebuilt.bans
        else:  # None: nothing banned
            seq.sampler.bans = Bans.build(p, seq.token_ids[: seq.prompt_len], self.tokenizer)
        seq.detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=p.skip_special_tokens, prompt_ids=seq.token_ids[: seq.prompt_len]
        )
        seq.stop = StopStringMatcher(p.stop, p.include_stop_str_in_output) if p.stop else None
        if p.prompt_logprobs is not None:
            seq.prompt_logprobs = first_prompt_logprob(self.tokenizer, seq)
        self.speculation.start(seq)
        if scheduled:
            self.scheduler.add(seq)
