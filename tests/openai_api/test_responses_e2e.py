"""End to end: OpenAI's Responses API (`/v3/responses`) through the real `openai` SDK against a real server and the
default model: unary, streaming (event order, sequence numbers, deltas adding up), structured output, a function
tool round trip, `previous_response_id` (the prefix cache reuses turn 1), the stored responses (GET, DELETE,
input_items, another key, a restart on the same data dir). Validity is asserted, never the exact text.

The server runs with two API keys and its own data dir (the store is <data dir>/responses.sqlite3).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import stat
import threading
import time

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from appliance.limits import Limits
from tests.helpers import WEATHER_PARAMETERS, Server

pytestmark = pytest.mark.default_model

KEYS = ("key-one-0123456789", "key-two-0123456789")
PARAMETERS = WEATHER_PARAMETERS
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": PARAMETERS,
    "strict": True,
}
# long enough that turn 1's prompt fills whole KV blocks (the prefix cache shares full blocks only)
LONG_QUESTION = "Please tell me, in a few words, what the capital of France is. " * 6


def _start(model_dir, data_dir, log_path, keyfile) -> Server:
    before = os.environ.get("APPLIANCE_DATA_DIR")
    os.environ["APPLIANCE_DATA_DIR"] = str(data_dir)  # the server (and its workers) inherit it
    try:
        return Server(
            model_dir, log_path, "--api-key-file", str(keyfile), "--workers", "2"
        )  # the store across processes
    finally:
        if before is None:
            del os.environ["APPLIANCE_DATA_DIR"]
        else:
            os.environ["APPLIANCE_DATA_DIR"] = before


@pytest.fixture(scope="module")
def setup(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    keyfile = root / "keys"
    keyfile.write_text("\n".join(KEYS) + "\n")
    data_dir = root / "data"
    data_dir.mkdir()
    srv = _start(model_dir, data_dir, root / "serve.log", keyfile)
    runs = itertools.count(2)
    state = {
        "server": srv,
        "restart": lambda: _start(model_dir, data_dir, root / f"serve{next(runs)}.log", keyfile),
        "data_dir": data_dir,
    }
    try:
        srv.wait_ready()
        yield state
    finally:
        state["server"].close()


def _client(srv: Server, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v3", api_key=key, max_retries=0, timeout=120)


@pytest.fixture
def client(setup) -> openai.OpenAI:
    return _client(setup["server"])  # the current one: test_survives_a_restart starts another


@pytest.fixture
def model_name(client) -> str:
    return client.models.list().data[0].id


def test_string_input(client, model_name):
    r = client.responses.create(model=model_name, input="Say hello.", max_output_tokens=16)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete")
    message = r.output[0]
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].type == "output_text" and r.output_text == message.content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 16 and r.model == model_name


def test_items_with_instructions_and_incomplete(client, model_name):
    r = client.responses.create(
        model=model_name,
        instructions="You answer like a pirate.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Tell me a long story about the sea."}]},
        ],
        max_output_tokens=5,
        temperature=0.0,
    )
    assert r.instructions == "You answer like a pirate." and r.temperature == 0.0
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


def test_stream(client, model_name):
    kinds, seqs, deltas = [], [], []
    final = None
    with client.responses.stream(model=model_name, input="Count from one to five.", max_output_tokens=24) as s:
        for event in s:
            kinds.append(event.type)
            seqs.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response  # the SDK's get_final_response waits for response.completed only
    assert final is not None, kinds
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if final.status == "completed" else "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and deltas
    assert seqs == list(range(len(seqs)))
    assert "".join(deltas) == final.output_text and final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored before the last event


class City(BaseModel):  # bounded strings: a small model's free integer may run on past max_output_tokens
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


def test_parse_structured(client, model_name):
    r = client.responses.parse(
        model=model_name, input="Describe Paris as JSON.", text_format=City, max_output_tokens=64
    )
    assert r.status == "completed", r.output_text
    assert isinstance(r.output_parsed, City)
    assert r.text.format.type == "json_schema"


def call_result(client, model_name: str, r, call, **fields):
    """The turn after response `r`: its function call's result handed back, with the tool still offered."""
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}
    return client.responses.create(model=model_name, previous_response_id=r.id, input=[output], tools=[TOOL], **fields)


