"""End to end: embeddings and rerank on a real `appliance serve` (a chat model, the default embedding model
all-MiniLM-L6-v2 and a tiny random cross-encoder, from one config file), through real clients: the openai SDK
(float and base64, batches, token ids, `dimensions`, too long -> 400, `truncate`), LangChain's OpenAIEmbeddings,
llama-index's OpenAIEmbedding, the ollama client's `embed`, and /v3/rerank. Every vector is compared with the
in-process Encoder's on the same inputs (cosine > 0.999); rerank's order with the in-process scores. Concurrency:
embeddings beside a chat stream, a bad request beside good ones, a client that leaves (its inputs dropped).
The engine side alone, over a fake encoder: tests/server/test_embeddings_service.py."""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from appliance.runtime.encoder import Encoder
from appliance.testing.loopback import ROOT, LoopbackServer, parse_metrics
from tests.helpers import START_TIMEOUT, Server

pytestmark = pytest.mark.slow

EMBED, RERANK, CHAT = "all-MiniLM-L6-v2", "tiny-rerank", "chat"
TEXTS = [
    "The appliance serves chat and embeddings on one small box.",
    "Reranking puts the most relevant passage first.",
    "Short.",
    "A much longer sentence about manuals, tickets and logs that are searched on the device itself, "
    "without a second server, so that it is padded against the others in its batch.",
]
MAX_INPUTS = 64  # --max-embedding-inputs: small, so the bound is cheap to cross


class ConfigServer(Server):
    """`appliance serve --config FILE` (no --model: the file names the models)."""

    def __init__(self, config: Path, log_path: Path):
        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--port", str(port)]

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        LoopbackServer.__init__(self, command, log_path, env=env, start_timeout=START_TIMEOUT)


def tiny_rerank_export(root: Path, name: str = RERANK) -> Path:
    """A tiny random cross-encoder (tests/tiny_encoders.py), exported fp32 to root/export."""
    from export.encoder import export_encoder
    from tests import tiny_encoders

    src = tiny_encoders.build("rerank", root / "src")
    export_encoder(src, root / "export", "openvino", "fp32", name=name)
    return root / "export"


def config_server(root: Path, models: dict[str, Path], **settings) -> ConfigServer:
    """A server of `models` (name -> export) from one config file with these top-level settings."""
    config = root / "config.json"
    entries = [{"config": {"name": name, "base_path": str(path)}} for name, path in models.items()]
    config.write_text(json.dumps({**settings, "model_config_list": entries}))
    return ConfigServer(config, root / "serve.log")


@pytest.fixture(scope="module")
def embedding_dir(embedding_export) -> Path:
    return embedding_export("int8")  # conftest's: marks the tests default_model


@pytest.fixture(scope="module")
def rerank_dir(tmp_path_factory) -> Path:
    return tiny_rerank_export(tmp_path_factory.mktemp("rerank"))


@pytest.fixture(scope="module")
def srv(model_dir, embedding_dir, rerank_dir, tmp_path_factory):
    models = {CHAT: model_dir, EMBED: embedding_dir, RERANK: rerank_dir}
    root = tmp_path_factory.mktemp("embed-server")
    with config_server(root, models, workers=1, max_embedding_inputs=MAX_INPUTS) as server:
        yield server


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.base + "/v3", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def encoder(embedding_dir) -> Encoder:
    return Encoder(embedding_dir, threads=1)


def reference(encoder: Encoder, texts: list[str]) -> np.ndarray:
    return encoder.embed(encoder.tokenize(texts))


def assert_close(got, want: np.ndarray, floor: float = 0.999) -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() > floor, cos


def post(srv, path: str, body: dict) -> requests.Response:
    return requests.post(srv.base + path, json=body, timeout=120)


# ---------------------------------------------------------------- the openai SDK


def test_openai_float_and_base64(oai, encoder):
    want = reference(encoder, TEXTS)
    floats = oai.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2, 3]
    assert_close([d.embedding for d in floats.data], want)
    tokens = sum(map(len, encoder.tokenize(TEXTS)))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    assert floats.model == EMBED
    packed = oai.embeddings.create(model=EMBED, input=TEXTS)  # the SDK's default: it asks base64 and decodes it
    np.testing.assert_array_equal(np.array([d.embedding for d in packed.data]), [d.embedding for d in floats.data])


