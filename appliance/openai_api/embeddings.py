"""/v3/embeddings (OpenAI's and OVMS's) and /v3/rerank (OVMS's, Cohere's shape): each body becomes one internal
request, an `EncodeJob`, that the engine process batches with every other client's (appliance/server/embeddings.py)
and answers with the vectors as float32 bytes (workers hold no numpy: `array` reads them, `base64` sends them).
Ollama's /api/embed (appliance/ollama_api/embed.py) makes the same job.

Embeddings: `input` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's four
forms; token ids are the model's own, e.g. from /v3/tokenize: LangChain's OpenAIEmbeddings sends tiktoken's ids
unless `check_embedding_ctx_length=False`, and ids past the vocabulary are a 400). `encoding_format` float or base64
(little-endian float32, as OpenAI). `dimensions` (OpenAI's; OVMS has none): the vectors' first n components,
renormalized, for a model whose vectors are normalized (as OpenAI's text-embedding-3 shortening); another model
answers 400. An input longer than the model's maximum is a 400 unless `truncate` is true (OVMS's name, a graph
option there, a request field here). `user` is accepted and ignored.
Rerank: `query`, `documents` (strings, or Cohere's objects with `text`), `top_n`, `return_documents`; results
sorted by `relevance_score`, each with its document's `index`. A query + document pair longer than the model's
maximum is cut at the end (Cohere and OVMS do the same).
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from typing import Any

from flask import Flask

from appliance.api.context import AppApi
from appliance.api.embeddings import embedding_inputs, floats, json_response, run_encode
from appliance.api.errors import invalid
from appliance.api.parsers import is_int
from appliance.api.table import read_body
from appliance.limits import Limits
from appliance.protocol import Encoded, EncodeJob


@dataclass(frozen=True)
class EmbeddingsRequest:
    job: EncodeJob
    base64: bool = False


@dataclass(frozen=True)
class RerankRequest:
    job: EncodeJob
    top_n: int | None = None
    return_documents: bool = False


def _model(values: dict) -> str:
    model = values.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model field is missing or is not a string", "model")
    return model


def _bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean", name)
    return value


def parse_embeddings(body: Any, limits: Limits) -> EmbeddingsRequest:
    read_body(body, (), limits)  # the shared checks: an object, valid Unicode, bounded nesting
    values = body
    texts, ids = embedding_inputs(values.get("input"), limits)
    fmt = values.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise invalid("encoding_format must be float or base64", "encoding_format")
    dims = values.get("dimensions")
    if dims is not None and not (is_int(dims) and dims >= 1):
        raise invalid("dimensions must be an integer of at least 1", "dimensions")
    user = values.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user must be a string", "user")
    job = EncodeJob(
        "embd-" + uuid.uuid4().hex,
        _model(values),
        "embed",
        texts=texts,
        token_ids=ids,
        truncate=_bool(values.get("truncate"), "truncate"),
        dimensions=dims,
    )
    return EmbeddingsRequest(job, base64=fmt == "base64")


def parse_rerank(body: Any, limits: Limits) -> RerankRequest:
    read_body(body, (), limits)
    query, docs = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not query:
        raise invalid("query must be a non-empty string", "query")
    if not isinstance(docs, list) or not docs:
        raise invalid("documents must be a non-empty list of strings", "documents")
    if len(docs) > limits.rerank_documents:
        raise invalid(
            f"documents holds {len(docs)} documents, more than the limit of {limits.rerank_documents}", "documents"
        )
    texts: list[str] = []
    for d in docs:  # Cohere's {"text": ...} objects too
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise invalid("documents must be strings (or objects with a `text` string)", "documents")
        texts.append(text)
    top_n = body.get("top_n")
    if top_n is not None and not (is_int(top_n) and top_n >= 1):
        raise invalid("top_n must be an integer of at least 1", "top_n")
    job = EncodeJob("rerank-" + uuid.uuid4().hex, _model(body), "rerank", query=query, documents=texts)
    return RerankRequest(job, top_n, _bool(body.get("return_documents"), "return_documents"))


def embeddings_body(req: EmbeddingsRequest, answer: Encoded) -> dict:
    assert answer.vectors is not None, "an embed job answers vectors"
    data = [
        {
            "object": "embedding",
            "embedding": base64.b64encode(v).decode("ascii") if req.base64 else floats(v),
            "index": i,
        }
        for i, v in enumerate(answer.vectors)
    ]
    tokens = sum(answer.tokens)
    return {
        "object": "list",
        "data": data,
        "model": req.job.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def rerank_body(req: RerankRequest, answer: Encoded) -> dict:
    scores, documents = answer.scores, req.job.documents
    assert scores is not None and documents is not None, "a rerank job answers scores"
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
    results = []
    for i in order:
        result: dict = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {
        "id": req.job.request_id,
        "model": req.job.model,
        "results": results,
        "usage": {"prompt_tokens": sum(answer.tokens), "total_tokens": sum(answer.tokens)},
    }


class EncoderRoutes:
    def __init__(self, api: AppApi):
        self.api = api

    def embeddings(self):
        req = parse_embeddings(self.api.json_body(), self.api.limits)
        answer, _ = run_encode(self.api, req.job)
        return json_response(embeddings_body(req, answer))

    def rerank(self):
        req = parse_rerank(self.api.json_body(), self.api.limits)
        answer, _ = run_encode(self.api, req.job)
        return json_response(rerank_body(req, answer))


def register(app: Flask, api: AppApi, prefixes: tuple[str, ...]) -> None:
    routes = EncoderRoutes(api)
    for prefix in prefixes:
        app.add_url_rule(
            f"{prefix}/embeddings", view_func=routes.embeddings, methods=["POST"], endpoint=f"embeddings{prefix}"
        )
        app.add_url_rule(f"{prefix}/rerank", view_func=routes.rerank, methods=["POST"], endpoint=f"rerank{prefix}")
