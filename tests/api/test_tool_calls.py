"""Tool calls and reasoning without a server: the output parsers (each format, unary vs every streaming split),
the grammar that forces calls (compiled by llguidance against the default model's tokenizer), the chat shape's
messages and deltas, and tool_prompt's parser choice and prompt rendering."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from appliance.limits import Limits
from appliance.openai_api import tool_calls
from appliance.openai_api.chat import ChatRequest, ChatShape, chat_job
from appliance.openai_api.errors import ApiError
from appliance.openai_api.parsers import inline_one_of_refs, response_format
from appliance.openai_api.reasoning import ReasoningParser, split_reasoning
from appliance.openai_api.streaming import Choice
from appliance.openai_api.tool_calls import FORMATS, ToolCall, ToolCallParser, parse_tool_calls, tool_grammar
from appliance.openai_api.validation import EdgeOptions
from appliance.params import Grammar, SamplingParams
from appliance.runtime.grammar import JSON_OPTIONS
from appliance.server import tool_prompt

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

F = ToolCall("f", '{"a": 1}')
G = ToolCall("g", "{}")
CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n', "Sure.", [F]),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g"}</tool_call>',
        "",
        [F, G],
    ),
    ("hermes", 'A <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> B', "AB", [F]),
    (
        "hermes",
        'x <tool_call>{"name": "f", "arguments": {bad}}</tool_call> y',
        'x <tool_call>{"name": "f", "arguments": {bad}}</tool_call> y',
        [],
    ),
    ("hermes", "plain text, no call <tool", "plain text, no call <tool", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "", [F]),  # ended without its close tag
    ("hermes", '<tool_call>\n{"name": "f", "argum', '<tool_call>\n{"name": "f", "argum', []),  # cut mid-call
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [F]),  # arguments as text
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "", [F, G]),
    ("llama3_json", ' {"name": "f", "parameters": {"a": 1}}', "", [F]),
    ("llama3_json", '{"a": 1} is JSON, not a call', '{"a": 1} is JSON, not a call', []),
    ("llama3_json", 'Hello {"name": "f", "parameters": {"a": 1}}', 'Hello {"name": "f", "parameters": {"a": 1}}', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1', '{"name": "f", "parameters": {"a": 1', []),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', "ok", [F, G]),
    ("mistral", '[{"name": "f", "arguments": {"a": 1}}]', "", [F]),  # the marker dropped as a special token
    ("mistral", "[1] is a list", "[1] is a list", []),
]


def stream(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return "".join(v for k, v in events if k == "content"), [v for k, v in events if k == "call"]  # type: ignore[misc]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parser_unary_and_every_streaming_split(fmt, text, content, calls):
    assert parse_tool_calls(text, fmt) == (content, calls)
    for i in range(len(text) + 1):
        assert stream(ToolCallParser(fmt), [text[:i], text[i:]]) == (content, calls), i
    assert stream(ToolCallParser(fmt), list(text)) == (content, calls)  # one character at a time


def test_marker_start_is_held_back_and_released():
    p = ToolCallParser("hermes")
    assert p.feed("Hello <tool") == [("content", "Hello")]  # neither "<tool" nor the space before it yet
    assert p.feed(" box") == [("content", " <tool box")]
    assert p.finish() == []
    q = ToolCallParser("hermes")
    q.feed("Hi <tool_call>{")
    assert q.feed('"name": "f"}') == [] and q.finish() == [("call", ToolCall("f", "{}"))]


# ---------------------------------------------------------------- grammar


@pytest.fixture(scope="module")
def lark_matcher(model_dir):
    import llguidance  # pinned: the grammar backend itself

    tok = llguidance.LLTokenizer(str(model_dir / "tokenizer.json"))

    def accepts(grammar: str | Grammar, text: str) -> bool:
        """Whether the grammar (Lark text, or a Grammar compiled as the engine compiles it) accepts text whole."""
        if isinstance(grammar, str):
            grammar = Grammar("lark", grammar)
        if grammar.kind == "json_schema":  # as runtime/grammar.py compiles a response_format's schema
            source = llguidance.LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_OPTIONS)
        else:
            source = llguidance.LLMatcher.grammar_from_lark(grammar.text)
        m = llguidance.LLMatcher(tok, source)
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting() and not m.is_error()

    return accepts


CALL_TEXT = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}
SECOND = {
    "hermes": '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": '; {"name": "get_time", "parameters": {}}',
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_compiles_and_accepts_calls_of_the_tools(lark_matcher, fmt):
    tools = [WEATHER, TIME]
    one = tool_grammar(tools, fmt, parallel=False)
    assert lark_matcher(one, CALL_TEXT[fmt])
    assert not lark_matcher(one, CALL_TEXT[fmt].replace('"Paris"', "3"))  # city must be a string
    assert not lark_matcher(one, CALL_TEXT[fmt].replace("get_weather", "get_wether"))
    named = tool_grammar(tools, fmt, parallel=True, name="get_time")
    assert not lark_matcher(named, CALL_TEXT[fmt])
    many = tool_grammar(tools, fmt, parallel=True)
    if fmt in SECOND:
        assert lark_matcher(many, CALL_TEXT[fmt] + SECOND[fmt]) and not lark_matcher(one, CALL_TEXT[fmt] + SECOND[fmt])
    else:
        two = CALL_TEXT[fmt][:-1] + ', {"name": "get_time", "arguments": {}}]'
        assert lark_matcher(many, two) and not lark_matcher(one, two)
    content, calls = parse_tool_calls(CALL_TEXT[fmt], fmt)
    assert content == "" and calls == [ToolCall("get_weather", '{"city": "Paris"}')]


# Parameters schemas as client libraries send them: Pydantic's nested models ($defs / $ref, Optional as anyOf with
# null), a recursive model ("$ref": "#"), enum, const, format and pattern; each with arguments it must accept and
# arguments it must refuse
ADDRESS = {
    "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
    "required": ["street", "city"],
    "type": "object",
    "additionalProperties": False,
}
BOOKING = {
    "$defs": {"Address": ADDRESS},
    "properties": {
        "restaurant": {"type": "string"},
        "guest": {"$ref": "#/$defs/Address"},
        "billing": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None},
    },
    "required": ["restaurant", "guest"],
    "type": "object",
    "additionalProperties": False,
}
TREE = {  # a recursive model: its refs point at the parameters' root
    "type": "object",
    "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["v"],
}
KEYWORDS = {
    "type": "object",
    "properties": {
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "kind": {"const": "booking"},
        "day": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
    },
    "required": ["note", "unit", "kind", "day", "code"],
}
KW_OK = '{"note": null, "unit": "celsius", "kind": "booking", "day": "2026-11-26", "code": "CDG"}'
ADOPTION = {  # a discriminated union as pydantic-ai sends it: oneOf of two $refs, the discriminator stripped
    "type": "object",
    "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
    "required": ["pet"],
    "$defs": {
        "Cat": {
            "type": "object",
            "properties": {"kind": {"const": "cat", "type": "string"}, "lives": {"type": "integer"}},
            "required": ["kind", "lives"],
        },
        "Dog": {
            "type": "object",
            "properties": {"kind": {"const": "dog", "type": "string"}, "good": {"type": "boolean"}},
            "required": ["kind", "good"],
        },
    },
}
SCHEMA_CASES = [
    (
        BOOKING,
        [
            '{"restaurant": "Chez Paul", "guest": {"street": "1 rue de Rivoli", "city": "Paris"}}',
            '{"restaurant": "A", "guest": {"street": "s", "city": "c"}, "billing": null}',
            '{"restaurant": "A", "guest": {"street": "s", "city": "c"}, "billing": {"street": "t", "city": "d"}}',
        ],
        [
            '{"restaurant": "A", "guest": {"street": "s"}}',
            '{"restaurant": "A", "guest": "Paris"}',
            '{"restaurant": "A", "guest": {"street": "s", "city": "c"}, "billing": {"city": "d"}}',
        ],
    ),
    (
        TREE,
        ['{"v": 1}', '{"v": 1, "kids": [{"v": 2, "kids": [{"v": 4}]}, {"v": 3}]}'],
        ['{"v": 1, "kids": [{"w": 2}]}', '{"v": 1, "kids": [{"v": "2"}]}'],
    ),
    (
        KEYWORDS,
        [KW_OK, KW_OK.replace("null", '"hi"').replace("celsius", "fahrenheit")],
        [
            KW_OK.replace("null", "3"),
            KW_OK.replace("celsius", "kelvin"),
            KW_OK.replace('"booking"', '"order"'),
            KW_OK.replace("2026-11-26", "tomorrow"),
            KW_OK.replace("CDG", "cdg"),
        ],
    ),
    (
        ADOPTION,
        ['{"pet": {"kind": "cat", "lives": 3}}', '{"pet": {"kind": "dog", "good": true}}'],
        ['{"pet": {"kind": "cat", "good": true}}', '{"pet": {"kind": "bird", "lives": 1}}', '{"pet": {}}'],
    ),
]
WRAP = {
    "hermes": '<tool_call>\n{{"name": "f", "arguments": {}}}\n</tool_call>',
    "llama3_json": '{{"name": "f", "parameters": {}}}',
    "mistral": '[{{"name": "f", "arguments": {}}}]',
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("schema,good,bad", SCHEMA_CASES)
def test_tool_arguments_are_constrained_as_the_same_response_format_is(lark_matcher, fmt, schema, good, bad):
    """A call's arguments follow its tool's parameters exactly as a response_format of that schema would: the
    parameters are a JSON document of their own in the grammar, so their `$ref`s resolve where the client wrote
    them (a tool's grammar once nested them under a wrapper, where "#/$defs/Address" pointed nowhere)."""
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}
    grammar = tool_grammar([tool, TIME], fmt, parallel=True)
    assert (grammar.kind, grammar.param, grammar.parts[0]) == ("lark", "tools", "the parameters of function 'f'")
    # the same schema as a response_format (closed as a tool's parameters are), through the request's parser
    closed = tool_calls.closed_objects(schema)
    as_format = response_format({"type": "json_schema", "json_schema": {"name": "f", "schema": closed}}, Limits(), {})
    for args in good + bad:
        expected = args in good
        assert lark_matcher(as_format, args) is expected, args
        assert lark_matcher(grammar, WRAP[fmt].format(args)) is expected, (fmt, args)
        if expected:
            content, calls = parse_tool_calls(WRAP[fmt].format(args), fmt)
            assert (content, calls) == ("", [ToolCall("f", json.dumps(json.loads(args)))])


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}, "Pointer '/$defs/Nope' does not exist"),
        ({"type": "object", "properties": {"a": {"type": "string", "format": "bogus"}}}, "Unknown format: bogus"),
        (  # branches that may both match: refused, not approximated (inlining a $ref changes no meaning)
            {
                "type": "object",
                "properties": {"a": {"oneOf": [{"type": "string"}, {"$ref": "#/$defs/S"}]}},
                "$defs": {"S": {"type": "string", "maxLength": 3}},
            },
            "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf with anyOf",
        ),
    ],
)
def test_a_tool_schema_that_does_not_compile_names_its_tool(model_dir, schema, message):
    """The 400 names the tool whose parameters are at fault and the `tools` field, never the Lark grammar the
    client did not write; the tool's position among the others does not matter."""
    from appliance.manifest import Manifest
    from appliance.runtime.grammar import GrammarCompiler, GrammarError

    m = Manifest.load(model_dir)
    compiler = GrammarCompiler(model_dir / m.tokenizer_file, m.vocab_size, [2])
    bad = {"type": "function", "function": {"name": "bad_one", "parameters": schema}}
    for tools in ([bad], [WEATHER, bad, TIME], [TIME, WEATHER, bad]):
        grammar = tool_grammar(tools, "hermes", parallel=True)
        with pytest.raises(GrammarError) as err:
            compiler.check(grammar)
        assert str(err.value) == f"invalid JSON schema in the parameters of function 'bad_one': {message}"
        assert grammar.param == "tools"
    compiler.check(tool_grammar([WEATHER, bad], "hermes", parallel=True, name="get_weather"))  # not chosen: fine


