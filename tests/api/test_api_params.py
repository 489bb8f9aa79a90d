"""Request parameters at the HTTP edge: structured output (`response_format`, Cerebras's `grammar_root`),
chat tools, and the Friendli / Cerebras completions parameters (docs/serving.md "Structured output and parameters
of other APIs").

Unit tests of the parsers first (each mapping onto the SamplingParams it means, every new 400 with the
parameter it names), then end to end through the real server and the `openai` SDK (`extra_body` for what OpenAI's
API does not have): each parameter changes the output as documented. Expected outputs are derived from other
requests made with the engine otherwise idle (helpers.wait_idle), never written down.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
import requests

from appliance.limits import Limits
from appliance.openai_api.chat import chat_job, parse_chat
from appliance.openai_api.completions import parse_completion
from appliance.openai_api.errors import ApiError
from appliance.openai_api.sampling import to_sampling_params
from appliance.openai_api.validation import OPENAI, OVMS
from appliance.params import Grammar
from tests.helpers import sse_events, wait_idle

MODEL = "m"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def params(req, generation_defaults=None):
    """The SamplingParams a parsed request means (the model's generation_config.json: none unless given)."""
    return to_sampling_params(req.sampling, generation_defaults or {})


def completion(**fields):
    return parse_completion({"model": MODEL, "prompt": "hi", **fields})


def chat(**fields):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})


def error_of(parse, **fields) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(**fields)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- mappings


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_response_format_forms(parse):
    def grammar(rf):
        return params(parse(response_format=rf)).grammar

    assert grammar({"type": "text"}) is None
    assert grammar({"type": "json_object"}) == Grammar("json_schema", '{"type":"object"}')
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    reordered = {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "type": "object"}
    one = grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert one == grammar({"type": "json_schema", "json_schema": {"schema": dict(schema)}})  # compact text
    assert one.kind == "json_schema" and json.loads(one.text) == schema
    # the client's key order is kept (the output's properties follow it): a reordered schema is another grammar
    other = grammar({"type": "json_schema", "json_schema": {"schema": reordered}})
    assert other != one and list(json.loads(other.text)["properties"]) == ["a", "b"]
    assert list(json.loads(one.text)["properties"]) == ["b", "a"]
    assert grammar({"type": "json_object", "schema": json.dumps(schema)}) == one  # Friendli: the schema as a string
    assert grammar({"type": "regex", "schema": "[0-9]+"}) == Grammar("regex", "[0-9]+")
    assert grammar({"type": "grammar", "syntax": "lark", "definition": 'start: "a"'}) == Grammar("lark", 'start: "a"')
    nested = {"type": "grammar", "grammar": {"syntax": "gbnf", "definition": 'root ::= "a"'}}
    assert grammar(nested) == Grammar("gbnf", 'root ::= "a"')
    assert to_sampling_params(parse(response_format={"type": "regex", "schema": "a"}).sampling, {}).grammar.text == "a"


def test_grammar_root_maps_onto_json_values():
    assert params(completion(grammar_root="object")).grammar == Grammar("json_schema", '{"type":"object"}')
    assert params(completion(grammar_root="value")).grammar == Grammar("json_schema", "{}")
    assert json.loads(params(completion(grammar_root="boolean")).grammar.text) == {"type": "boolean"}


