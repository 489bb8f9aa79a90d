"""One image request per client API, sent the way each official client sends it (`openai` chat and Responses,
`anthropic` Messages and count_tokens, `ollama` chat and generate), shared by the image tests
(test_image_inputs.py: refusals on a text model, test_vlm_clients.py: answers from a tiny VLM). Real images come
from Pillow (the dev venv's; the serving side never imports it in a worker)."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Callable
from typing import Any

import anthropic
import ollama
import openai
import requests

QUESTION = "What is in this picture?"


def picture(width: int = 64, height: int = 48, color: tuple[int, int, int] = (200, 40, 40), fmt: str = "PNG") -> bytes:
    """A real image file: a colored rectangle with a darker square in it (so it is not one flat color)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), color)
    ImageDraw.Draw(image).rectangle((width // 4, height // 4, width // 2, height // 2), fill=(20, 20, 120))
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


class LiveStream:
    """`with LiveStream(base, model) as live:` a completion stream read token by token on its own thread, decoding
    before the block starts, and another one as soon as one ends (a tiny model's context ends a stream within a
    second); `live.largest_gap(start, end)`: the longest wait between two of its tokens then (a stall is what its
    user sees)."""

    def __init__(self, base: str, model: str, max_tokens: int = 4000):
        self.body = {"model": model, "prompt": "Write a long story.", "max_tokens": max_tokens, "ignore_eos": True}
        self.url = base + "/v3/completions"
        self.arrivals: list[float] = []
        self.status = 0
        self.stop = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        while not self.stop.is_set():
            with requests.post(self.url, json={**self.body, "stream": True}, stream=True, timeout=300) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    return
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        self.arrivals.append(time.monotonic())
                    if self.stop.is_set():
                        return

    def __enter__(self) -> LiveStream:
        self.reader.start()
        deadline = time.monotonic() + 300
        while len(self.arrivals) < 10:
            assert self.reader.is_alive() and time.monotonic() < deadline, (
                f"the live stream did not run ({self.status})"
            )
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.reader.join(timeout=60)

    def largest_gap(self, start: float, end: float) -> float:
        during = [t for t in self.arrivals if start <= t <= end]
        assert len(during) >= 2, "the live stream made no progress"
        return max(b - a for a, b in zip(during, during[1:]))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def clients(base: str) -> dict[str, Any]:
    return {
        "openai_v3": openai.OpenAI(base_url=base + "/v3", api_key="unused", max_retries=0, timeout=120),
        "openai_v1": openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120),
        "anthropic": anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120),
        "ollama": ollama.Client(host=base, timeout=120),
    }


def openai_parts(url: str | None) -> list[dict] | str:
    if url is None:
        return QUESTION
    return [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]


def anthropic_content(image: bytes | None) -> list[dict] | str:
    if image is None:
        return QUESTION
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    return [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]


def requests_by_api(
    c: dict[str, Any], model: str, image: bytes | None, max_tokens: int = 8, url: str | None = None
) -> dict[str, Callable[[], Any]]:
    """Each API's request with `image` (None: the same question without it; `url`: that URL instead of the data
    URL, for the APIs that take URLs), as a call that returns the client's answer or raises its error."""
    link = url or (data_url(image) if image is not None else None)
    responses_input: Any = QUESTION
    if link is not None:
        responses_input = [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": link, "detail": "auto"},
                ],
            }
        ]
    anthropic_body: Any = anthropic_content(image)
    if url is not None:
        anthropic_body = [{"type": "image", "source": {"type": "url", "url": url}}, {"type": "text", "text": QUESTION}]
    anthropic_messages = [{"role": "user", "content": anthropic_body}]
    images = [image] if image is not None else None
    chat = [{"role": "user", "content": openai_parts(link)}]
    return {
        "openai chat /v3": lambda: c["openai_v3"].chat.completions.create(
            model=model, messages=chat, max_tokens=max_tokens, temperature=0
        ),
        "openai chat /v1 stream": lambda: list(
            c["openai_v1"].chat.completions.create(
                model=model,
                messages=chat,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        ),
        "openai responses": lambda: c["openai_v3"].responses.create(
            model=model, input=responses_input, max_output_tokens=max_tokens, temperature=0
        ),
        "anthropic messages": lambda: c["anthropic"].messages.create(
            model=model, max_tokens=max_tokens, messages=anthropic_messages, extra_body={"temperature": 0}
        ),
        "anthropic count_tokens": lambda: c["anthropic"].messages.count_tokens(
            model=model, messages=anthropic_messages
        ),
        "ollama chat": lambda: c["ollama"].chat(
            model=model,
            messages=[{"role": "user", "content": QUESTION, **({"images": images} if images else {})}],
            options={"num_predict": max_tokens, "temperature": 0},
            stream=False,
        ),
        "ollama generate": lambda: c["ollama"].generate(
            model=model, prompt=QUESTION, images=images, options={"num_predict": max_tokens, "temperature": 0}
        ),
    }


def refusal(call: Callable[[], Any]) -> tuple[int, str, Any]:
    """(status, message, the error body as the client parsed it) of a call that must fail with an API error."""
    try:
        call()
    except (openai.APIStatusError, anthropic.APIStatusError) as exc:
        return exc.status_code, exc.message, exc.body
    except ollama.ResponseError as exc:
        return exc.status_code, exc.error, exc.error
    raise AssertionError("the request was answered, not refused")


def prompt_tokens(name: str, answer: Any) -> int:
    """The prompt's token count in the API's usage."""
    if name.startswith("openai chat") and isinstance(answer, list):
        return next(chunk.usage.prompt_tokens for chunk in answer if chunk.usage is not None)
    if name.startswith("openai chat"):
        return answer.usage.prompt_tokens
    if name == "openai responses":
        return answer.usage.input_tokens
    if name == "anthropic messages" or name == "anthropic count_tokens":
        return answer.usage.input_tokens if name == "anthropic messages" else answer.input_tokens
    return answer.prompt_eval_count


def answer_text(name: str, answer: Any) -> str | None:
    """The generated text (None for count_tokens, which generates none)."""
    if name == "openai chat /v3":
        return answer.choices[0].message.content
    if name.startswith("openai chat"):
        return "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
    if name == "openai responses":
        return answer.output_text
    if name == "anthropic messages":
        return "".join(block.text for block in answer.content if block.type == "text")
    if name == "anthropic count_tokens":
        return None
    if name == "ollama chat":
        return answer.message.content
    return answer.response