def test_one_of_refs_are_inlined_within_the_grammar_bound():
    """A oneOf branch that is a bare local $ref becomes the subschema it names, unless that would take the schema
    past what is left of grammar_chars (then it stays a ref: the bound the client's schema met still holds, for a
    response_format and for the tools of one request together); other refs and data stay as they are."""
    inlined = inline_one_of_refs(ADOPTION, 10_000)
    assert inlined["properties"]["pet"]["oneOf"] == [ADOPTION["$defs"]["Cat"], ADOPTION["$defs"]["Dog"]]
    assert inlined["$defs"] == ADOPTION["$defs"] and ADOPTION["properties"]["pet"]["oneOf"][0] == {
        "$ref": "#/$defs/Cat"
    }
    cat = len(json.dumps(ADOPTION["$defs"]["Cat"], separators=(",", ":"))) - len('{"$ref":"#/$defs/Cat"}')
    assert inline_one_of_refs(ADOPTION, cat)["properties"]["pet"]["oneOf"][1] == {"$ref": "#/$defs/Dog"}
    assert inline_one_of_refs(ADOPTION, 0) == ADOPTION
    data = {"const": {"oneOf": [{"$ref": "#/x"}]}, "x": {"type": "null"}, "oneOf": [{"$ref": "#/nowhere"}]}
    assert inline_one_of_refs(data, 10_000) == data
    size = len(json.dumps(ADOPTION, separators=(",", ":")))
    for limit in (size, size + cat):  # the client's schema fits, its inlined copy does not (or only half of it)
        grammar = response_format(
            {"type": "json_schema", "json_schema": {"name": "a", "schema": ADOPTION}}, Limits(grammar_chars=limit), {}
        )
        assert len(grammar.text) <= limit
    tool = {"type": "function", "function": {"name": "f", "parameters": ADOPTION}}
    closed_cat = tool_calls.closed_objects(ADOPTION)["$defs"]["Cat"]  # a tool's objects are closed first
    one = len(json.dumps(closed_cat, separators=(",", ":"))) - len('{"$ref":"#/$defs/Cat"}')
    for tools in ([tool], [tool, tool]):  # room for one branch: one is inlined, in all the tools together
        grammar = tool_grammar(tools, "hermes", parallel=True, max_chars=size * len(tools) + one)
        assert grammar.text.count('"$ref":"#/$defs/') == 2 * len(tools) - 1


