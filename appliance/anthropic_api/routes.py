"""The Messages API's routes (a Flask Blueprint the app registers): `POST /v1/messages` and
`/v1/messages/count_tokens`, and Anthropic's error shape for every error they meet.

A message is a chat generation: request.py makes the chat adapter's `ChatRequest`, the chat adapter makes the
job, and the shared `Generation` (appliance/api/generation.py) runs it; only the spelling differs (shape.py
here). So auth, the Host allow-list, body limits and the engine's answers (queue full, prompt too long, timeouts)
are the OpenAI routes' too, rendered as `{"type": "error", "error": {"type", "message"}}` with the same status.
The `anthropic-version` header is accepted and not checked (one version of the API is spoken).

count_tokens: the messages (with system and tools) go through the chat template engine-side as a job with
max_tokens 0, which the engine answers with the prompt's token count and no generation (jobs.py: nothing is
queued), so the count is exactly what a `/v1/messages` request with the same input would prefill.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator

from flask import Blueprint, Response, g

from appliance import error_shapes
from appliance import protocol as p
from appliance.anthropic_api.request import MessagesRequest, parse_messages
from appliance.anthropic_api.shape import MessageShape, new_message_id
from appliance.api.context import AppApi, error_handlers
from appliance.api.errors import ApiError
from appliance.api.generation import ClientGone, Generation
from appliance.api.images import split_images
from appliance.api.request import DEFAULT_TOOL_PARSER, chat_job
from appliance.api.start import prompt_tokens, respond, start
from appliance.params import SamplingParams

log = logging.getLogger("appliance.http")


def error_body(exc: ApiError) -> dict:
    return error_shapes.anthropic(exc.status, exc.message)


def error_response(exc: ApiError) -> Response:
    g.error_type = exc.type
    return Response(json.dumps(error_body(exc)), status=exc.status, mimetype="application/json")


def _event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Messages:
    def __init__(self, api: AppApi):
        self.api = api

    def _status(self, req: MessagesRequest) -> p.EngineStatus:
        status = self.api.ready_status(req.chat.edge.model, fresh=False)
        if req.thinking == "enabled" and status.reasoning_parser != "think":
            raise ApiError(
                400,
                f"thinking: the model `{req.chat.edge.model}` does not think (it has no reasoning parser: its chat "
                "template writes no <think> block; `--reasoning-parser think` turns it on for one that does)",
                param="thinking",
            )
        return status

    def create(self):
        req = parse_messages(self.api.json_body(), self.api.limits)
        status = self._status(req)
        chat = self.api.with_images(req.chat)
        parse_tools = bool(chat.tools) and chat.tool_choice != "none"
        shape = MessageShape(
            (status.tool_parser or DEFAULT_TOOL_PARSER) if parse_tools else None,
            reasoning=status.reasoning_parser == "think",
            thinking=req.thinking != "disabled",
            calls_only=parse_tools and chat.tool_choice in ("required", "named"),
            one_call=req.one_call,
            stop_sequences=req.stop_sequences,
        )
        message_id = new_message_id()
        generation = start(
            self.api.client,
            status,
            chat.sampling,
            lambda params, request_id: chat_job(chat, params, request_id, status.tool_parser, self.api.limits),
            shape,
            request_id=message_id,
            model=chat.edge.model,
        )
        head = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": chat.edge.model,
        }
        if not chat.edge.stream:
            body = generation.unary()
            answer = body["choices"][0]
            return {**head, **answer, "usage": _usage(body["usage"])}
        return respond(self._sse(generation, shape, head), "text/event-stream")

    @staticmethod
    def _sse(generation: Generation, shape: MessageShape, head: dict) -> Iterator[str]:
        """Anthropic's event order: message_start, ping (the shape's opening), the blocks' start / delta / stop,
        message_delta (stop reason, output tokens), message_stop; an error after the start is an `error` event."""
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = _usage(generation.usage())  # the prefill is done: the prompt's split is known, no output
        try:
            yield _event({"type": "message_start", "message": start})
            for event in generation.deltas():
                yield _event(event)
            choice = generation.choices[0]
            usage = _usage(generation.usage())
            yield _event(
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": shape.stop_reason(choice.finish_reason),
                        "stop_sequence": shape.stop_sequence,
                    },
                    "usage": usage,
                }
            )
            yield _event({"type": "message_stop"})
        except ApiError as exc:  # the response started: in-band, as Anthropic does
            yield _event(error_body(exc))
        except ClientGone:
            return
        finally:
            generation.close()

    def count_tokens(self):
        req = parse_messages(self.api.json_body(), self.api.limits, count_only=True)
        self._status(req)
        chat = self.api.with_images(req.chat)
        tools = list(chat.tools) if chat.tools and chat.tool_choice != "none" else None
        messages, images, fields = split_images(chat.messages)  # each image counts the tokens the model reads it as
        job = p.Job(
            "count-" + uuid.uuid4().hex,
            [p.PromptSpec(messages=messages, tools=tools, images=images, image_fields=fields)],
            SamplingParams(max_tokens=0),
            model=chat.edge.model,
            tenant=g.get("tenant", ""),
        )
        return {"input_tokens": prompt_tokens(self.api.client, job)}


def _usage(usage: dict) -> dict:
    """The generation's usage in Anthropic's names. Anthropic splits the prompt in three that add up to it:
    `input_tokens` (neither read from nor written to a cache) + `cache_creation_input_tokens` +
    `cache_read_input_tokens` (its prompt-caching docs), and clients add them (LangChain's and litellm's prompt
    tokens, pydantic-ai's input tokens). Here cache reads are the prompt tokens the prefix cache gave; nothing is
    a cache creation (the prefix cache keeps every prompt without a marker or a charge), so input_tokens is the
    rest."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "output_tokens": usage["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def blueprint(api: AppApi) -> Blueprint:
    """The routes, under /v1 (Anthropic's base path: its SDK appends /v1/messages to the base URL)."""
    bp = Blueprint("anthropic", __name__)
    messages = Messages(api)
    bp.add_url_rule("/v1/messages", view_func=messages.create, methods=["POST"], endpoint="messages")
    bp.add_url_rule("/v1/messages/count_tokens", view_func=messages.count_tokens, methods=["POST"], endpoint="count")

    error_handlers(bp, error_response, api.settings.max_body_bytes)
    return bp
