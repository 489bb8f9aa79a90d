"""What a requester holds for one submitted request: one type for every kind of request, so that callers (the
engine service, bench, tests) never branch on what they asked for.

A sampled request streams its one sequence's Chunks as the engine makes them. A beam search (best_of > 1) is not
streamed: its n best hypotheses arrive together, best first, each as one Chunk holding the whole choice. Either
way `events()` gives (choice offset, Chunk) pairs and `results()` a list of GenerationResults, one per choice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from appliance.outputs import Chunk, GenerationResult, Timing
from appliance.runtime.sequence import BeamGroup, Sequence


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