# ---------------------------------------------------------------- chat job and shape


def chat_request(**kw) -> ChatRequest:
    edge = EdgeOptions(model="m", **kw.pop("edge", {}))
    return ChatRequest(edge, {}, ({"role": "user", "content": "Weather in Paris?"},), **kw)


def test_chat_job_tool_choice():
    params = SamplingParams(max_tokens=20)
    none = chat_job(chat_request(tools=(WEATHER,), tool_choice="none"), params, "r", "hermes")
    assert none.prompts[0].tools is None and none.params.grammar is None
    auto = chat_job(chat_request(tools=(WEATHER,)), params, "r", "hermes")
    assert auto.prompts[0].tools == [WEATHER] and auto.params.grammar is None
    named = chat_job(chat_request(tools=(WEATHER, TIME), tool_choice="named", tool_name="get_time"), params, "r")
    assert named.params.grammar is not None and named.params.grammar.kind == "lark"
    assert "get_time" in named.params.grammar.text and "get_weather" not in named.params.grammar.text
    assert params.grammar is None  # the caller's params are left alone
    with pytest.raises(ApiError) as err:
        chat_job(chat_request(tools=(WEATHER,), tool_choice="named", tool_name="nope"), params, "r")
    assert err.value.status == 400


def finished(text: str, index: int = 0) -> Choice:
    return Choice(index, parts=[text], finish_reason="stop")


