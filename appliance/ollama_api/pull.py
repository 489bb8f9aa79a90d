"""Ollama's `POST /api/pull` and `DELETE /api/delete`, on the Ollama Blueprint (routes.py registers them).

/api/pull `{"model": "REPO[:REVISION]", "stream": true}`: the download runs in a child process of this worker,
`python -m appliance.pull --json NAME` (appliance/pull/__init__.py says why there, and how a partial download is never
served), whose stdout is Ollama's status objects one a line (`pulling manifest`, `pulling <digest>` with
`digest`/`total`/`completed`, `verifying sha256 digest`, `writing manifest`, `success`, or `{"error"}`). They are
relayed as they come (NDJSON), except the child's `success`: the worker first asks the engine process to serve the
model (protocol SERVE_PULLED, appliance/server/pulled_models.py), and answers `success` once it does. `stream:
false`: one body at the end, `{"status": "success"}` or `{"error"}` with the pull's status (400 a name or repository
that cannot be served, 404 not on the hub, 502 the hub failed, 507 no disk space). A client that goes away ends the
child (SIGTERM): its lock goes with it, the staged files stay for the next pull to resume.

/api/delete `{"model": NAME}`: the engine process stops serving it (after its in-flight jobs) and deletes its folder;
200 with no body, 404 `{"error"}` for a model it does not know, 400 for one it did not pull (protocol DELETE_PULLED).

Both download, load or delete models, so they follow the config reload's rule (appliance/auth.py `reload_refusal`):
an admin key, or a loopback server without keys and not from a web page. The worker imports nothing heavy: the
child is a separate interpreter, and the engine does the loading.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

from flask import Blueprint, Response, g, request

from appliance import auth, hub_names
from appliance import protocol as p
from appliance.api.client_socket import socket_closed
from appliance.api.context import AppApi
from appliance.api.errors import ApiError
from appliance.api.start import respond
from appliance.http.client import EngineUnavailable
from appliance.ollama_api.requests import body_json

# the worker's pid: the child stops when its parent is gone (appliance/pull/command.py)
PARENT_ENV = "APPLIANCE_PULL_PARENT"
STOP_SECONDS = 10.0  # a child asked to stop (SIGTERM) that is still running after this is killed


def _line(data: dict) -> str:
    return json.dumps(data, separators=(",", ":")) + "\n"


class PullRoutes:
    def __init__(self, api: AppApi):
        self.api = api

    def _body(self, what: str) -> dict:
        refusal = auth.reload_refusal(self.api.settings, g.get("admin", False), request.headers.get("Origin"), what)
        if refusal is not None:
            raise ApiError(refusal[0], refusal[1], code="admin_key_required")
        body = body_json()
        if not isinstance(body, dict):
            raise ApiError(400, "Received json is not an object")
        return body

    def pull(self):
        body = self._body("Pulling models")
        stream = body.get("stream", True)
        if not isinstance(stream, bool) or not isinstance(body.get("insecure", False), bool):
            raise ApiError(400, "stream and insecure must be true or false")
        try:
            ref = hub_names.parse(body.get("model") or body.get("name"))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        problem = self.api.settings.state_problem  # found at start-up (appliance/state.py): refused now, not later
        if problem:
            raise ApiError(503, f"pulls are off on this server: {problem}; give it a writable --state-dir")
        events = self._pull(ref, request.environ.get("gunicorn.socket"))
        if stream:  # Ollama's lines: the status `code` is for the unary answer only
            lines = (_line({k: v for k, v in event.items() if k != "code"}) for event in events)
            return respond(lines, "application/x-ndjson")
        last = collections.deque(events, maxlen=1)[0]  # the child's lines run to the end; the last one says how
        if "error" in last:
            raise ApiError(int(last.get("code") or 500), last["error"])
        return {"status": "success"}

    def _pull(self, ref: hub_names.HubRef, sock: socket.socket | None) -> Iterator[dict]:
        """The child's status objects, its `success` held until the engine serves the model; an error is the last.
        The client's socket is looked at after each line (a download reports 4 a second): a write to a peer that
        has gone may still succeed for a while, and the download would go on for nobody."""
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        child = subprocess.Popen(
            [sys.executable, "-m", "appliance.pull", "--json", ref.name],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert child.stdout is not None
        try:
            last: dict = {}
            for text in child.stdout:
                try:
                    last = json.loads(text)
                except ValueError:
                    continue  # not ours (a library printing to stdout)
                if not isinstance(last, dict) or last.get("status") == "success" or "error" in last:
                    break
                if socket_closed(sock):
                    return  # the finally below stops the child
                yield last
            child.wait()
            if isinstance(last, dict) and "error" in last:
                yield last
            elif not isinstance(last, dict) or last.get("status") != "success":
                yield {"error": f"the pull stopped (exit status {child.returncode}); see the server's log"}
            else:
                yield self._serve(ref)
        finally:
            if child.poll() is None:  # the client went away: stop the child; what it staged stays for a resume
                child.terminate()
                try:
                    child.wait(STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            child.stdout.close()

    def _serve(self, ref: hub_names.HubRef) -> dict:
        try:
            reply = self.api.client.call(p.SERVE_PULLED, ref.name, timeout=p.RELOAD_SECONDS)
        except EngineUnavailable as exc:  # the files are in place; serving them failed
            return {"error": f"pulled, but the engine could not be asked to serve it: {exc}", "code": 503}
        self.api.client.forget(ref.name)
        if reply.error is not None:
            return {"error": reply.error.message, "code": reply.error.status}
        return {"status": "success"}

    def delete(self):
        body = self._body("Deleting models")
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required")
        reply = self.api.client.call(p.DELETE_PULLED, name, timeout=p.RELOAD_SECONDS)
        if reply.error is not None:
            raise ApiError(reply.error.status, reply.error.message)
        self.api.client.forget(name)
        return Response(status=200)


def register(bp: Blueprint, api: AppApi) -> None:
    routes = PullRoutes(api)
    bp.add_url_rule("/pull", view_func=routes.pull, methods=["POST"])
    bp.add_url_rule("/delete", view_func=routes.delete, methods=["DELETE"])
