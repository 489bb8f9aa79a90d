"""The Responses routes: `POST /v3/responses` (and /v1), `GET` / `DELETE /v3/responses/{id}`,
`GET /v3/responses/{id}/input_items`, registered on the app by `register`.

A create runs as chat does (the request's Job through `Generation`, started before any byte is answered, so queue,
timeout and prompt errors keep their statuses for streams too); responses.py turns its chat deltas into items and
events. With `store` (OpenAI's default: true) the finished response is committed to response_store.py before the
answer's last byte (the unary body, or the stream's `response.completed`): an acknowledged response is on disk.
A state dir found unwritable at start-up (appliance/state.py) refuses `store: true` before any work (503
`store_unavailable`); a store that fails after the generation (a full disk) answers 503 `store_failed`, in a stream
as its last event, an `error` (the stream never just stops).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from flask import Flask, Response, request

from appliance import auth, paths
from appliance.api.context import AppApi
from appliance.api.errors import ApiError, invalid
from appliance.api.generation import ClientGone, Generation
from appliance.api.request import chat_job
from appliance.api.start import respond, start
from appliance.openai_api.chat import ChatShape
from appliance.openai_api.response_store import ResponseStore
from appliance.openai_api.responses import (
    ResponseEvents,
    ResponsesRequest,
    check_id,
    new_id,
    parse_responses,
    response_base,
    usage,
)
from appliance.params import SamplingParams
from appliance.protocol import Job

log = logging.getLogger("appliance.http")

STORE_FILE = "responses.sqlite3"  # in the state dir (--state-dir, appliance/state.py)
INPUT_ITEMS_PAGE = 20  # input_items `limit` by default (OpenAI's); at most Limits.input_items_page


class ResponsesApi:
    def __init__(self, api: AppApi):
        self.api = api
        s = api.settings
        where = Path(s.state_dir) if s.state_dir else paths.state_dir()
        self.store = ResponseStore(where / STORE_FILE, s.responses_retention, s.responses_max_bytes)

    def owner(self) -> str:
        """The SHA-256 of the request's key ("" on a server without keys): whose responses it may read."""
        s = self.api.settings
        if not (s.api_key_file or s.admin_key_file):
            return ""
        header = auth.authorization(request.headers.get("Authorization"), request.headers.get("x-api-key"))
        return auth.tenant_id(header)

    # ---- POST /v3/responses
    def create(self) -> Response | dict:
        api = self.api
        body = api.json_body()
        owner = self.owner()
        previous = None
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            pid = check_id(body["previous_response_id"], "previous_response_id", api.limits)
            stored = self.store.get(owner, pid)
            if stored is None:
                raise ApiError(
                    404,
                    f"Previous response with id '{pid}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            previous = stored.messages
        model = body.get("model") if isinstance(body, dict) else None
        status = api.ready_status(model, fresh=False) if isinstance(model, str) else None
        req = parse_responses(body, api.limits, previous, status.reasoning_parser if status else "none")
        if status is None:  # parse_chat refused the missing model already; for the type checker
            raise invalid("model missing in request", "model")
        if req.store and api.settings.state_problem:  # before any work: it could not be kept
            raise ApiError(
                503,
                f"Responses cannot be stored on this server ({api.settings.state_problem}); send \"store\": false, "
                "or ask its operator for a writable --state-dir.",
                param="store",
                code="store_unavailable",
            )
        req = replace(req, chat=api.with_images(req.chat))
        shape = ChatShape.for_request(req.chat, status.tool_parser, status.reasoning_parser)
        response_id = new_id("resp")

        def make_job(params: SamplingParams, request_id: str) -> Job:
            job = chat_job(req.chat, params, request_id, status.tool_parser, api.limits)
            job.prompts[0].thinking = req.thinking  # reasoning.effort: the template's thinking switch
            return job

        generation = start(
            api.client,
            status,
            req.chat.sampling,
            make_job,
            shape,
            request_id=response_id,  # the body's id, X-Request-Id and the engine job's: one id in every log
            model=req.chat.edge.model,
            timeout=req.chat.edge.timeout,
        )
        events = ResponseEvents(response_base(req, response_id, req.chat.edge.model, generation.job.params))
        if not req.chat.edge.stream:
            final: dict = {}
            for event in self._run(generation, events, req, owner):
                final = event
            return final["response"]
        return respond(self._sse(generation, events, req, owner), "text/event-stream")

    def _run(self, generation: Generation, events: ResponseEvents, req: ResponsesRequest, owner: str) -> Iterator[dict]:
        """Every event of the response, the last one response.completed / response.incomplete (after the store's
        commit)."""
        try:
            yield from events.opening()
            for delta in generation.deltas():
                yield from events.feed(delta["delta"])
        finally:
            generation.close()
        choice = generation.choices[0]
        cut = choice.finish_reason == "length"
        yield from events.close("incomplete" if cut else "completed")
        status = "incomplete" if cut else "completed"
        final = events.snapshot(
            status,
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage=usage(generation.usage(), events.output),
        )
        if req.store:
            self._put(owner, final, req, events)
        yield events.event(f"response.{status}", response=final)

    def _put(self, owner: str, final: dict, req: ResponsesRequest, events: ResponseEvents) -> None:
        try:
            self.store.put(owner, final, req.input_items, req.messages + events.assistant_messages())
        except (OSError, sqlite3.Error) as exc:  # a full disk, a file gone read-only: a clear answer, not a 500
            log.error("response not stored", extra={"error": f"{type(exc).__name__}: {exc}", "path": self.store.path})
            raise ApiError(
                503,
                f"The response could not be stored ({type(exc).__name__}); send \"store\": false to get it "
                "without storing.",
                param="store",
                code="store_failed",
            ) from None

    def _sse(self, generation: Generation, events: ResponseEvents, req: ResponsesRequest, owner: str) -> Iterator[str]:
        generation.streaming = True
        try:
            for event in self._run(generation, events, req, owner):
                yield _sse(event)
        except ApiError as exc:  # headers are sent: in-band, as OpenAI does
            yield _sse(events.event("error", code=exc.code, message=exc.message, param=exc.param))
        except ClientGone:
            return

    # ---- GET / DELETE /v3/responses/{id}, GET .../input_items
    def _stored(self, response_id: str):
        check_id(response_id, "response_id", self.api.limits)
        stored = self.store.get(self.owner(), response_id)
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
        return stored

    def get(self, response_id: str):
        if request.args.get("stream") in ("true", "1"):
            raise invalid("stream is not supported when retrieving a response", "stream")
        return self._stored(response_id).response

    def delete(self, response_id: str):
        check_id(response_id, "response_id", self.api.limits)
        if not self.store.delete(self.owner(), response_id):
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str):
        items = list(self._stored(response_id).input_items)
        high = self.api.limits.input_items_page
        raw = request.args.get("limit")
        if raw is None:
            limit = min(INPUT_ITEMS_PAGE, high)
        else:  # ASCII digits, few enough for int() (a Unicode digit or 5,000 of them are not a limit)
            limit = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 9 else -1
        if not 1 <= limit <= high:
            raise invalid(f"limit must be an integer in [1, {high}]", "limit")
        order = request.args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order must be asc or desc", "order")
        if order == "desc":
            items.reverse()
        after = request.args.get("after")
        if after is not None:
            check_id(after, "after", self.api.limits)
            ids = [i.get("id") for i in items]
            if after not in ids:
                raise invalid(f"after: no input item with id '{after}'", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


def _sse(event: dict[str, Any]) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


def register(app: Flask, api: AppApi, prefixes: tuple[str, ...]) -> None:
    r = ResponsesApi(api)
    for prefix in prefixes:
        app.add_url_rule(f"{prefix}/responses", view_func=r.create, methods=["POST"], endpoint=f"responses{prefix}")
        app.add_url_rule(
            f"{prefix}/responses/<response_id>", view_func=r.get, methods=["GET"], endpoint=f"response_get{prefix}"
        )
        app.add_url_rule(
            f"{prefix}/responses/<response_id>",
            view_func=r.delete,
            methods=["DELETE"],
            endpoint=f"response_delete{prefix}",
        )
        app.add_url_rule(
            f"{prefix}/responses/<response_id>/input_items",
            view_func=r.input_items,
            methods=["GET"],
            endpoint=f"response_input_items{prefix}",
        )
