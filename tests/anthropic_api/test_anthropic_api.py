"""End to end: Anthropic's Messages API (`/v1/messages`, appliance/anthropic_api) through the official `anthropic`
client against the real server and default model, with an API key (sent as `x-api-key`, the SDK's way).

Greedy requests are compared with each other on the same server (unary vs stream, with vs without a stop
sequence), never with a fixed text: bf16 boxes differ. Tool calls forced by tool_choice are grammar-constrained,
so their input is checked against the tool's input_schema (jsonschema).
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
import requests

from appliance.limits import Limits
from tests.helpers import WEATHER_PARAMETERS, Server

pytestmark = pytest.mark.slow

KEY = "sk-anthropic-test-key"
ASK = [{"role": "user", "content": "Write three sentences about the sea."}]
SCHEMA = WEATHER_PARAMETERS
TOOLS = [{"name": "get_weather", "description": "Current weather of a city", "input_schema": SCHEMA}]
GREEDY = {"temperature": 0}  # the SDK dropped temperature; older clients send it, and the server takes it
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
CACHED: dict = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    """One server with an API key for the module (1 worker: the requests are sequential)."""
    folder = tmp_path_factory.mktemp("anthropic")
    keys = folder / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    with Server(model_dir, folder / "serve.log", "--workers", "1", "--api-key-file", str(keys)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(keyed) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=keyed.base, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(keyed) -> str:
    r = requests.get(keyed.base + "/v3/models", headers={"x-api-key": KEY}, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def prompt_of(usage) -> int:
    """The whole prompt in Anthropic's usage: the three parts its clients add (its prompt-caching docs)."""
    return usage.input_tokens + (usage.cache_creation_input_tokens or 0) + (usage.cache_read_input_tokens or 0)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_text(client, model):
    m = client.messages.create(model=model, max_tokens=48, messages=ASK, system="You are brief.", extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == model
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and text_of(m)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 48
    assert m.usage.cache_read_input_tokens is not None


def test_max_tokens(client, model):
    m = client.messages.create(model=model, max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stop_sequence_unary_and_stream(client, model):
    """A word of the greedy answer as a stop sequence: the answer ends before it, without it, and names it."""
    full = text_of(client.messages.create(model=model, max_tokens=48, messages=ASK, extra_body=GREEDY))
    words = full.split()
    assert len(words) > 4, full
    stop = " " + words[3]
    m = client.messages.create(model=model, max_tokens=48, messages=ASK, extra_body=GREEDY, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert full.startswith(text_of(m) + stop) and stop not in text_of(m)
    with client.messages.stream(
        model=model, max_tokens=48, messages=ASK, extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(m) == text_of(final)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_stream_events(client, model):
    unary = client.messages.create(model=model, max_tokens=32, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(model=model, max_tokens=32, messages=ASK, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("ping", "text")]  # "text": the SDK's own helper events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = kinds[1:-2]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) == {"content_block_delta"}
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert deltas == text_of(final) == text_of(unary)
    assert prompt_of(events[0].message.usage) == prompt_of(unary.usage) > 0
    assert final.stop_reason == unary.stop_reason and final.usage.output_tokens == unary.usage.output_tokens


def test_usage_leaves_cache_reads_out_of_input_tokens(client, model):
    """Anthropic's input_tokens excludes the prompt's cache reads (clients add input_tokens, cache_creation and
    cache_read: LangChain and litellm counted the cached part twice). A repeated prompt is read from the prefix
    cache: unary, and streamed in message_start and message_delta (where LangChain reads the usage), the parts add
    up to count_tokens' count of the prompt, and the cached part is out of input_tokens."""
    messages = [{"role": "user", "content": "Name three rivers of Europe and the seas they flow into. " * 4}]
    whole = client.messages.count_tokens(model=model, messages=messages).input_tokens
    for _ in range(2):  # the second one reads the first one's prompt from the cache
        m = client.messages.create(model=model, max_tokens=2, messages=messages)
    assert prompt_of(m.usage) == whole and m.usage.cache_read_input_tokens > 0, m.usage
    assert m.usage.input_tokens == whole - m.usage.cache_read_input_tokens
    with client.messages.stream(model=model, max_tokens=2, messages=messages) as stream:
        events = list(stream)
    start = events[0].message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    for usage in (start, delta):
        assert prompt_of(usage) == whole and usage.cache_read_input_tokens > 0, usage
        assert usage.input_tokens == whole - usage.cache_read_input_tokens
    assert delta.output_tokens == 2


def test_tool_round_trip(client, model):
    m = client.messages.create(
        model=model,
        max_tokens=64,
        messages=WEATHER,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, SCHEMA)
    follow = client.messages.create(
        model=model,
        max_tokens=32,
        tools=TOOLS,
        messages=[
            *WEATHER,
            {"role": "assistant", "content": m.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "22 degrees, sunny"}],
            },
        ],
    )
    assert follow.type == "message" and follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert follow.content


def test_forced_tool_streamed(client, model):
    with client.messages.stream(
        model=model, max_tokens=64, messages=WEATHER, tools=TOOLS, tool_choice={"type": "any"}
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    jsonschema.validate(json.loads(partial), SCHEMA)
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == json.loads(partial)


def test_count_tokens(client, model):
    counted = client.messages.count_tokens(model=model, messages=ASK, system="You are brief.")
    m = client.messages.create(model=model, max_tokens=1, messages=ASK, system="You are brief.")
    assert counted.input_tokens == prompt_of(m.usage) > 0
    with_tools = client.messages.count_tokens(model=model, messages=ASK, tools=TOOLS)
    assert with_tools.input_tokens > client.messages.count_tokens(model=model, messages=ASK).input_tokens


def test_auth(keyed, model):
    wrong = anthropic.Anthropic(base_url=keyed.base, api_key="not-the-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model=model, max_tokens=4, messages=ASK)
    assert info.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=keyed.base, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.count_tokens(model=model, messages=ASK).input_tokens > 0


def test_errors_in_anthropic_shape(keyed, client, model):
    r = requests.post(
        keyed.base + "/v1/messages",
        json={"model": model, "messages": ASK},
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=8, messages=ASK, extra_body={"temperature": 1.5})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="thinking"):  # the default model has no reasoning parser
        client.messages.create(
            model=model, max_tokens=2048, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8, messages=ASK)
    # a field Anthropic does not know is its 400 (never silently dropped); the SDK's own fields are accepted
    with pytest.raises(anthropic.BadRequestError, match="top_n: Extra inputs are not permitted") as info:
        client.messages.create(model=model, max_tokens=8, messages=ASK, extra_body={"top_n": 3})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    ok = client.messages.create(
        model=model,
        max_tokens=2,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}
        ],
        metadata={"user_id": "u"},
        service_tier="auto",
        extra_body={"speed": "standard"},
    )
    assert ok.type == "message"
    blocks = [{"type": "text", "text": "a"}] * (Limits().content_parts + 1)  # a bound of the limits table
    with pytest.raises(anthropic.BadRequestError, match="no more than") as info:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": blocks}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"


def test_output_config_json_schema(client, model):
    m = client.messages.create(
        model=model,
        max_tokens=64,
        messages=WEATHER,
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(m)), SCHEMA)


def test_edge_counts_x_api_key_as_the_bearer_key():
    """The edge worker's per-key generation cap: `x-api-key: K` is the key `Authorization: Bearer K` is."""
    from appliance.http.edge import parse_head

    def key(header: bytes) -> bytes:
        head = parse_head(b"POST /v1/messages HTTP/1.1\r\nHost: h\r\n" + header + b"\r\nContent-Length: 0\r\n\r\n", 99)
        assert head is not None
        return head.key

    assert key(b"x-api-key: K1") == key(b"Authorization: Bearer K1") != key(b"x-api-key: K2")
    assert key(b"x-api-key: K1") != b"" and key(b"Authorization: Bearer K1\r\nx-api-key: K2") == key(b"x-api-key: K1")