def test_friendli_and_cerebras_completion_fields_map_onto_sampling_params():
    req = parse_completion(
        {
            "model": MODEL,
            "tokens": [5, 6, 7],
            "stop_tokens": [{"tokens": [9]}, {"tokens": [3, 4]}],
            "stop_token_ids": [1],
            "bad_words": ["x", "y"],
            "bad_word_tokens": [{"tokens": [8, 8]}],
            "no_repeat_ngram": 3,
            "max_total_tokens": 50,
            "min_total_tokens": 10,
            "include_output_logprobs": True,
            "min_tokens": -1,
            "seed": [4, 5],
            "n": 2,
            "return_raw_tokens": True,
        }
    )
    assert req.prompts == ((5, 6, 7),)
    p = params(req)
    assert (req.edge.seeds, p.seed, req.edge.return_raw_tokens, p.logprobs) == ((4, 5), None, True, 0)
    assert p.stop_token_ids == [1, 9] and p.stop_token_sequences == [[3, 4]]
    assert (p.bad_words, p.bad_word_tokens, p.no_repeat_ngram) == (["x", "y"], [[8, 8]], 3)
    assert (p.max_total_tokens, p.min_total_tokens, p.min_tokens_to_limit, p.min_tokens) == (50, 10, True, 0)
    assert to_sampling_params(completion(no_repeat_ngram=1).sampling, {}).no_repeat_ngram == 0  # 0 and 1: off
    assert params(completion(include_output_logprobs=True, logprobs=3)).logprobs == 3
    beams = params(completion(num_beams=4, n=2, early_stopping=True))
    assert (beams.best_of, beams.n, beams.early_stopping) == (4, 2, True)
    assert params(completion(early_stopping=False)).early_stopping is False  # false constrains nothing


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_speculation_fields_map_onto_sampling_params(parse):
    """OVMS's speculative-decoding fields and OpenAI's Predicted Outputs reach SamplingParams as sent; not sent:
    None (the model's serve settings)."""
    req = parse(
        num_assistant_tokens=0, max_ngram_size=4, prediction={"type": "content", "content": "def f():\n    pass"}
    )
    params = to_sampling_params(req.sampling, {})
    assert (params.num_assistant_tokens, params.max_ngram_size) == (0, 4)  # 0: no speculation for this request
    assert params.prediction == "def f():\n    pass" and params.assistant_confidence_threshold is None
    parts = [{"type": "text", "text": "a b"}, {"type": "text", "text": " c"}]
    params = to_sampling_params(
        parse(assistant_confidence_threshold=0.4, prediction={"type": "content", "content": parts}).sampling, {}
    )
    assert (params.assistant_confidence_threshold, params.prediction) == (0.4, "a b c")  # parts joined as they are
    params = to_sampling_params(parse(prediction=None, num_assistant_tokens=None).sampling, {})
    assert (params.num_assistant_tokens, params.assistant_confidence_threshold, params.max_ngram_size) == (None,) * 3
    assert params.prediction is None
    assert to_sampling_params(parse(prediction={"type": "content", "content": ""}).sampling, {}).prediction == ""


def test_optional_numbers_convert_to_their_type():
    """An Optional float given as an integer reaches SamplingParams as a float (assistant_confidence_threshold,
    `float | None`), an Optional int as an int, None as None: the annotations are resolved as types, not matched as
    strings (an unknown spelling once passed the value on unconverted)."""
    p = params(chat(max_tokens=5, seed=7))
    assert (p.max_tokens, p.seed) == (5, 7) and type(p.max_tokens) is int and type(p.seed) is int
    p = to_sampling_params({"assistant_confidence_threshold": 1, "max_ngram_size": 3.0, "prediction_ids": (1, 2)}, {})
    assert type(p.assistant_confidence_threshold) is float and type(p.max_ngram_size) is int
    assert p.prediction_ids == [1, 2]
    p = to_sampling_params({"assistant_confidence_threshold": None, "max_tokens": None}, {})
    assert p.assistant_confidence_threshold is None and p.max_tokens is None


def test_sampling_conversions_follow_the_annotation_not_its_spelling():
    from typing import Literal, Optional

    from appliance.openai_api.sampling import _converter

    for hint in (float | None, Optional[float], typing_union_float_none()):  # noqa: UP045 (the spelling is the point)
        assert _converter(hint)(2) == 2.0 and type(_converter(hint)(2)) is float and _converter(hint)(None) is None
    assert _converter(list[list[int]])(((1,), (2, 3))) == [[1], [2, 3]]
    assert _converter(dict[int, float])([(1, 0.5)]) == {1: 0.5}
    assert _converter(Literal["a", "b"])("a") == "a"
    with pytest.raises(TypeError, match="no conversion"):  # a new kind of field fails at import, not silently
        _converter(set[int])


def typing_union_float_none():
    from typing import Union

    return Union[float, None]  # noqa: UP007


