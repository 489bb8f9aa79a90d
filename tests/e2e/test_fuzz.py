"""docs/openapi.json: a valid OpenAPI 3.1 document that matches the routes the app serves, and the running server
(the session's `appliance serve`, see conftest.py) fuzzed against it with schemathesis.

Two schemathesis runs (its CLI in a subprocess, fixed seed, JSON report):
* positive: every request valid by a copy of the document narrowed for speed (max_tokens <= 8, short prompts,
  n <= 3, the served model name) must be accepted (2xx) and answered as documented: status, content type,
  headers, body schema, each SSE event's JSON against the chunk schemas, plus this file's own checks (choice
  count, usage sums, SSE framing: opening chunk, one finish per choice, include_usage, [DONE] last);
* negative: requests that break the document must get a documented 4xx, never a 5xx; wrong methods get 405 with
  an `Allow` header.
* raw bytes: no document; seeded hostile bodies (mangled JSON, random bytes, lone surrogates, 400-digit integers,
  deep nesting, oversized lists, the review's named attacks) to completions, chat and tokenize: never a 5xx.
After each, the server must be healthy: same worker PIDs (none crashed), no traceback in its log, nothing running
or queued, no KV block held, and the same greedy answer as before the fuzzing.

This module is also schemathesis's hooks module in that subprocess (SCHEMATHESIS_HOOKS=test_fuzz): see the end.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from appliance.openai_api import fields as F

ROOT = Path(__file__).resolve().parents[2]
DOC_PATH = ROOT / "docs" / "openapi.json"
SEED = int(os.environ.get("APPLIANCE_FUZZ_SEED", "20261122"))  # fixed: CI runs are reproducible
EXAMPLES = int(os.environ.get("APPLIANCE_FUZZ_EXAMPLES", "40"))  # per operation; raise it for a long hunt
FUZZ_MAX_TOKENS = 8
CHECKS_COMMON = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "appliance_generation",
]


def load_doc() -> dict:
    return json.loads(DOC_PATH.read_text())


# ---------------------------------------------------------------- the document itself (fast, no server)


def test_openapi_document_is_valid_openapi_3_1():
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError
    from openapi_spec_validator import OpenAPIV31SpecValidator, validate
    from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

    import appliance

    doc = load_doc()
    assert doc["openapi"].startswith("3.1.")
    validate(doc, cls=OpenAPIV31SpecValidator)  # raises on any error, $refs included
    assert doc["info"]["version"] == appliance.__version__
    for schema in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)  # each schema is a valid JSON Schema 2020-12 one
    # the documented request examples are valid requests, by the document
    for item in doc["paths"].values():
        for op in item.values():
            media = op.get("requestBody", {}).get("content", {}).get("application/json")
            if media and "example" in media:
                Draft202012Validator({**media["schema"], "components": doc["components"]}).validate(media["example"])
    # both checks do fail on a broken document (else passing them proves nothing): the OpenAPI validator leaves
    # schema keywords to JSON Schema, which is why each schema is checked on its own above
    broken = copy.deepcopy(doc)
    broken["components"]["schemas"]["Usage"]["properties"]["total_tokens"]["type"] = "int"
    with pytest.raises(SchemaError):
        Draft202012Validator.check_schema(broken["components"]["schemas"]["Usage"])
    broken = copy.deepcopy(doc)
    broken["paths"]["/v1/completions"]["post"]["operationId"] = "createCompletion"  # an alias copied carelessly
    with pytest.raises(OpenAPIValidationError, match="not unique"):
        validate(broken, cls=OpenAPIV31SpecValidator)
    broken = copy.deepcopy(doc)
    del broken["paths"]["/v3/models/{model_id}"]["get"]["parameters"]
    with pytest.raises(OpenAPIValidationError, match="model_id"):
        validate(broken, cls=OpenAPIV31SpecValidator)


# blueprint names of the client APIs openapi.json does not describe (docs/ollama.md), and the web page's files
# (docs/serving.md)
OTHER_APIS = {"ollama", "web"}


def test_openapi_paths_are_the_routes_the_app_serves():
    """Every route of the Flask app's OpenAI/OVMS API is documented with its methods, and nothing else is (no server
    needed: the app is built with no engine client, which route registration never touches). The other client APIs
    are blueprints: Anthropic's Messages routes are in the document too, Ollama's in docs/ollama.md."""
    from appliance.settings import ServeSettings
    from appliance.wsgi.app import create_app

    app = create_app(ServeSettings(model_dir="unused", served_model_name="m", model_created=1), client=object())
    served = {
        (re.sub(r"<[^>]+>", "{}", rule.rule), method.lower())
        for rule in app.url_map.iter_rules()
        if rule.endpoint != "static" and rule.endpoint.split(".")[0] not in OTHER_APIS
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    documented = {
        (re.sub(r"{[^}]+}", "{}", path), method)  # path variables are named differently
        for path, item in load_doc()["paths"].items()
        for method in item
    }
    assert documented == served


def test_openapi_bounds_are_the_limits():
    """The document states appliance/limits.py's defaults: a bound changed in one place only fails here (and the
    negative fuzz run would otherwise report the server accepting what the document forbids, or the reverse)."""
    from dataclasses import fields

    from appliance.limits import Limits

    lim = Limits()
    s = load_doc()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = s[name]["properties"]
        assert (props["length_penalty"]["minimum"], props["length_penalty"]["maximum"]) == (
            -lim.length_penalty,
            lim.length_penalty,
        )
        assert props["repetition_penalty"]["maximum"] == lim.repetition_penalty
        assert props["temperature"]["maximum"] == lim.temperature
        assert props["frequency_penalty"]["maximum"] == props["presence_penalty"]["maximum"] == lim.penalty
        assert props["timeout"]["maximum"] == lim.timeout
        assert props["stop"]["anyOf"][1]["maxItems"] == lim.stop_strings
        assert (
            props["stop"]["anyOf"][0]["maxLength"] == props["stop"]["anyOf"][1]["items"]["maxLength"] == lim.stop_chars
        )
        assert props["stop_token_ids"]["maxItems"] == lim.stop_token_ids
        assert props["logit_bias"]["maxProperties"] == lim.logit_bias
        assert (props["n"]["maximum"], props["best_of"]["maximum"]) == (lim.n, lim.best_of)
    assert s["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]["maxItems"] == lim.prompts
    assert s["TokenizeRequest"]["properties"]["prompt"]["anyOf"][1]["maxItems"] == lim.prompts
    assert s["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] == lim.messages
    documented = s["Config"]["additionalProperties"]["properties"]["limits"]["properties"]
    assert set(documented) == {f.name for f in fields(Limits)}


# ---------------------------------------------------------------- fuzzing the running server


def served_model_document(doc: dict, model: str) -> dict:
    """The document with the served model as the only valid `model` and model path parameter. Else a request
    with a random model name gets 404 when its body is fine, which hides a server that accepts an invalid body
    (the body is checked first: 400), and no generation request is ever accepted."""
    d = copy.deepcopy(doc)
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest"):
        d["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "const": model}
    for item in d["paths"].values():
        for op in item.values():
            for param in op.get("parameters", []):
                if param["in"] == "path":
                    param["schema"] = {"type": "string", "const": model}
    return d


def fuzz_document(doc: dict, model: str, vocab_size: int) -> dict:
    """`served_model_document` narrowed so that every valid request is cheap and accepted: short prompts,
    max_tokens <= FUZZ_MAX_TOKENS (required: no runaway generation), small n and best_of, token ids inside the
    vocabulary, a timeout that cannot fire. Narrowing only: each request valid here is valid by the real one."""
    d = without_speculation(served_model_document(doc, model))
    s = d["components"]["schemas"]
    text = {"type": "string", "minLength": 1, "maxLength": 64}
    ids = {
        "type": "array",
        "minItems": 1,
        "maxItems": 16,
        "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
    }
    completion, chat = s["CompletionRequest"], s["ChatCompletionRequest"]
    completion["properties"]["prompt"] = {
        "anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": 3, "items": {"anyOf": [text, ids]}}]
    }
    completion["properties"]["max_tokens"] = {"type": "integer", "minimum": 0, "maximum": FUZZ_MAX_TOKENS}
    chat["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": FUZZ_MAX_TOKENS}
    chat["properties"]["max_completion_tokens"] = {
        "type": ["integer", "null"],
        "minimum": 1,
        "maximum": FUZZ_MAX_TOKENS,
    }
    short = {"type": "string", "maxLength": 64}
    message = chat["properties"]["messages"]
    message["maxItems"] = 4
    message["items"]["properties"]["role"]["maxLength"] = 16
    message["items"]["properties"]["content"] = {
        "anyOf": [
            short,
            {"type": "null"},
            {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "required": ["type", "text"],
                    "properties": {"type": {"const": "text"}, "text": short},
                },
            },
        ]
    }
    for request in (completion, chat):
        request["required"] = [*request["required"], "max_tokens"]
        request["properties"]["n"]["maximum"] = 3
        request["properties"]["best_of"]["maximum"] = 4
        request["properties"]["timeout"] = {"type": ["number", "null"], "minimum": 120, "maximum": 600}
        request["properties"]["logit_bias"]["propertyNames"] = {"pattern": "^(0|[1-9][0-9]{0,8})$"}
        request["properties"]["stop_token_ids"]["items"]["maximum"] = vocab_size - 1  # else 400, engine-side
    # structured fields: no schema, regex or grammar the engine could refuse (a 400 from there), token ids inside the
    # vocabulary, max_tokens (required here) bounds every generation, tool choices that name no unknown tool
    plain_format = {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}}
    for request in (completion, chat):
        request["properties"]["response_format"] = {"anyOf": [plain_format, {"type": "null"}]}
        request["allOf"] = [
            r for r in request["allOf"] if "num_assistant_tokens" not in r.get("if", {}).get("required", [])
        ]
    props = completion["properties"]
    props["tokens"] = {"anyOf": [ids, {"type": "null"}]}
    props["num_beams"]["maximum"] = 4
    props["max_total_tokens"] = {"type": "null"}
    props["no_repeat_ngram"]["maximum"] = 8
    for name in ("stop_tokens", "bad_word_tokens"):
        props[name]["items"]["properties"]["tokens"]["items"]["maximum"] = vocab_size - 1
    function = {"type": "object", "required": ["name"], "properties": {"name": {"enum": ["f", "g"]}}}
    tool = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": function},
    }
    chat["properties"]["tools"] = {"anyOf": [{"type": "array", "maxItems": 1, "items": tool}, {"type": "null"}]}
    chat["properties"]["tool_choice"] = {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "null"}]}
    props["seed"]["anyOf"][1]["maxItems"] = 3  # n <= 3
    # the one-rule-per-value rules (n <= best_of, num_beams; a seed list per n) beyond these bounds can never
    # apply: dropped, or schemathesis's canonicalizer gives up on the combined rules ("does not support this part")
    bounds = {"best_of": 4, "num_beams": 4, "n": 3}
    for request in (completion, chat):
        for rule in request["allOf"]:
            if "allOf" in rule:
                rule["allOf"] = [r for r in rule["allOf"] if _within(r, bounds)]
    s["TokenizeRequest"]["properties"]["prompt"] = {"anyOf": [short, {"type": "array", "maxItems": 4, "items": short}]}
    return d


SPECULATION_FIELDS = tuple(f.name for f in F.SPECULATION)  # the table's speculation group


def without_speculation(doc: dict) -> dict:
    """The document without the speculation fields (tests/openai_api/test_speculation_api.py and test_api_validation.py
    cover them): the shared server has no draft model, so a confidence threshold is a 400 engine-side; with these
    properties schemathesis's canonicalizer gives up on chat's combined rules (positive mode) and generating
    invalid bodies of the completions request is too slow (negative mode: it failed hypothesis's too_slow check)."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        request = doc["components"]["schemas"][name]
        for field in SPECULATION_FIELDS:
            del request["properties"][field]
        request["allOf"] = [
            r for r in request["allOf"] if SPECULATION_FIELDS[0] not in r.get("if", {}).get("required", [])
        ]
    return doc


def _within(rule: dict, bounds: dict[str, int]) -> bool:
    """False for a per-value rule whose condition needs a value above the fuzz bounds."""
    cond = rule.get("if", {}).get("properties", {})
    for name, most in bounds.items():
        if cond.get(name, {}).get("const", 0) > most:
            return False
    return cond.get("seed", {}).get("minItems", 0) <= bounds["n"]


def run_schemathesis(schema_path: Path, base: str, workdir: Path, *args: str) -> tuple[dict, str]:
    """The schemathesis CLI against `base`; returns its JSON report and its console output."""
    return run_schemathesis_parts(schema_path, base, workdir, [args])[0]


def run_schemathesis_parts(
    schema_path: Path, base: str, workdir: Path, parts: list[tuple[str, ...]]
) -> list[tuple[dict, str]]:
    """One schemathesis CLI run per entry of `parts` (its own arguments), all at once, each in its own
    subprocess; their JSON reports and console outputs, in order. Why: the negative run's cost is schemathesis
    generating invalid bodies (one process on one core: 149 s of its CPU for 760 fuzzed cases, 3.6 s of the
    server's), so its operations and phases split over processes keep a second core busy. The same cases are sent:
    with a fixed seed, each operation's cases do not depend on which other operations a run selects."""
    procs = [_start_schemathesis(schema_path, base, workdir / f"part{i}", *args) for i, args in enumerate(parts)]
    try:
        return [_finish_schemathesis(*proc) for proc in procs]
    finally:
        for proc, _ in procs:  # a part that failed or timed out leaves none running
            proc.kill()
            proc.wait()


def _start_schemathesis(schema_path: Path, base: str, workdir: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "report.json"
    config = workdir / "schemathesis.toml"
    # read whole streams (default: the first 20 events); a body past --max-body-bytes is rejected too (413): the
    # Messages schema's content blocks (content_parts) x messages can make one that no other bound caught first
    from schemathesis.config._checks import NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES as REJECTIONS

    rejections = ", ".join(f'"{s}"' for s in [*REJECTIONS, "413"])
    config.write_text(
        f"max-stream-events = 100000\n\n[checks.negative_data_rejection]\nexpected-statuses = [{rejections}]\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        str(schema_path),
        "--url",
        base,
        "--seed",
        str(SEED),
        "--workers",
        "1",  # 1: hypothesis' lambda sourcing is not thread safe
        "--request-timeout",
        "120",
        "--generation-database",
        "none",
        # hypothesis's too_slow health check times data generation, not the server: on a loaded 2-core box the
        # negative run's generation alone failed it ("Data generation is too slow") with no finding; the checks
        # on the server's answers stay as they are
        "--suppress-health-check",
        "too_slow",
        "--no-color",
        "--output-sanitize",
        "false",
        "--report",
        "json",
        "--report-json-path",
        str(report),
        *args,
    ]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "test_fuzz",
        "APPLIANCE_FUZZ_DOC": str(DOC_PATH),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "tests" / "e2e"), str(ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    log = workdir / "output.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return proc, workdir


def _finish_schemathesis(proc: subprocess.Popen, workdir: Path) -> tuple[dict, str]:
    proc.wait(timeout=600)
    output = (workdir / "output.txt").read_text()
    report = workdir / "report.json"
    assert report.is_file(), output[-15000:]
    return json.loads(report.read_text()), output


def assert_clean(report: dict, output: str, min_cases: int, every_operation: bool = True) -> None:
    """A run without a finding. `every_operation`: each selected operation was tested (a run of the fuzzing phase
    alone skips those it has nothing to generate for, e.g. a GET without parameters)."""
    assert report["exit_code"] == 0 and report["complete"], output[-15000:]
    assert not report["failures"] and not report["errors"], output[-15000:]
    assert report["test_cases"]["generated"] >= min_cases, report["test_cases"]
    assert report["operations"]["errored"] == 0, report["operations"]
    if every_operation:
        assert report["operations"]["tested"] == report["operations"]["selected"], report["operations"]


@pytest.fixture(scope="module")
def health(server, model_name):
    """The server's state before the fuzzing; `check()` asserts it is unharmed afterwards."""
    from tests.helpers import wait_idle  # greedy before == after holds for requests that run alone (solo greedy)

    body = {"model": model_name, "prompt": "The capital of France is", "max_tokens": 8}
    wait_idle(server)
    greedy = requests.post(server.base + "/v3/completions", json=body, timeout=120).json()["choices"][0]["text"]
    workers, log_start = server.workers(), server.log_size()

    def check() -> None:
        assert server.proc.poll() is None
        assert server.workers() == workers, "a worker died (gunicorn replaced it)"
        log = server.output(since=log_start)
        assert "Traceback" not in log and "Exception in thread" not in log, log[-6000:]
        assert requests.get(server.base + "/v2/health/ready", timeout=10).status_code == 200
        m = server.metrics()
        assert (m["appliance_running_sequences"], m["appliance_queue_depth"], m["appliance_kv_cache_blocks_used"]) == (
            0,
            0,
            0,
        )
        wait_idle(server)
        after = requests.post(server.base + "/v3/completions", json=body, timeout=120).json()
        assert after["choices"][0]["text"] == greedy

    return check


@pytest.mark.slow
def test_fuzz_valid_requests(server, model_dir, model_name, health, tmp_path):
    from appliance.manifest import Manifest

    schema = tmp_path / "openapi-fuzz.json"
    schema.write_text(json.dumps(fuzz_document(load_doc(), model_name, Manifest.load(model_dir).vocab_size)))
    report, output = run_schemathesis(
        schema,
        server.base,
        tmp_path,
        "--mode",
        "positive",
        "--max-examples",
        str(EXAMPLES),
        "--exclude-deprecated",  # /v3/v1/...: the same handlers again
        "--exclude-path-regex",
        "^/v1/((chat/)?completions|config/reload)$|/responses|^/v1/messages|/embeddings$|/rerank$",  # ditto, and the
        # costly ones (the negative run has them); a reload is refused (400) on a server without --config:
        # tests/server/test_multi_model.py runs it; the Responses and Messages routes are proved by
        # tests/openai_api/test_responses*.py and tests/anthropic_api/test_anthropic*.py (a random id is a 404, items
        # have rules, max_tokens is unbounded by the
        # schema); the shared server serves no encoder, so every valid embeddings / rerank request is a 400 there:
        # tests/openai_api/test_embeddings.py proves them on a server that does
        "--checks",
        ",".join([*CHECKS_COMMON, "response_headers_conformance", "positive_data_acceptance"]),
    )
    assert_clean(report, output, min_cases=10 * EXAMPLES)
    for op in ("POST /v3/completions", "POST /v3/chat/completions"):  # real generations, not just 4xx
        assert report["valid_rates"][op]["fuzzing"]["accepted"] >= EXAMPLES // 2, report["valid_rates"][op]
    health()


# The negative run's three parts, run at once (run_schemathesis_parts): together every phase of every operation,
# each once. Its fuzzing phase costs schemathesis ~0.2 s of CPU a case on the four generation routes (108 of its 120 s
# of generation: /v3 completions 36 s, /v3 chat 30 s, /v1 completions 22 s, /v1 chat 19 s; every other operation
# under 4 s) and ~0.05 s elsewhere; the coverage phase (4267 cases) ~30 s. So /v3's two generation routes are
# fuzzed in one part, the other operations in another, and the examples, coverage and stateful phases (the
# stateful one follows links between operations, so it keeps them all) in a third.
HEAVY_FUZZ = "^/v3/(chat/)?completions$"
NO_ENCODER = "/embeddings$|/rerank$"  # no encoder on the shared server (the positive run says why)
NEGATIVE_PARTS = [
    ("--phases", "fuzzing", "--exclude-path-regex", NO_ENCODER, "--include-path-regex", HEAVY_FUZZ),
    ("--phases", "fuzzing", "--exclude-path-regex", f"{NO_ENCODER}|{HEAVY_FUZZ}"),
    ("--phases", "examples,coverage,stateful", "--exclude-path-regex", NO_ENCODER),
]


@pytest.mark.slow
def test_fuzz_invalid_requests(server, model_name, health, tmp_path):
    schema = tmp_path / "openapi-served.json"
    schema.write_text(json.dumps(without_speculation(served_model_document(load_doc(), model_name))))
    common = (
        "--mode",
        "negative",
        "--max-examples",
        str(EXAMPLES),
        "--exclude-deprecated",
        "--checks",
        ",".join([*CHECKS_COMMON, "negative_data_rejection", "unsupported_method", "allow_header_conformance"]),
    )
    runs = run_schemathesis_parts(schema, server.base, tmp_path, [(*common, *part) for part in NEGATIVE_PARTS])
    for report, output in runs[:2]:  # the fuzzing phase
        assert_clean(report, output, min_cases=2 * EXAMPLES, every_operation=False)
    assert_clean(*runs[2], min_cases=EXAMPLES)  # every operation tested, as by the whole run
    assert sum(report["test_cases"]["generated"] for report, _ in runs) >= 20 * EXAMPLES
    # together the fuzzing parts select every operation the other phases do, each once
    fuzzed = [report["operations"]["selected"] for report, _ in runs[:2]]
    assert sum(fuzzed) == runs[2][0]["operations"]["selected"] and min(fuzzed) >= 2, fuzzed
    health()


# ---------------------------------------------------------------- raw-bytes fuzzing (no document)
# schemathesis only sends JSON its schema generator can build; this sends what an attacker would: mangled JSON
# bytes, random bytes, hostile values of any type in any field (lone surrogates, 400-digit integers, deep nesting,
# oversized lists), each to the real server. None may get a 5xx; the server must be unharmed afterwards.

RAW_REQUESTS = int(os.environ.get("APPLIANCE_RAW_FUZZ_REQUESTS", "300"))
RAW_PATHS = ("/v3/completions", "/v3/chat/completions", "/v3/tokenize")


def _nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = [
    None,
    True,
    False,
    0,
    -1,
    2**31,
    2**64,
    10**400,
    -(10**400),
    1e308,
    -1e308,
    0.5,
    "",
    "x",
    "\ud800",
    "a\udfffb",
    "01",
    "+1",
    " 1",
    "\u0000",
    "<|im_start|>system",
    [],
    [1],
    [-1],
    ["\ud800"],
    [[1]],
    [[]],
    ["a"] * 300,
    list(range(300)),
    {},
    {"a": 1},
    {"\ud800": 1},
    {"01": 1},
    {"1": 10**400},
    {str(i): 1 for i in range(301)},
    _nested(40),
    _nested(900),
    [{"role": "user", "content": "\ud800"}],
    [{"role": "user", "content": "x", "extra": _nested(30)}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": "x", "tool_calls": "x"}],
    [{"role": "user", "content": "x"}] * 1100,
]

# every request field of the tables (a Field added there is fuzzed at once), and one unknown field
FIELDS = [*dict.fromkeys(f.name for table in (F.COMPLETION, F.CHAT, F.TOKENIZE) for f in table), "extra"]


def raw_base(path: str, model: str) -> dict:
    """A valid, cheap request: at most 4 tokens, and a timeout in case a mutation drops max_tokens."""
    if path.endswith("/tokenize"):
        return {"model": model, "prompt": ["The capital", "of France"]}
    cheap = {"model": model, "max_tokens": 4, "timeout": 10}
    if path.endswith("/chat/completions"):
        return {**cheap, "messages": [{"role": "user", "content": "Hi there"}]}
    return {**cheap, "prompt": "The capital of France is"}


def raw_cases(rng, model: str):
    """(path, content type, body bytes): first the attacks the review named, then seeded random mutations."""
    json_type = "application/json"

    def encode(body: object) -> bytes:  # ensure_ascii: "\ud800" goes out as the escape a client would send
        return json.dumps(body).encode()

    completions, chat, tokenize = RAW_PATHS
    named = [
        (completions, {"prompt": "x", "max_tokens": 5, "best_of": 2, "length_penalty": 2000}),
        (completions, {"prompt": "\ud800"}),
        (chat, {"messages": [{"role": "user", "content": "\ud800"}]}),
        (tokenize, {"prompt": ["ok", "\ud800"]}),
        (completions, {"prompt": "x", "max_tokens": 2, "timeout": 10**400}),
        (completions, {"prompt": "x", "max_tokens": 2, "temperature": 10**400}),
        (completions, {"prompt": ["a"] * 256, "n": 20, "max_tokens": 1}),
        (completions, {"prompt": ["a"] * 5000, "max_tokens": 1}),
        (completions, {"prompt": [[1]] * 5000, "n": 20, "max_tokens": 1}),
        (tokenize, {"prompt": ["a"] * 5000}),
        (completions, {"prompt": "x", "max_tokens": 2, "best_of": 20, "stop_token_ids": list(range(10000))}),
        (completions, {"prompt": "x", "max_tokens": 2, "stop_token_ids": [2**31]}),
        (completions, {"prompt": "x", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(5000)}}),
        (completions, {"prompt": "x", "max_tokens": 2, "logit_bias": {"1": 5, "01": 5}}),
        (completions, {"prompt": "x", "max_tokens": 2, "stop": ["y" * 100000]}),
        (completions, {"prompt": [[1] * 3000] * 8, "echo": True, "logprobs": 20, "max_tokens": 0}),
        (chat, {"messages": [{"role": "user", "content": "x", "x": _nested(900)}], "max_tokens": 2}),
        (chat, {"messages": [{"role": "user", "content": "x"}] * 5000, "max_tokens": 2}),
    ]
    for path, body in named:
        yield path, json_type, encode({"model": model, **body})
    yield completions, json_type, b'{"model": "%s", "prompt": "' % model.encode() + b"\xff\xfe" + b'"}'
    yield completions, json_type, b"[" * 100000
    yield completions, json_type, b'{"model": "m", "prompt": 1' + b"0" * 5000 + b"}"
    while True:
        path = rng.choice(RAW_PATHS)
        body = raw_base(path, model)
        kind = rng.random()
        if kind < 0.1:  # random bytes
            yield path, json_type, rng.randbytes(rng.randrange(0, 300))
            continue
        if kind < 0.45:  # hostile values in one to three fields
            for _ in range(rng.randrange(1, 4)):
                body[rng.choice(FIELDS)] = rng.choice(HOSTILE)
            data = encode(body)
        else:  # the JSON text, mangled byte-wise
            data = bytearray(encode(body))
            for _ in range(rng.randrange(1, 4)):
                at, op = rng.randrange(len(data)), rng.random()
                if op < 0.4:
                    data[at] = rng.randrange(256)
                elif op < 0.7:
                    data[at:at] = rng.choice(
                        [b"\\ud800", b"9" * 400, b"[" * 50, b"\"", b",", b"{", b"\\", b"\x00", b"e999", b"NaN", b"\xc3"]
                    )
                else:
                    del data[at : at + rng.randrange(1, 8)]
            data = bytes(data)
        yield path, (json_type if rng.random() < 0.95 else "text/plain"), data


@pytest.mark.slow
def test_raw_bytes_fuzzing_finds_no_5xx(server, model_name, health):
    import random

    from tests.helpers import wait_until

    rng = random.Random(SEED)
    seen: dict[int, int] = {}
    failures = []
    for i, (path, content_type, data) in zip(range(RAW_REQUESTS), raw_cases(rng, model_name)):
        r = requests.post(server.base + path, data=data, headers={"Content-Type": content_type}, timeout=120)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            failures.append((i, path, data[:300], r.status_code, r.text[:300]))
    assert not failures, failures[:10]
    assert seen.get(400, 0) > RAW_REQUESTS // 3 and seen.get(200, 0) > 10, seen  # it did reach both sides
    wait_until(
        lambda: (m := server.metrics())["appliance_running_sequences"] == 0 and m["appliance_queue_depth"] == 0,
        "the fuzzed requests to finish",
    )
    health()


@pytest.mark.slow
def test_fuzzer_catches_a_document_stricter_than_the_server(server, model_name, tmp_path):
    """The negative run can fail: with a document claiming tokenize prompts are at most 5 characters long, the
    server's acceptance of longer ones is reported."""
    doc = served_model_document(load_doc(), model_name)
    doc["components"]["schemas"]["TokenizeRequest"]["properties"]["prompt"] = {"type": "string", "maxLength": 5}
    schema = tmp_path / "wrong.json"
    schema.write_text(json.dumps(doc))
    report, output = run_schemathesis(
        schema,
        server.base,
        tmp_path,
        "--mode",
        "negative",
        "--phases",
        "coverage",
        "--include-path",
        "/v3/tokenize",
        "--max-examples",
        "20",
        "--checks",
        "negative_data_rejection",
    )
    assert report["exit_code"] != 0 and report["failures"], output[-5000:]
    assert "Schema-violating request accepted" in output, output[-5000:]


# ---------------------------------------------------------------- hooks, loaded by schemathesis only
# In the schemathesis subprocess (SCHEMATHESIS_HOOKS=test_fuzz) this module is imported as its hooks module.


def _whole_numbers(value):
    """2.0 -> 2. JSON Schema 2020-12 counts 2.0 as an integer, so schemathesis sends it for integer fields; the
    server, like OVMS, takes only integers written without a fraction (`"max_tokens": 8.0` is a 400, as in OVMS,
    and as docs/openapi.json says)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    return value


def _choices_expected(path: str, body: dict) -> int:
    n = body.get("n") or 1
    if path.endswith("/chat/completions"):
        return n
    prompt = body.get("prompt") or body["tokens"]  # Friendli's tokens: the prompt as ids
    single = isinstance(prompt, str) or all(isinstance(t, int) for t in prompt)
    return n * (1 if single else len(prompt))


def _check_unary(path: str, body: dict, answer: dict) -> None:
    expected = _choices_expected(path, body)
    assert sorted(c["index"] for c in answer["choices"]) == list(range(expected)), "one choice per prompt and n"
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(limit, int):
        assert usage["completion_tokens"] <= limit * expected


def _check_stream(path: str, body: dict, text: str) -> None:
    assert text.endswith("data: [DONE]\n\n"), f"the stream does not end with [DONE]: ...{text[-300:]!r}"
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), "one `data:` line per event"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert not any("error" in p for p in payloads), f"in-band error: {[p for p in payloads if 'error' in p]}"
    assert len({(p["id"], p["created"]) for p in payloads}) == 1, "one id and created for the whole stream"
    chat = path.endswith("/chat/completions")
    usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
    if usage_wanted:
        *payloads, last = payloads
        assert last["choices"] == [] and last["usage"] is not None, "include_usage: a last chunk with the usage"
        assert all("usage" in p and p["usage"] is None for p in payloads), "include_usage: usage null before"
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(limit, int):
            assert last["usage"]["completion_tokens"] <= limit * _choices_expected(path, body)
    else:
        assert not any("usage" in p for p in payloads), "usage without include_usage"
    by_index: dict[int, list] = {}
    for p in payloads:
        assert len(p["choices"]) == 1
        by_index.setdefault(p["choices"][0]["index"], []).append(p["choices"][0])
    assert sorted(by_index) == list(range(_choices_expected(path, body))), "one choice per prompt and n"
    for index, choices in by_index.items():
        first = choices[0]
        assert first["finish_reason"] is None
        if not (body.get("echo") and body.get("logprobs") is not None):  # else: the echoed prompt's logprobs
            assert first["logprobs"] is None
        if chat:
            assert first["delta"] == {"role": "assistant", "content": None}, "chat: the opening chunk names the role"
        reasons = [c["finish_reason"] for c in choices]
        assert reasons[-1] in ("stop", "length") and not any(reasons[:-1]), f"choice {index}: {reasons}"


if os.environ.get("SCHEMATHESIS_HOOKS") == __name__:
    import schemathesis

    @schemathesis.hook
    def before_call(context, case, kwargs):
        if isinstance(case.body, (dict, list)):
            case.body = _whole_numbers(case.body)

    @schemathesis.check
    def appliance_generation(ctx, response, case):
        """This server's rules a schema cannot say; only for accepted generation requests."""
        if (
            response.status_code != 200
            or response.request.method != "POST"
            or not case.path.endswith("/completions")
            or not isinstance(case.body, dict)
        ):
            return None
        content_type = response.headers.get("content-type", [""])[0]
        if content_type.startswith("text/event-stream"):
            _check_stream(case.path, case.body, response.content.decode("utf-8"))
        else:
            _check_unary(case.path, case.body, json.loads(response.content))
        return True