def test_unary_message_with_calls_and_reasoning():
    shape = ChatShape.for_request(chat_request(tools=(WEATHER,)), "hermes", "think")
    text = (
        '<think>Paris, so call it.</think>\n\nOK <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call>"
    )
    out = shape.choice(finished(text), logprobs=False)
    m = out["message"]
    assert out["finish_reason"] == "tool_calls" and m["content"] == "OK"
    assert m["reasoning_content"] == m["reasoning"] == "Paris, so call it."
    [call] = m["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    plain = ChatShape.for_request(chat_request(tools=(WEATHER,), tool_choice="none"), "hermes", "none")
    assert plain.choice(finished(text), logprobs=False)["message"] == {"role": "assistant", "content": text}


def stream_deltas(shape: ChatShape, text: str, cut: int) -> list[dict]:
    c = Choice(0)
    pieces = [text[:cut], text[cut:]]
    out = []
    for i, piece in enumerate(pieces):
        out += shape.delta(c, piece, None, "stop" if i == len(pieces) - 1 else None)
    return out


def test_streamed_deltas_add_up_to_the_unary_message():
    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    unary = ChatShape.for_request(chat_request(tools=(WEATHER, TIME)), "hermes", "none").choice(finished(text), False)
    for cut in range(len(text) + 1):
        deltas = stream_deltas(ChatShape.for_request(chat_request(tools=(WEATHER, TIME)), "hermes", "none"), text, cut)
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        calls: dict[int, dict] = {}
        for d in deltas:
            for tc in d["delta"].get("tool_calls", []):
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                if "id" in tc:
                    assert tc["type"] == "function" and tc["function"]["arguments"] == "" and not call["name"]
                    call["name"] = tc["function"]["name"]
                call["arguments"] += tc["function"].get("arguments", "")
        assert content == unary["message"]["content"]
        assert [calls[k] for k in sorted(calls)] == [t["function"] for t in unary["message"]["tool_calls"]]
        assert all(json.loads(c["arguments"]) is not None for c in calls.values())
        assert [d["finish_reason"] for d in deltas][-1] == "tool_calls"
        assert all(d["finish_reason"] is None for d in deltas[:-1])


# ---------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    "text,thought,answer",
    [
        ("<think>a < b </thi</think>\n\nThe answer.", "a < b </thi", "The answer."),
        ("  <think>cut mid-thou", "cut mid-thou", ""),  # max_tokens inside the thought: no content
        ("No thought <think>x</think>", None, "No thought <think>x</think>"),
        ("<thin", None, "<thin"),
        ("", None, ""),
    ],
)
def test_reasoning_split_unary_and_streamed(text, thought, answer):
    assert split_reasoning(text) == (thought, answer)
    for i in range(len(text) + 1):
        p = ReasoningParser()
        parts = [p.feed(text[:i]), p.feed(text[i:]), p.finish()]
        assert "".join(r for r, _ in parts) == (thought or "") and "".join(c for _, c in parts) == answer, i
        if thought is not None:
            assert "<think>" not in "".join(c for _, c in parts)