def test_function_round_trip(client, model_name):
    r = client.responses.create(
        model=model_name,
        input="What is the weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        max_output_tokens=64,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls, r.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    r2 = call_result(client, model_name, r, call, max_output_tokens=24)
    assert r2.previous_response_id == r.id and r2.status in ("completed", "incomplete")
    assert r2.output and r2.usage.input_tokens > r.usage.input_tokens


def test_previous_response_reuses_the_prefix(client, model_name):
    r1 = client.responses.create(model=model_name, input=LONG_QUESTION, max_output_tokens=16)
    r2 = client.responses.create(
        model=model_name, previous_response_id=r1.id, input="And of Italy?", max_output_tokens=16
    )
    assert r2.usage.input_tokens > r1.usage.input_tokens
    # turn 2's prompt renders turn 1's prompt and output as the model saw and wrote them, so the prefix cache has
    # more than turn 1's prompt: 127 tokens on the default model, so the output's first token completes a KV block
    # (of 16 or 32) and that block is reused only when the output is reproduced token for token
    assert r1.usage.input_tokens % 16 == 15, r1.usage
    assert r2.usage.input_tokens_details.cached_tokens > r1.usage.input_tokens, r2.usage


def test_stored_get_delete_and_input_items(setup, client, model_name):
    r = client.responses.create(
        model=model_name,
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
        max_output_tokens=8,
    )
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.total_tokens == r.usage.total_tokens
    items = client.responses.input_items.list(r.id, order="asc")
    assert [i.role for i in items.data] == ["user", "assistant", "user"]
    assert items.data[0].content[0].text == "Hi"
    other = _client(setup["server"], KEYS[1])
    with pytest.raises(openai.NotFoundError):  # another key's response does not exist for this key
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as info:  # nor can that key continue from it (its turns stay private)
        other.responses.create(model=model_name, previous_response_id=r.id, input="Go on", max_output_tokens=4)
    assert info.value.body["code"] == "previous_response_not_found", info.value.body
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    db = setup["data_dir"] / "responses.sqlite3"
    assert stat.S_IMODE(db.stat().st_mode) == 0o600


def test_store_false_is_not_kept(client, model_name):
    r = client.responses.create(model=model_name, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_refusals(client, model_name):
    for extra in ({"background": True}, {"tools": [{"type": "web_search"}]}, {"frobnicate": 1}):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=model_name, input="Hi", max_output_tokens=4, extra_body=extra)
        assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model_name, input="Hi", previous_response_id="resp_nope")
    too_long = "resp_" + "0" * Limits().id_chars  # bounds of the limits table, in OpenAI's error shape
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model_name, input="Hi", previous_response_id=too_long)
    assert info.value.body["param"] == "previous_response_id" and info.value.body["type"] == "invalid_request_error"
    r = client.responses.create(model=model_name, input="Hi", max_output_tokens=2)
    for limit in (Limits().input_items_page + 1, 0):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.input_items.list(r.id, limit=limit)
        assert info.value.body["param"] == "limit"
    with pytest.raises(openai.BadRequestError):  # Unicode digits, or more than 9: a 400, not a 500
        client.responses.input_items.list(r.id, extra_query={"limit": "²"})
    assert len(client.responses.input_items.list(r.id, limit=Limits().input_items_page).data) == 1


def test_the_engines_refusals_name_the_responses_fields(client, model_name):
    """A refusal the engine process makes of the conversation itself (here a text too long to be encoded within the
    model's context) names the client's own field: `input` on Responses, `messages` on chat; token ids past the
    context name `prompt` with OpenAI's code for it; a schema the engine's grammar compiler refuses names
    `text.format`."""
    text = "x" * 10**6  # more characters than the context's tokens can hold: refused before it is encoded
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model_name, input=text, max_output_tokens=4)
    assert info.value.body["param"] == "input" and "characters" in info.value.body["message"], info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model_name, input=[{"role": "user", "content": text}], stream=True)
    assert info.value.body["param"] == "input", info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": text}], max_tokens=4)
    assert info.value.body["param"] == "messages", info.value.body
    with pytest.raises(openai.BadRequestError) as info:  # token ids past the context: the engine's own check
        client.completions.create(model=model_name, prompt=[1] * 40000, max_tokens=4)
    body = info.value.body
    assert body["param"] == "prompt" and body["code"] == "context_length_exceeded", body
    bogus = {"type": "object", "properties": {"a": {"type": "string", "format": "bogus"}}}  # the engine's compiler's
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": bogus}}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model_name, input="Hi", max_output_tokens=4, text=fmt)  # type: ignore[arg-type]
    assert info.value.body["param"] == "text.format" and "bogus" in info.value.body["message"], info.value.body