def test_tools_map_onto_chat_request():
    req = chat(tools=[TOOL, {"type": "function", "function": {"name": "b", "extra": 1}}])
    assert (req.tool_choice, req.tool_name, req.parallel_tool_calls) == ("auto", None, True)
    assert req.tools[1] == {"type": "function", "function": {"name": "b"}}  # unknown keys dropped
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (named.tool_choice, named.tool_name) == ("named", "get_weather")
    assert chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False).parallel_tool_calls is False
    # a schema response_format with tool_choice auto / none is fine: the model may answer in text
    assert params(chat(tools=[TOOL], tool_choice="none", response_format={"type": "json_object"})).grammar is not None


def test_a_forced_call_with_a_response_format_runs_the_tools_grammar():
    """tool_choice required / named beside a response_format (an agent with an output type and a forced tool) is
    accepted: that turn is calls only, so the engine runs the tools' grammar; the format is the grammar of the turn
    that may answer in text (tool_choice auto or none)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "Out", "schema": schema}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        req = chat(tools=[TOOL], tool_choice=choice, response_format=fmt)
        grammar = chat_job(req, params(req), "r").params.grammar
        assert grammar is not None and grammar.kind == "lark" and grammar.param == "tools", grammar
        assert 'get_weather' in grammar.text and '"answer"' not in grammar.text
    for choice in ("auto", "none"):
        req = chat(tools=[TOOL], tool_choice=choice, response_format=fmt)
        grammar = chat_job(req, params(req), "r").params.grammar
        assert grammar is not None and grammar.kind == "json_schema" and '"answer"' in grammar.text


@pytest.mark.parametrize("stop", [None, "x"])
def test_stop_string_defaults_are_the_dialects(stop):
    """OVMS (/v3): a stream includes the stop string unless told not to; OpenAI (/v1): never unless asked. Unary
    answers leave it out on both; an explicit include_stop_str_in_output wins on both."""
    bodies = (
        (parse_completion, {"model": MODEL, "prompt": "hi", "stop": stop}),
        (parse_chat, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": stop}),
    )
    for parse, body in bodies:

        def included(dialect, parse=parse, body=body, **fields):
            return parse({**body, **fields}, Limits(), dialect).sampling["include_stop_str_in_output"]

        assert included(OVMS, stream=True) is True and included(OPENAI, stream=True) is False
        assert included(OVMS) is included(OPENAI) is False
        assert included(OPENAI, stream=True, include_stop_str_in_output=True) is True
        assert included(OVMS, stream=True, include_stop_str_in_output=False) is False


# ---------------------------------------------------------------- every new 400

ERRORS = [
    (completion, {"response_format": {"type": "xml"}}, "response_format", "is not one of"),
    (completion, {"response_format": "json"}, "response_format", "must be an object"),
    (completion, {"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
    (chat, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    (chat, {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format", "schema"),
    (chat, {"response_format": {"type": "json_object", "schema": "{"}}, "response_format", "not valid JSON"),
    (chat, {"response_format": {"type": "json_object", "schema": "[]"}}, "response_format", "an object"),
    (completion, {"response_format": {"type": "regex"}}, "response_format", "schema must be a non-empty"),
    (completion, {"response_format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}, "response_format", ""),
    (completion, {"response_format": {"type": "grammar", "syntax": "lark"}}, "response_format", "definition"),
    (completion, {"grammar_root": "funcall"}, "grammar_root", "tool-call grammar"),
    (completion, {"grammar_root": "tool_args"}, "grammar_root", "tool-call grammar"),
    (completion, {"grammar_root": "pizza"}, "grammar_root", "must be one of"),
    (completion, {"grammar_root": "object", "response_format": {"type": "json_object"}}, "grammar_root", ""),
    (completion, {"best_of": 2, "response_format": {"type": "json_object"}}, "response_format", "beam search"),
    (completion, {"num_beams": 2, "grammar_root": "object"}, "grammar_root", "beam search"),
    (completion, {"tokens": [1, 2]}, "tokens", "both"),  # prompt "hi" too
    (parse_completion, {"body": {"model": MODEL, "tokens": []}}, "tokens", "non-empty"),
    (parse_completion, {"body": {"model": MODEL, "tokens": [[1]]}}, "tokens", "non-empty"),
    (completion, {"num_beams": 2, "best_of": 2}, "num_beams", "both"),
    (completion, {"num_beams": 2, "n": 3}, "n", "num_beams"),
    (completion, {"num_beams": 0}, "num_beams", "greater than 0"),
    (completion, {"num_beams": 21}, "num_beams", "exceeds limit"),
    (completion, {"num_beams": 2, "stream": True}, "num_beams", "streaming"),
    (completion, {"early_stopping": True}, "early_stopping", "beam search"),
    (completion, {"early_stopping": "yes"}, "early_stopping", ""),
    (completion, {"stop_tokens": [1]}, "stop_tokens", "entries"),
    (completion, {"stop_tokens": [{"tokens": []}]}, "stop_tokens", "at least one id"),
    (completion, {"stop_tokens": [{"tokens": [1]}] * 65}, "stop_tokens", "no more than 64"),
    (completion, {"stop_tokens": [{"tokens": [1] * 33}]}, "stop_tokens", "no more than 32"),
    (completion, {"bad_words": "x"}, "bad_words", "array"),
    (completion, {"bad_words": [""]}, "bad_words", "non-empty"),
    (completion, {"bad_words": ["x" * 257]}, "bad_words", "256 characters"),
    (
        completion,
        {"bad_words": [f"w{i}" for i in range(200)], "bad_word_tokens": [{"tokens": [i]} for i in range(57)]},
        "bad_words",
        "together",
    ),
    (completion, {"bad_word_tokens": [{"tokens": [-1]}]}, "bad_word_tokens", ""),
    (completion, {"no_repeat_ngram": -1}, "no_repeat_ngram", ""),
    (completion, {"max_total_tokens": 0}, "max_total_tokens", "positive"),
    (completion, {"max_total_tokens": 10, "max_tokens": 5}, "max_total_tokens", "both"),
    (completion, {"max_total_tokens": 10, "min_total_tokens": 11}, "min_total_tokens", "greater"),
    (completion, {"seed": [1, 2]}, "seed", "n is 1"),
    (completion, {"seed": [1, -2], "n": 2}, "seed", "per choice"),
    (completion, {"seed": []}, "seed", "per choice"),
    (chat, {"seed": [1]}, "seed", "not an integer"),  # chat: one seed (n choices get seed + j)
    (completion, {"include_output_logprobs": 1}, "include_output_logprobs", ""),
    (completion, {"return_raw_tokens": "yes"}, "return_raw_tokens", ""),
    (completion, {"min_tokens": -2}, "min_tokens", ""),
    (chat, {"tools": {"a": 1}}, "tools", "not an array"),
    (chat, {"tools": [{"type": "function"}]}, "tools", ""),
    (chat, {"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools", ""),
    (chat, {"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "must match"),
    (chat, {"tools": [TOOL, TOOL]}, "tools", "unique"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", "parameters"),
    (chat, {"tools": [TOOL] * 129}, "tools", "no more than 128"),
    (chat, {"tool_choice": "auto"}, "tool_choice", "only allowed when tools"),
    (chat, {"tool_choice": "required", "tools": []}, "tool_choice", "only allowed when tools"),
    (chat, {"tool_choice": "always", "tools": [TOOL]}, "tool_choice", "must be"),
    (chat, {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [TOOL]}, "tool_choice", ""),
    (chat, {"parallel_tool_calls": "no"}, "parallel_tool_calls", ""),
]


@pytest.mark.parametrize("parse,fields,param,text", ERRORS, ids=[f"{p}-{t}" for _, _, p, t in ERRORS])
def test_new_parameters_refused_with_400(parse, fields, param, text):
    if "body" in fields:
        with pytest.raises(ApiError) as info:
            parse(fields["body"])
        err = info.value
    else:
        err = error_of(parse, **fields)
    assert err.param == param and text in err.message, err.message


def test_grammar_size_is_bounded():
    limits = Limits(grammar_chars=10)
    body = {"model": MODEL, "prompt": "hi", "response_format": {"type": "regex", "schema": "a" * 11}}
    with pytest.raises(ApiError) as info:
        parse_completion(body, limits)
    assert info.value.param == "response_format" and "10 characters" in info.value.message
    body["response_format"]["schema"] = "a" * 10
    assert params(parse_completion(body, limits)).grammar == Grammar("regex", "a" * 10)


# ---------------------------------------------------------------- end to end: the real server and the openai SDK

PROMPT = "The capital of France is"


@pytest.fixture(autouse=True)
def alone(request) -> None:
    if "server" in request.fixturenames or "client" in request.fixturenames:
        wait_idle(request.getfixturevalue("server"))


def complete(client, model_name, **kw):
    extra = {k: kw.pop(k) for k in list(kw) if k not in OPENAI_FIELDS}
    return client.completions.create(
        model=model_name, **{"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}, extra_body=extra or None
    )


OPENAI_FIELDS = {"prompt", "max_tokens", "temperature", "n", "seed", "logprobs", "stream", "best_of", "stop", "echo"}


def tokenize(server, model_name, text: str) -> list[int]:
    r = requests.post(server.base + "/v3/tokenize", json={"model": model_name, "prompt": text}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def test_tokens_is_the_prompt_as_ids(client, server, model_name):
    ids = tokenize(server, model_name, PROMPT)
    by_text = complete(client, model_name)
    by_ids = complete(client, model_name, prompt=None, tokens=ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)


def test_seed_list_gives_each_choice_its_seed(client, model_name):
    sampled = {"temperature": 1.0, "max_tokens": 8, "n": 2}
    derived = complete(client, model_name, seed=7, **sampled)  # choice j: seed 7 + j
    listed = client.completions.create(model=model_name, prompt=PROMPT, extra_body={"seed": [7, 8]}, **sampled)
    swapped = client.completions.create(model=model_name, prompt=PROMPT, extra_body={"seed": [8, 7]}, **sampled)
    texts = [c.text for c in listed.choices]
    assert texts == [c.text for c in derived.choices]
    assert [c.text for c in swapped.choices] == texts[::-1]


def test_bad_words_removes_a_word(client, model_name):
    plain = complete(client, model_name, max_tokens=12).choices[0].text
    word = max(re.findall(r"[A-Za-z]{3,}", plain), key=len)
    banned = complete(client, model_name, max_tokens=12, bad_words=[word]).choices[0].text
    assert word not in banned and banned != plain, (word, plain, banned)


def test_bad_words_on_chat(client, model_name):
    """vLLM's chat completions take bad_words too: the same ban as on completions."""

    def answer(**extra) -> str:
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        reply = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=12, temperature=0, extra_body=extra or None
        )
        return reply.choices[0].message.content

    plain = answer()
    word = max(re.findall(r"[A-Za-z]{3,}", plain), key=len)
    banned = answer(bad_words=[word])
    assert word not in banned and banned != plain, (word, plain, banned)
    assert params(chat(bad_words=[word])).bad_words == [word]