def test_reasoning_cut_mid_thought_streams_no_content():
    shape = ChatShape.for_request(chat_request(), "hermes", "think")
    c = Choice(0)
    deltas = shape.delta(c, "<think>Let me", None, None) + shape.delta(c, " see </th", None, "length")
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "Let me see </th"
    assert not any(d["delta"].get("content") for d in deltas) and deltas[-1]["finish_reason"] == "length"
    message = shape.choice(Choice(0, parts=["<think>Let me see </th"], finish_reason="length"), False)["message"]
    assert message["content"] is None and message["reasoning"] == "Let me see </th"


# ---------------------------------------------------------------- tool_prompt (engine side)


@pytest.mark.parametrize(
    "snippet,tools,reasoning",
    [
        ("{{ '<|im_start|>' + message['role'] }}", "hermes", "none"),
        ("{%- if tools %}<tool_call>\n{{ tool_call | tojson }}</tool_call>{% endif %}<think>", "hermes", "think"),
        ('{{- "<|python_tag|>" + tool_call.name }}', "llama3_json", "none"),
        ("{{- '[TOOL_CALLS][' }}", "mistral", "none"),
        ({"default": "plain", "tool_use": "{{ '[TOOL_CALLS]' }}"}, "mistral", "none"),
    ],
)
def test_parser_choice_from_the_template(snippet, tools, reasoning):
    assert tool_prompt.choose_tool_parser(snippet) == tools
    assert tool_prompt.choose_reasoning_parser(snippet) == reasoning
    assert tool_prompt.choose_tool_parser(snippet, "llama3_json") == "llama3_json"
    assert tool_prompt.choose_reasoning_parser(snippet, "none") == "none"
    with pytest.raises(ValueError):
        tool_prompt.choose_tool_parser(snippet, "qwen")


ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_fallback_prompt_for_a_template_without_tools(model_dir):
    from appliance.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    assert not tool_prompt.uses_tools(tok.chat_template)
    messages, kwargs = tool_prompt.chat_inputs(ROUND_TRIP, [WEATHER], tok.chat_template, "hermes")
    assert kwargs == {}
    text = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    assert '"name": "get_weather"' in text and "<tool_call>" in text  # the tools, and how to call them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in text
    assert tok.encode_chat(messages, add_generation_prompt=True)  # it tokenizes


