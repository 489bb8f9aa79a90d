"""A vision-language model served end to end through every client API with its official client: a tiny random
VLM of each family (tests/tiny_vlms.py, exported as tests/export/test_vlm.py does) behind a real server, one image
sent through OpenAI chat (/v3 and a /v1 stream), Responses, Anthropic Messages and count_tokens, Ollama chat and
generate. Each answer has its API's shape, and the image is in the prompt: its usage counts more prompt tokens
than the same question without the image (the image's tokens, as the model's processor lays them out). And the
vision feature cache across API keys on a keyed server: a key's repeated image is encoded once, another key's
same image anew (counted on /metrics, not timed)."""

from __future__ import annotations

import io

import pytest
import requests

from tests import tiny_vlms
from tests.e2e.image_requests import answer_text, clients, data_url, prompt_tokens, requests_by_api
from tests.helpers import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=tiny_vlms.FAMILIES)
def vlm(request, tmp_path_factory):
    """A server of the tiny `family` VLM's fp32 export (one gunicorn worker)."""
    from export.vlm import export_vlm

    family = request.param
    root = tmp_path_factory.mktemp(f"vlm-{family}")
    src = tiny_vlms.build(family, root / "hf")
    out = root / "openvino-fp32"
    export_vlm(src, out, "openvino", "fp32")
    with Server(out, root / "serve.log", "--workers", "1") as srv:
        yield srv


def png() -> bytes:
    buffer = io.BytesIO()
    tiny_vlms.image().save(buffer, "PNG")
    return buffer.getvalue()


def test_one_image_through_every_client_api(vlm):
    name = vlm.model_id()
    c = clients(vlm.base)
    with_image = requests_by_api(c, name, png())
    without = requests_by_api(c, name, None)
    for api, call in with_image.items():
        answer = call()
        text = answer_text(api, answer)
        assert text is None if api == "anthropic count_tokens" else isinstance(text, str), (api, answer)
        seen, plain = prompt_tokens(api, answer), prompt_tokens(api, without[api]())
        assert seen > plain > 0, (api, seen, plain)


KEY_A, KEY_B = "vision-a-" + "a" * 24, "vision-b-" + "b" * 24


@pytest.fixture(scope="module")
def keyed_vlm(tmp_path_factory):
    """A server of the tiny Qwen2-VL export with the API keys [A, B] (`--prefix-cache-sharing keys`, the default)."""
    from export.vlm import export_vlm

    root = tmp_path_factory.mktemp("vlm-keyed")
    src = tiny_vlms.build("qwen2_vl", root / "hf")
    out = root / "openvino-fp32"
    export_vlm(src, out, "openvino", "fp32")
    (root / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    with Server(out, root / "serve.log", "--workers", "1", "--api-key-file", str(root / "keys")) as srv:
        yield srv


def test_a_keys_repeated_image_is_encoded_once_and_another_keys_anew(keyed_vlm):
    auth = {key: {"Authorization": f"Bearer {key}"} for key in (KEY_A, KEY_B)}
    name = requests.get(keyed_vlm.base + "/v3/models", headers=auth[KEY_A], timeout=30).json()["data"][0]["id"]
    url = data_url(png())

    def chat(key: str) -> dict:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        body = {"model": name, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
        r = requests.post(keyed_vlm.base + "/v3/chat/completions", json=body, headers=auth[key], timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    def counts() -> tuple[float, float]:
        m = keyed_vlm.metrics(auth[KEY_A])
        return m["appliance_image_encodes_total"], m["appliance_image_cache_hits_total"]

    first = chat(KEY_A)
    assert counts() == (1, 0)
    again = chat(KEY_A)  # the same file from the same key: no encode, and the prefix cache has its prompt too
    assert counts() == (1, 1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = chat(KEY_B)  # another key: a miss in both caches
    assert counts() == (2, 1)
    assert not (other["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    texts = [r["choices"][0]["message"]["content"] for r in (first, again, other)]
    assert texts[0] == texts[1] == texts[2]