def test_base64_is_little_endian_float32(srv, encoder):
    body = post(srv, "/v3/embeddings", {"model": EMBED, "input": TEXTS[0], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    assert vector.shape == (384,)
    assert_close(vector[None], reference(encoder, TEXTS[:1]))


def test_token_id_inputs(oai, encoder):
    ids = encoder.tokenize(TEXTS[:2])
    want = reference(encoder, TEXTS[:2])
    assert_close([d.embedding for d in oai.embeddings.create(model=EMBED, input=ids).data], want)
    one = oai.embeddings.create(model=EMBED, input=ids[0]).data  # one list of ids: one input
    assert len(one) == 1
    assert_close([one[0].embedding], want[:1])


def test_dimensions_shorten_and_renormalize(oai, encoder):
    got = np.array(oai.embeddings.create(model=EMBED, input=TEXTS[:2], dimensions=64).data[0].embedding)
    full = reference(encoder, TEXTS[:1])[0, :64]
    assert got.shape == (64,)
    assert abs(np.linalg.norm(got) - 1) < 1e-5
    assert_close(got[None], full[None] / np.linalg.norm(full))
    with pytest.raises(openai.BadRequestError, match="between 1 and 384"):
        oai.embeddings.create(model=EMBED, input="x", dimensions=385)


def test_too_long_is_400_unless_truncated(oai, encoder):
    text = "word " * 400  # 402 tokens > 256
    with pytest.raises(openai.BadRequestError, match="more than the model's maximum of 256") as exc:
        oai.embeddings.create(model=EMBED, input=["fine", text])
    assert exc.value.body["param"] == "input"
    cut = oai.embeddings.create(model=EMBED, input=["fine", text], extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == 3 + 256
    want = encoder.embed([encoder.tokenize(["fine"])[0], encoder.truncate(encoder.tokenize([text])[0])])
    assert_close([d.embedding for d in cut.data], want)


def test_bounds_are_400s(srv, oai):
    with pytest.raises(openai.BadRequestError, match=f"more than the limit of {MAX_INPUTS}"):
        oai.embeddings.create(model=EMBED, input=["x"] * (MAX_INPUTS + 1))
    for body, param in (
        ({"model": EMBED, "input": []}, "input"),
        ({"model": EMBED, "input": [""]}, "input"),
        ({"model": EMBED, "input": [[1, -2]]}, "input"),
        ({"model": EMBED, "input": [["a"]]}, "input"),
        ({"model": EMBED, "input": [[101, 999999, 102]]}, "input"),
        ({"model": EMBED, "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": EMBED, "input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x"}, "model"),
    ):
        r = post(srv, "/v3/embeddings", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    assert post(srv, "/v3/embeddings", {"model": "nope", "input": "x"}).status_code == 404
    ok = post(srv, "/v1/embeddings", {"model": EMBED, "input": "x", "user": "someone"})
    assert ok.status_code == 200, ok.text


def test_wrong_kind_of_model_is_a_clear_400(srv, oai):
    with pytest.raises(openai.BadRequestError, match="is an embedding model: it does not generate text"):
        oai.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="generates text: it does not serve embeddings"):
        oai.embeddings.create(model=CHAT, input="x")
    r = post(srv, "/v3/rerank", {"model": EMBED, "query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "does not serve rerank" in r.json()["error"]["message"]
    r = post(srv, "/api/chat", {"model": EMBED, "messages": [{"role": "user", "content": "hi"}], "stream": False})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]


def test_models_are_listed(srv, oai):
    assert {m.id for m in oai.models.list()} == {CHAT, EMBED, RERANK}
    tags = requests.get(srv.base + "/api/tags", timeout=30).json()
    assert f"{EMBED}:latest" in {m["name"] for m in tags["models"]}


# ---------------------------------------------------------------- framework clients


def test_langchain_openai_embeddings(srv, encoder):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts (by default LangChain sends tiktoken's ids, which are not
    # this model's: docs/embeddings.md)
    emb = OpenAIEmbeddings(
        model=EMBED, base_url=srv.base + "/v3", api_key="unused", check_embedding_ctx_length=False, max_retries=0
    )
    assert_close(emb.embed_documents(TEXTS), reference(encoder, TEXTS))
    assert_close([emb.embed_query(TEXTS[1])], reference(encoder, TEXTS[1:2]))


def test_llama_index_openai_embedding(srv, encoder):
    from llama_index.embeddings.openai import OpenAIEmbedding

    emb = OpenAIEmbedding(model_name=EMBED, api_base=srv.base + "/v3", api_key="unused", max_retries=0)
    assert_close(emb.get_text_embedding_batch(TEXTS), reference(encoder, TEXTS))
    assert_close([emb.get_query_embedding(TEXTS[0])], reference(encoder, TEXTS[:1]))


def test_ollama_embed(srv, encoder):
    import ollama

    client = ollama.Client(host=srv.base)
    out = client.embed(model=EMBED, input=TEXTS)
    assert_close(out.embeddings, reference(encoder, TEXTS))
    assert out.prompt_eval_count == sum(map(len, encoder.tokenize(TEXTS)))
    assert out.total_duration and out.total_duration > 0
    long = client.embed(model=f"{EMBED}:latest", input="word " * 400, keep_alive="5m")  # Ollama truncates
    assert len(long.embeddings) == 1
    with pytest.raises(ollama.ResponseError, match="maximum of 256"):
        client.embed(model=EMBED, input="word " * 400, truncate=False)
    legacy = client.embeddings(model=EMBED, prompt=TEXTS[0])
    assert_close([legacy.embedding], reference(encoder, TEXTS[:1]))
    r = post(srv, "/api/embed", {"model": EMBED, "input": []})
    assert r.status_code == 400 and "error" in r.json()


# ---------------------------------------------------------------- rerank


def test_rerank_orders_as_the_model_does(srv, rerank_dir):
    model = Encoder(rerank_dir, threads=1)
    query = "which passage answers the question about the device"
    docs = [
        "Retrieval finds the manual page that answers a question about the device.",
        "Numbers like 12345 and 3.14159.",
        "A reranker scores each document against the query.",
        "Logs, tickets and manuals are searched on the box itself.",
    ]
    logits = model.score(model.tokenize_pairs(query, docs))
    order = [int(i) for i in np.argsort(-logits, kind="stable")]
    r = post(srv, "/v3/rerank", {"model": RERANK, "query": query, "documents": docs})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == order
    np.testing.assert_allclose([x["relevance_score"] for x in results], 1 / (1 + np.exp(-logits[order])), rtol=1e-4)
    assert "document" not in results[0]
    top = post(
        srv,
        "/v1/rerank",
        {
            "model": RERANK,
            "query": query,
            "documents": [{"text": d} for d in docs],
            "top_n": 2,
            "return_documents": True,
        },
    ).json()
    assert [x["index"] for x in top["results"]] == order[:2]
    assert top["results"][0]["document"] == {"text": docs[order[0]]}
    assert top["usage"]["total_tokens"] == sum(len(ids) for ids, _ in model.tokenize_pairs(query, docs))
    for body, param in (
        ({"model": RERANK, "query": "", "documents": ["d"]}, "query"),
        ({"model": RERANK, "query": "q", "documents": []}, "documents"),
        ({"model": RERANK, "query": "q", "documents": [1]}, "documents"),
        ({"model": RERANK, "query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ):
        r = post(srv, "/v3/rerank", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------- concurrency and metrics


def test_concurrent_embeddings_beside_chat_and_a_bad_request(srv, oai, encoder):
    """Eight clients embed (one of them sends a too-long input) while a chat stream runs: every good request gets
    its own vectors, the bad one its 400, the chat its tokens."""
    want = reference(encoder, TEXTS)
    errors: list = []
    chat_tokens: list[str] = []

    def embed(k: int) -> None:
        try:
            for _ in range(3):
                if k == 7:
                    r = post(srv, "/v3/embeddings", {"model": EMBED, "input": ["ok", "word " * 400]})
                    assert r.status_code == 400, r.text
                    continue
                order = TEXTS[k % 4 :] + TEXTS[: k % 4]
                got = oai.embeddings.create(model=EMBED, input=order, encoding_format="float")
                assert_close([d.embedding for d in got.data], np.roll(want, -(k % 4), axis=0))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def chat() -> None:
        stream = oai.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "Count to twenty."}], max_tokens=40, stream=True
        )
        chat_tokens.extend(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=embed, args=(k,)) for k in range(8)] + [threading.Thread(target=chat)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert "".join(chat_tokens).strip()


def metric(srv, name: str) -> float:
    text = requests.get(srv.base + "/metrics", timeout=30).text
    return parse_metrics(text).get(name, 0.0)


def test_a_vanished_client_is_dropped_and_counted(srv, oai):
    """A client that sends a large request and leaves: its inputs are dropped (counted cancelled), and the next
    request is answered at once, not after the abandoned work."""
    cancelled = 'appliance_encoder_requests_total{outcome="cancelled",task="embed"}'
    before = metric(srv, cancelled)
    body = json.dumps({"model": EMBED, "input": ["word " * 250] * MAX_INPUTS}).encode()  # ~64 x 252 tokens
    head = (
        f"POST /v3/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    oai.embeddings.create(model=EMBED, input=["word " * 250] * MAX_INPUTS)  # what the whole request costs
    whole = time.monotonic() - started
    for _ in range(3):  # several leave: their work would add up
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(head + body)
            time.sleep(0.3)
    started = time.monotonic()
    oai.embeddings.create(model=EMBED, input="after")
    assert time.monotonic() - started < 2 * whole  # not behind 3 x the abandoned work
    deadline = time.monotonic() + 30
    while metric(srv, cancelled) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(srv, cancelled) >= before + 3


def test_metrics_count_requests_tokens_and_batches(srv, oai):
    ok = 'appliance_encoder_requests_total{outcome="ok",task="embed"}'
    before, tokens = metric(srv, ok), metric(srv, 'appliance_encoder_tokens_total{task="embed"}')
    oai.embeddings.create(model=EMBED, input=TEXTS)
    assert metric(srv, ok) == before + 1
    assert metric(srv, 'appliance_encoder_tokens_total{task="embed"}') > tokens
    assert metric(srv, "appliance_encoder_batch_inputs_count") >= 1
    assert metric(srv, 'appliance_http_requests_total{method="POST",route="/v3/embeddings",status="200"}') >= 1


def test_each_response_is_counted_once(srv):
    """An answered request's HTTP response is counted by the engine with its answer (the worker makes no record
    round trip of its own for it), a refused one by the worker as any other: each exactly once, on every
    embeddings route, and in /metrics as soon as the response is back."""

    def counts() -> dict[str, float]:
        values = parse_metrics(requests.get(srv.base + "/metrics", timeout=30).text)
        return {k: v for k, v in values.items() if k.startswith('appliance_http_requests_total{method="POST"')}

    def key(route: str, status: int) -> str:
        return f'appliance_http_requests_total{{method="POST",route="{route}",status="{status}"}}'

    before = counts()
    for _ in range(3):
        post(srv, "/v3/embeddings", {"model": EMBED, "input": "hello"}).raise_for_status()
    post(srv, "/v1/embeddings", {"model": EMBED, "input": ["a", "b"], "encoding_format": "base64"}).raise_for_status()
    post(srv, "/v3/rerank", {"model": RERANK, "query": "q", "documents": ["d"]}).raise_for_status()
    post(srv, "/api/embed", {"model": EMBED, "input": "hello"}).raise_for_status()
    assert post(srv, "/v3/embeddings", {"model": EMBED, "input": ""}).status_code == 400
    assert post(srv, "/v3/embeddings", {"model": CHAT, "input": "hello"}).status_code == 400
    after = counts()
    delta = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert delta == {
        key("/v3/embeddings", 200): 3,
        key("/v1/embeddings", 200): 1,
        key("/v3/rerank", 200): 1,
        key("/api/embed", 200): 1,
        key("/v3/embeddings", 400): 2,
    }
