"""Ollama's /api/embed and its older /api/embeddings, onto the same internal request as /v3/embeddings
(appliance/openai_api/embeddings.py, `EncodeJob`).

/api/embed: `input` a string or a list of strings, `truncate` (Ollama's default: true, inputs past the model's
maximum are cut; false: a 400), `dimensions`, `keep_alive` and `options` accepted (the model stays loaded);
answer `embeddings` (lists of floats), `total_duration` and `load_duration` in nanoseconds, `prompt_eval_count`.
/api/embeddings: `prompt` one string, answer `embedding`, truncated as /api/embed's default.
Errors are Ollama's `{"error": ...}` (the blueprint's handlers).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from flask import Blueprint

from appliance.api.context import AppApi
from appliance.api.embeddings import embedding_inputs, floats, json_response, run_encode
from appliance.api.errors import ApiError
from appliance.api.parsers import is_int
from appliance.api.table import read_body
from appliance.ollama_api.models import untagged
from appliance.ollama_api.requests import body_json
from appliance.protocol import EncodeJob

NS = 1_000_000_000


def _served(api: AppApi, name: Any) -> str:
    """The served model `name` or `name:latest` means (404 in Ollama's words otherwise)."""
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model is required")
    for candidate in dict.fromkeys((name, untagged(name))):
        if api.client.serving_status(candidate).state != "unknown":
            return candidate
    raise ApiError(404, f"model '{name}' not found")


class EmbedRoutes:
    def __init__(self, api: AppApi):
        self.api = api

    def embed(self):
        body = body_json()
        read_body(body, (), self.api.limits)
        texts, ids = embedding_inputs(body.get("input"), self.api.limits)
        if ids is not None:
            raise ApiError(400, "input must be a string or a list of strings")
        truncate = body.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ApiError(400, "truncate must be a boolean")
        dims = body.get("dimensions")
        if dims is not None and not (is_int(dims) and dims >= 1):
            raise ApiError(400, "dimensions must be an integer of at least 1")
        started = time.monotonic()
        job = EncodeJob(
            "embd-" + uuid.uuid4().hex,
            _served(self.api, body.get("model")),
            "embed",
            texts=texts,
            truncate=truncate,
            dimensions=dims,
        )
        answer, _ = run_encode(self.api, job)
        assert answer.vectors is not None, "an embed job answers vectors"
        return json_response(
            {
                "model": body["model"],
                "embeddings": [floats(v) for v in answer.vectors],
                "total_duration": int((time.monotonic() - started) * NS),
                "load_duration": 0,  # loaded at start-up, never per request
                "prompt_eval_count": sum(answer.tokens),
            }
        )

    def embeddings(self):
        body = body_json()
        read_body(body, (), self.api.limits)
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string")
        job = EncodeJob(
            "embd-" + uuid.uuid4().hex, _served(self.api, body.get("model")), "embed", texts=[prompt], truncate=True
        )
        answer, _ = run_encode(self.api, job)
        assert answer.vectors is not None, "an embed job answers vectors"
        return json_response({"embedding": floats(answer.vectors[0])})


def register(bp: Blueprint, api: AppApi) -> None:
    routes = EmbedRoutes(api)
    bp.add_url_rule("/embed", view_func=routes.embed, methods=["POST"])
    bp.add_url_rule("/embeddings", view_func=routes.embeddings, methods=["POST"])