def _repeats(ids: list[int], start: int, size: int) -> bool:
    """An n-gram ending at a generated position (>= start) occurs earlier in ids."""
    seen = {tuple(ids[i : i + size]) for i in range(start - size + 1)}
    for end in range(start, len(ids)):
        gram = tuple(ids[end - size + 1 : end + 1])
        if gram in seen:
            return True
        seen.add(gram)
    return False


def test_no_repeat_ngram(client, server, model_name):
    prompt = "one two three, one two three, one two three, one two three,"
    ids = tokenize(server, model_name, prompt)
    plain = complete(client, model_name, prompt=prompt, max_tokens=12, return_raw_tokens=True)
    assert _repeats(ids + plain.choices[0].model_extra["tokens"], len(ids), 3)  # the model does repeat itself
    banned = complete(client, model_name, prompt=prompt, max_tokens=12, return_raw_tokens=True, no_repeat_ngram=3)
    assert not _repeats(ids + banned.choices[0].model_extra["tokens"], len(ids), 3)


def test_max_total_tokens_bounds_prompt_and_completion(client, model_name):
    prompt_tokens = complete(client, model_name, max_tokens=1).usage.prompt_tokens
    r = complete(client, model_name, max_tokens=None, max_total_tokens=prompt_tokens + 3, ignore_eos=True)
    assert r.usage.total_tokens == prompt_tokens + 3 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        complete(client, model_name, max_tokens=None, max_total_tokens=prompt_tokens)