def test_survives_a_restart(setup, client, model_name):
    r = client.responses.create(model=model_name, input="Remember me.", max_output_tokens=8)
    setup["server"].close()
    setup["server"] = setup["restart"]()
    setup["server"].wait_ready()
    again = _client(setup["server"]).responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text


def test_function_call_streamed(client, model_name):
    kinds, args = [], []
    with client.responses.stream(
        model=model_name,
        input="Weather in Rome?",
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the grammar ends the output
        max_output_tokens=64,
    ) as s:
        for event in s:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                args.append(event.delta)
            if event.type == "response.function_call_arguments.done":
                done = event.arguments
        final = s.get_final_response()
    assert "response.output_item.added" in kinds and kinds[-1] == "response.completed"
    assert "".join(args) == done
    call = next(i for i in final.output if i.type == "function_call")
    assert call.arguments == done
    jsonschema.validate(json.loads(done), PARAMETERS)


def weather_agent(setup, model_name: str, **options):
    """(the Agents SDK, an agent with a get_weather tool under tool_choice required on the Responses API, the
    cities its tool was called with); `options`: more of the Agent's arguments."""
    import agents  # pinned (openai-agents): missing is an install failure, not a skip

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    client = openai.AsyncOpenAI(base_url=setup["server"].base + "/v3", api_key=KEYS[0], max_retries=0, timeout=120)
    agent = agents.Agent(
        name="weather",
        instructions="Answer questions about the weather with the get_weather tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model_name, openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0.0
        ),
        **options,
    )
    return agents, agent, calls


def test_openai_agents_sdk_runs_a_tool_agent(setup, model_name):
    """The OpenAI Agents SDK (pinned in the test extra) over the Responses API: a tool call, the tool's result
    handed back, the agent's final output."""
    agents, agent, calls = weather_agent(setup, model_name)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert calls, "the agent never called its tool"
    assert isinstance(result.final_output, str) and result.final_output


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_a_forced_call_beside_a_text_format(client, model_name, tool_choice):
    """text.format with tool_choice required / named (openai-agents' Agent with an output_type and a forced tool,
    instructor's Responses mode) was a 400 naming response_format: the call comes, constrained by the tool's
    parameters, and the turn after it (tool_choice auto) answers in the format."""
    fmt = {"type": "json_schema", "name": "City", "schema": City.model_json_schema(), "strict": True}
    r = client.responses.create(
        model=model_name,
        input="What is the weather in Paris?",
        tools=[TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        text={"format": fmt},
        max_output_tokens=64,
    )
    [call] = [item for item in r.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    r2 = call_result(client, model_name, r, call, text={"format": fmt}, max_output_tokens=64)
    assert r2.status == "completed", r2
    City.model_validate_json(r2.output_text)


class Report(BaseModel):
    city: str = Field(max_length=16)
    sunny: bool


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
def test_openai_agents_sdk_agent_with_an_output_type_and_a_forced_tool(setup, model_name, streamed):
    """The Agents SDK's Agent with an `output_type` and tool_choice required sends text.format beside the forced
    tool on its first turn: the tool is called, and the final output is the output type (the SDK resets
    tool_choice after the call, so the last turn answers in the format)."""
    agents, agent, calls = weather_agent(setup, model_name, output_type=Report)
    if streamed:

        async def run():
            result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            async for _ in result.stream_events():
                pass
            return result

        result = asyncio.run(run())
    else:
        result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert calls, "the agent never called its tool"
    assert isinstance(result.final_output, Report), result.final_output


def test_acknowledged_responses_survive_a_kill(setup, model_name):
    """SIGKILL of the whole server while stored responses are being written: every response a client got an answer
    for is there after a restart (each is committed before it is answered)."""
    srv = setup["server"]
    acknowledged: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        c = _client(srv)
        while not stop.is_set():
            try:
                acknowledged.append(c.responses.create(model=model_name, input="Hi", max_output_tokens=4).id)
            except openai.OpenAIError:
                return

    threads = [threading.Thread(target=writer) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(acknowledged) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in reversed(srv.process_tree()):  # workers first: none may answer after the engine went
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    stop.set()
    for t in threads:
        t.join(timeout=60)
    srv.proc.wait(timeout=60)
    srv.close()  # dead: only its log is closed
    kept = list(acknowledged)
    assert len(kept) >= 6
    setup["server"] = setup["restart"]()
    setup["server"].wait_ready()
    c = _client(setup["server"])
    for rid in kept:
        assert c.responses.retrieve(rid).id == rid