def test_native_template_gets_tools_and_argument_objects():
    template = (
        "{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments.city }}{% endfor %}{% endfor %}"
    )
    assert tool_prompt.uses_tools(template)
    messages, kwargs = tool_prompt.chat_inputs(ROUND_TRIP, [WEATHER], template, "hermes")
    assert kwargs == {"tools": [WEATHER]} and messages[2] == ROUND_TRIP[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert ROUND_TRIP[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not mutated


def test_engine_status_names_the_parsers():
    """EngineService resolves `auto` from the attached model's template once; the flags override it."""
    from types import SimpleNamespace

    from appliance.server.engine_service import EngineService
    from appliance.server.metrics import ServerMetrics
    from appliance.settings import ServeSettings

    engine = SimpleNamespace(tokenizer=SimpleNamespace(chat_template="{% if tools %}[TOOL_CALLS]{% endif %}<think>"))
    settings = ServeSettings(model_dir="m", served_model_name="m", model_created=0)
    auto = EngineService(settings, ServerMetrics())
    auto.attach(engine, "CPU")  # type: ignore[arg-type]
    assert auto.parsers() == ("mistral", "think")
    forced = EngineService(replace(settings, tool_parser="hermes", reasoning_parser="none"), ServerMetrics())
    forced.attach(engine, "CPU")  # type: ignore[arg-type]
    assert forced.parsers() == ("hermes", "none")


def test_closed_objects_closes_open_objects_only():
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "free": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"P": {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}}, {"type": "null"}]}},
    }
    out = tool_calls.closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["where"]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["properties"]["free"]["additionalProperties"] is True  # the client's own choice stays
    assert out["$defs"]["P"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's schema is not changed in place


def _cut_message(fmt: str, text: str, pieces: list[str] | None = None) -> tuple[dict, str]:
    """(message, finish_reason) for `text` cut by max_tokens under tool_choice required: unary, or streamed in
    `pieces` (the deltas folded back into a message as a client does)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = ChatRequest(
        EdgeOptions(model="m"), {}, ({"role": "user", "content": "x"},), tools=(tool,), tool_choice="required"
    )
    shape = ChatShape.for_request(req, fmt, "none")
    if pieces is None:
        choice = shape.choice(Choice(0, parts=[text], finish_reason="length"), False)
        return choice["message"], choice["finish_reason"]
    c, message, finish = Choice(0), {"content": None}, None
    for i, piece in enumerate(pieces):
        for chunk in shape.delta(c, piece, None, "length" if i == len(pieces) - 1 else None):
            finish = chunk["finish_reason"] or finish
            delta = chunk["delta"]
            if delta.get("content"):
                message["content"] = (message["content"] or "") + delta["content"]
            for tc in delta.get("tool_calls", []):
                calls = message.setdefault("tool_calls", [])
                if "id" in tc:
                    calls.append({"id": tc["id"], "type": "function", "function": dict(tc["function"])})
                else:
                    calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return message, finish


CUT_CASES = [  # (format, text max_tokens cut, the calls returned as (name, arguments), finish_reason)
    (  # cut mid-arguments: the call so far
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"restaurant": "Chez P',
        [("f", '{"restaurant": "Chez P')],
        "length",
    ),
    (  # a whole call, then one cut in its arguments' key: named, no arguments yet
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "f", "argu',
        [("f", "{}"), ("f", "")],
        "length",
    ),
    # arguments whole, the call's closing brace not: the arguments are all there, still a cut call
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}', [("f", '{"a": 1}')], "length"),
    # the call whole, its close tag cut: a whole call
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_', [("f", '{"a": 1}')], "tool_calls"),
    ("hermes", '<tool_call>\n{"name": "f', [], "length"),  # the name not complete yet: no call
    ("llama3_json", '{"name": "f", "parameters": {"a": [1, 2', [("f", '{"a": [1, 2')], "length"),
    (
        "llama3_json",
        '{"name": "f", "parameters": {}}; {"name": "f", "parameters": {"b',
        [("f", "{}"), ("f", '{"b')],
        "length",
    ),
    (
        "mistral",
        '[{"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {"a"',
        [("f", '{"a": 1}'), ("f", '{"a"')],
        "length",
    ),
    ("mistral", '[{"name": "f", "arguments": {"x": "\\"q', [("f", '{"x": "\\"q')], "length"),  # an escape
]


@pytest.mark.parametrize("fmt,text,calls,finish_reason", CUT_CASES)
def test_a_call_max_tokens_cut_comes_back_as_far_as_it_got(fmt, text, calls, finish_reason):
    """tool_choice required / named: a call cut by max_tokens is returned with its name and the arguments written so
    far, finish_reason "length" (as OpenAI returns it); never as content. Unary and every streaming split agree."""
    for pieces in (None, [text], [text[:9], text[9:30], text[30:]], list(text)):
        message, finish = _cut_message(fmt, text, pieces)
        got = [(t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls", [])]
        assert (got, message["content"], finish) == (calls, None, finish_reason), pieces


def test_a_cut_call_under_auto_stays_content():
    """tool_choice auto: no grammar says the text is a call, so a cut one stays the answer's text, unchanged."""
    req = chat_request(tools=(WEATHER,))
    shape = ChatShape.for_request(req, "hermes", "none")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    choice = shape.choice(Choice(0, parts=[text], finish_reason="length"), False)
    assert (choice["message"]["content"], choice["finish_reason"]) == (text, "length")
    assert "tool_calls" not in choice["message"]


# ---------------------------------------------------------------- output nested past the recursion limit
DEEP = "[" * 1200 + "]" * 1200  # deeper than Python's recursion limit (1000): json raises RecursionError on it
DEEP_CASES = [
    ("hermes", "<tool_call>" + DEEP + "</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + DEEP + "}</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "' + DEEP + '"}</tool_call>'),  # arguments as JSON text
    ("hermes", "<tool_call>" + DEEP),  # ended without its close tag
    ("llama3_json", '{"a":' + DEEP + "}"),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": ' + DEEP + "}"),
    ("mistral", "[TOOL_CALLS]" + DEEP),
    ("mistral", DEEP),
]