def test_min_tokens_minus_one_reaches_max_tokens(client, model_name):
    r = complete(client, model_name, prompt="Say OK.", max_tokens=24, min_tokens=-1)
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"


def test_return_raw_tokens_decode_to_the_text(client, model_dir, model_name):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    r = complete(client, model_name, max_tokens=10, return_raw_tokens=True)
    ids = r.choices[0].model_extra["tokens"]
    assert len(ids) == r.usage.completion_tokens and tok.decode(ids) == r.choices[0].text
    stream = complete(client, model_name, max_tokens=10, return_raw_tokens=True, stream=True)
    streamed = [i for chunk in stream for c in chunk.choices for i in c.model_extra["tokens"]]
    assert tok.decode(streamed) == r.choices[0].text


def test_include_output_logprobs(client, model_name):
    r = complete(client, model_name, include_output_logprobs=True)
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
    assert complete(client, model_name).choices[0].logprobs is None


def test_stop_tokens_stop(client, model_name):
    plain = complete(client, model_name, max_tokens=10, return_raw_tokens=True, ignore_eos=True)
    ids = plain.choices[0].model_extra["tokens"]
    first = min(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # stops at its first occurrence
    one = complete(client, model_name, max_tokens=10, stop_tokens=[{"tokens": [ids[first]]}], ignore_eos=True)
    assert one.choices[0].finish_reason == "stop" and one.usage.completion_tokens == first + 1
    pair = complete(client, model_name, max_tokens=10, stop_tokens=[{"tokens": ids[first : first + 2]}])
    assert pair.choices[0].finish_reason == "stop" and pair.usage.completion_tokens <= first + 2


def test_num_beams_is_best_of(client, model_name):
    a = complete(client, model_name, best_of=3, n=2)
    b = complete(client, model_name, n=2, num_beams=3)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    early = complete(client, model_name, n=2, num_beams=3, early_stopping=True)
    assert [c.index for c in early.choices] == [0, 1], early.choices
    assert all(c.finish_reason in ("stop", "length") and c.text for c in early.choices), early.choices
    assert early.usage.completion_tokens >= 2, early.usage


def test_regex_response_format_on_completions(client, model_name):
    pattern = r"[0-9]{3}-[0-9]{4}"
    r = complete(
        client, model_name, prompt="Call me at", max_tokens=16, response_format={"type": "regex", "schema": pattern}
    )
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text


def test_grammar_root_object_parses(client, model_name):
    r = complete(client, model_name, prompt="A cat as JSON:", max_tokens=64, grammar_root="object")
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_stream_chunks_are_text_completion_objects(client, model_name):
    chunks = list(complete(client, model_name, stream=True, stream_options={"include_usage": True}))
    assert chunks and all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_cached_tokens_on_a_repeated_prompt(client, model_name):
    prompt = " ".join(f"word{i}" for i in range(200))
    first = complete(client, model_name, prompt=prompt, max_tokens=1)
    again = complete(client, model_name, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens > 100
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chat_usage = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": prompt}], max_tokens=1
    )
    chat_again = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": prompt}], max_tokens=1
    )
    assert chat_usage.usage.prompt_tokens_details is not None
    assert chat_again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "tokens": [1]}, "tokens"),
        ({"prompt": "hi", "grammar_root": "funcall"}, "grammar_root"),
        ({"prompt": "hi", "max_tokens": 4, "max_total_tokens": 9}, "max_total_tokens"),
        ({"prompt": "hi", "response_format": {"type": "regex", "schema": "(["}}, "response_format"),  # engine-side
    ],
)
def test_400s_through_the_server(server, model_name, body, param):
    r = requests.post(server.base + "/v3/completions", json={"model": model_name, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tool_choice_without_tools_is_400_over_http(server, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}
    r = requests.post(server.base + "/v3/chat/completions", json=body, timeout=60)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "tool_choice")
    stream = requests.post(
        server.base + "/v3/completions",
        json={"model": model_name, "prompt": "hi", "max_tokens": 2, "stream": True},
        stream=True,
        timeout=60,
    )
    events = sse_events(stream)
    assert all(e["object"] == "text_completion" for e in events[:-1])
