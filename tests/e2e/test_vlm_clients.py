"""A vision-language model served end to end through every client API with its official client: a tiny random
VLM of each family (tests/tiny_vlms.py, exported as tests/export/test_vlm.py does) behind a real server, one image
sent through OpenAI chat (/v3 and a /v1 stream), Responses, Anthropic Messages and count_tokens, Ollama chat and
generate. Each answer has its API's shape, and the image is in the prompt: its usage counts more prompt tokens
than the same question without the image (the image's tokens, as the model's processor lays them out)."""

from __future__ import annotations

import io

import pytest

from tests import tiny_vlms
from tests.e2e.image_requests import answer_text, clients, prompt_tokens, requests_by_api
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