@pytest.mark.parametrize("fmt,text", DEEP_CASES)
def test_output_nested_past_the_recursion_limit_is_content(fmt, text):
    """No call is nested a thousand levels deep: the text is the answer's content, whole, unary and streamed."""
    assert parse_tool_calls(text, fmt) == (text, [])
    assert stream(ToolCallParser(fmt), [text[:700], text[700:1900], text[1900:]]) == (text, [])


@pytest.mark.parametrize("fmt,text", DEEP_CASES)
def test_deep_output_through_the_chat_shape_is_a_normal_answer(fmt, text):
    """The path the HTTP worker takes (ChatShape, as app.py builds it): a unary message holding the text, and a
    stream whose content deltas add up to it and that ends with its finish_reason; a call after it still parses."""
    # a call after it (hermes: llama3_json and mistral take bare calls at the start of the output only)
    closed = text.endswith("</tool_call>")
    tail = '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' if closed else ""
    shape = ChatShape.for_request(chat_request(tools=(WEATHER, TIME)), fmt, "none")
    message = shape.choice(finished(text + tail), False)["message"]
    assert message["content"] == text
    assert [t["function"]["name"] for t in message.get("tool_calls", [])] == (["get_time"] if tail else [])
    for pieces in ([text + tail], [text[:600], text[600:] + tail[:9], tail[9:]]):
        c = Choice(0)
        shape = ChatShape.for_request(chat_request(tools=(WEATHER, TIME)), fmt, "none")
        deltas = [
            d for i, p in enumerate(pieces) for d in shape.delta(c, p, None, "stop" if i == len(pieces) - 1 else None)
        ]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == text
        assert deltas[-1]["finish_reason"] == ("tool_calls" if tail else "stop")


