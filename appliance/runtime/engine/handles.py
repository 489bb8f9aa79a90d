"""What a requester holds for one submitted request: one type for every kind of request, so that callers (the
engine service, bench, tests) never branch on what they asked for.

A sampled request streams its one sequence's Chunks as the engine makes them. A beam search (best_of > 1) is not
streamed: its n best hypotheses arrive together, best first, each as one Chunk holding the whole choice. Either
way `events()` gives (choice offset, Chunk) pairs and `results()` a list of GenerationResults, one per choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from queue import SimpleQueue
from typing import cast

from appliance.outputs import Chunk, GenerationResult, Timing
from appliance.runtime.sequence import BeamGroup, Sequence

log = logging.getLogger("appliance.runtime.engine")


class RequestHandle:
    """The requester's side of one request: iterate for its Chunks, `events()` for them with their choice offset,
    `results()` for the whole answer, `cancel()` to end it and free its KV at once. Any thread."""

    def __init__(self, cancel: Callable[[Sequence | BeamGroup], None], seq: Sequence):
        self._cancel, self._seq = cancel, seq  # cancel: the engine's (Admission._cancel), any thread
        self.id = seq.request_id
        self.prompt_tokens = seq.prompt_len
        self._beam_chunks: list[Chunk] | None = None  # a beam search's n Chunks, once they arrived

    @property
    def timing(self) -> Timing:
        return self._seq.timing

    def events(self) -> Iterator[tuple[int, Chunk]]:
        """(choice offset, Chunk) pairs until the request ends: offset 0 for a sampled request's stream, 0..n-1
        for a beam search's n whole choices."""
        group = self._seq.group
        if group is not None:
            if self._beam_chunks is None:
                self._beam_chunks = group.out.get()
            yield from enumerate(self._beam_chunks)
            return
        while True:
            chunk = self._seq.out.get()
            yield 0, chunk
            if chunk.finish_reason is not None:
                return

    def __iter__(self) -> Iterator[Chunk]:
        for _, chunk in self.events():
            yield chunk

    def divert_first(self, take: Callable[[Chunk], bool]) -> None:
        """Offer the request's first token to `take`, on the engine thread as the engine makes it, instead of
        queueing it for `events()`: True means taken (the caller passed it on itself), False queues it as usual.
        Only a sampled request's first chunk of tokens that does not end it (a beam search's, a last chunk, or a
        token made before this call go the usual way); `take` must neither block nor raise. What it saves is a
        thread hand-off on the first token's path: a server's pump thread waking while the engine's next step
        holds the cores (bench.http_breakdown's TTFT stages)."""
        seq = self._seq
        if seq.group is None:
            seq.out = cast(SimpleQueue, _FirstTap(seq, take))  # what the engine (put) and events() (get) use

    def cancel(self) -> None:
        group = self._seq.group
        self._cancel(group if group is not None else self._seq)

    def results(self) -> list[GenerationResult]:
        """The request's choices, in order: one for a sampled request, params.n for a beam search (best first).
        Raises RuntimeError if the request ended with an error."""
        if self._seq.group is not None:
            chunks = [chunk for _, chunk in self.events()]
            if chunks[0].error:
                raise RuntimeError(chunks[0].error)
            results = []
            for c in chunks:
                assert c.finish_reason is not None  # each of a beam search's chunks is a whole, ended choice
                results.append(
                    GenerationResult(
                        c.text,
                        c.token_ids,
                        c.finish_reason,
                        c.prompt_tokens,
                        c.completion_tokens,
                        c.logprobs,
                        self.timing,
                        c.prompt_logprobs,
                    )
                )
            return results
        text, ids, logprobs, last, prompt_logprobs = [], [], [], Chunk(), None
        for last in self:
            text.append(last.text)
            ids += last.token_ids
            if last.logprobs:
                logprobs += last.logprobs
            if last.prompt_logprobs is not None:
                prompt_logprobs = last.prompt_logprobs
        if last.error:
            raise RuntimeError(last.error)
        assert last.finish_reason is not None  # the stream ends with its chunk that has finish_reason set (events)
        params = self._seq.params
        return [
            GenerationResult(
                "".join(text),
                ids,
                last.finish_reason,
                last.prompt_tokens,
                last.completion_tokens,
                logprobs if params.logprobs is not None else None,
                self.timing,
                prompt_logprobs,
            )
        ]


class _FirstTap:
    """A sequence's output queue for its next chunk only (RequestHandle.divert_first): offers a first token to
    `take`, then hands the sequence its queue back."""

    def __init__(self, seq: Sequence, take: Callable[[Chunk], bool]):
        self.seq, self.queue, self.take = seq, seq.out, take
        self.get = self.queue.get  # a reader already waiting on the queue keeps waiting on it

    def put(self, chunk: Chunk) -> None:
        self.seq.out = self.queue
        first = chunk.token_ids and chunk.completion_tokens == len(chunk.token_ids)
        if first and chunk.finish_reason is None:
            try:
                if self.take(chunk):
                    return
            except Exception:  # the contract says it cannot; the chunk must reach its reader all the same
                log.exception("request %s: the first token's taker failed", self.seq.request_id)
        self.queue.put(chunk)
