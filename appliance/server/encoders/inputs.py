"""An embeddings / rerank job's inputs, tokenized and checked before they queue for the encoder
(appliance/server/encoders/service.py): every 400 a bad input gets is decided here, on the worker connection's
thread, so the encoder thread only ever runs valid items.

Items: token ids per input (embed) or (ids, token type ids) per query + document pair (rerank). An embedding input
longer than the model's maximum is a 400 unless the job asks to truncate; a rerank pair is always cut to fit, its
query kept whole (Cohere's and OVMS's behaviour) by `Encoder.tokenize_pairs(truncate=True)`, which truncates on
its own tokenizer copies: the shared tokenizer is never reconfigured, so jobs tokenizing at once on several
connection threads never see another's truncation.
"""

from __future__ import annotations

from typing import Any

from appliance import protocol as p
from appliance.limits import Limits
from appliance.server.encoders.batches import item_length


class EncodeFailed(Exception):
    """A request's own failure, answered with this `Failed`."""

    def __init__(self, failed: p.Failed):
        super().__init__(failed.message)
        self.failed = failed


def _bad(message: str, param: str) -> EncodeFailed:
    return EncodeFailed(p.Failed(400, message, param))


def prepare_items(encoder: Any, job: p.EncodeJob, limits: Limits, *, vocab_size: int, normalized: bool) -> list:
    """The job's items for `encoder` (appliance/runtime/encoder.py), or EncodeFailed: a 400 naming the bound."""
    task, limit = encoder.task, encoder.max_length
    if job.task != task:
        what = "an embedding model" if task == "embed" else "a rerank model"
        raise _bad(f"The model `{job.model}` is {what}: it does not serve {job.task} requests", "model")
    items: list[Any]
    if job.task == "rerank":
        assert job.query is not None and job.documents is not None, "a rerank job has a query and documents"
        try:  # a long pair is cut to the model's maximum (Cohere, OVMS), the query kept whole
            pairs = encoder.tokenize_pairs(job.query, job.documents, truncate=True)
        except (TypeError, ValueError) as exc:
            raise _bad(f"the input cannot be tokenized: {exc}", "documents") from None
        items = [(list(ids), list(types)) for ids, types in pairs]
        param = "documents"
    else:
        items = _embed_items(encoder, job, limit, vocab_size)
        param = "input"
    total = sum(map(item_length, items))
    if total > limits.embedding_tokens:
        raise _bad(
            f"this request is {total} tokens, more than the limit of {limits.embedding_tokens} per request", param
        )
    if job.dimensions is not None:
        dimensions = encoder.dimensions if task == "embed" else 0
        if job.task != "embed" or not 1 <= job.dimensions <= dimensions:
            raise _bad(f"dimensions must be between 1 and {dimensions} for this model", "dimensions")
        if job.dimensions != dimensions and not normalized:
            raise _bad(
                "this model does not support `dimensions`: its vectors are not normalized, so a shortened "
                "one would not be one of its embeddings",
                "dimensions",
            )
    return items


def _embed_items(encoder: Any, job: p.EncodeJob, limit: int, vocab_size: int) -> list[list[int]]:
    if job.token_ids is not None:
        items = [list(ids) for ids in job.token_ids]
        bad = next((t for ids in items for t in ids if vocab_size and not 0 <= t < vocab_size), None)
        if bad is not None:
            raise _bad(f"token id {bad} is out of the vocabulary range [0, {vocab_size})", "input")
    else:
        assert job.texts is not None, "an embed job has texts or token ids"
        try:
            items = [list(ids) for ids in encoder.tokenize(list(job.texts))]
        except (TypeError, ValueError) as exc:
            raise _bad(f"the input cannot be tokenized: {exc}", "input") from None
    for i, ids in enumerate(items):
        if not ids:
            raise _bad(f"input {i} is empty", "input")
        if len(ids) > limit:
            if not job.truncate:
                raise _bad(
                    f"input {i} is {len(ids)} tokens, more than the model's maximum of {limit} "
                    "(send truncate: true to cut it to the maximum)",
                    "input",
                )
            items[i] = list(encoder.truncate(ids))
    return items