# ---------------------------------------------------------------- tool grammars meet the grammar size limit
def _big_tool(name: str, properties: int) -> dict:
    props = {f"field_{i}": {"type": "string", "description": "x" * 40} for i in range(properties)}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


def test_tool_grammar_counts_against_grammar_chars():
    """tool_choice required / named compiles the tools' parameters schemas into a grammar: a 400 naming `tools`
    when they are longer together (canonical JSON) than the limits table's grammar_chars, as a response_format's
    schema of that size is; auto (no grammar) and a named tool whose own schema fits are served."""
    from appliance.limits import Limits

    limits = Limits(grammar_chars=4000)
    big, a, b = _big_tool("big", 60), _big_tool("a", 30), _big_tool("b", 30)

    def size(tool: dict) -> int:
        return len(json.dumps(tool["function"]["parameters"], separators=(",", ":")))

    assert size(big) > limits.grammar_chars > size(a) == size(b) and size(a) + size(b) > limits.grammar_chars
    params = SamplingParams(max_tokens=20)
    for tools, choice, name in (((big,), "required", None), ((a, b), "required", None), ((big, a), "named", "big")):
        req = chat_request(tools=tools, tool_choice=choice, tool_name=name)
        with pytest.raises(ApiError) as err:
            chat_job(req, params, "r", "hermes", limits)
        assert (err.value.status, err.value.param) == (400, "tools"), err.value.message
        assert f"longer than {limits.grammar_chars}" in err.value.message
    named = chat_job(chat_request(tools=(big, a), tool_choice="named", tool_name="a"), params, "r", "", limits)
    assert named.params.grammar is not None and "field_29" in named.params.grammar.text
    auto = chat_job(chat_request(tools=(big, a, b)), params, "r", "hermes", limits)
    assert auto.params.grammar is None and auto.prompts[0].tools == [big, a, b]
    # the default limit: 128 tools (the most a request may send) of ~450 characters of schema each fit
    many = tuple(_big_tool(f"t{i}", 5) for i in range(128))
    assert chat_job(chat_request(tools=many, tool_choice="required"), params, "r", "hermes").params.grammar
