"""Unit tests of the images every client API takes (appliance/api/images.py) and how each adapter maps them onto
the internal request: `PromptSpec.images` in the order of the `{"type": "image"}` parts of `messages` (Hugging
Face's chat-template convention), and each bound a 400 naming the field. The HTTP side (real clients, a real
server, remote URLs) is tests/e2e/test_image_inputs.py."""

from __future__ import annotations

import base64

import pytest

from appliance.anthropic_api.request import parse_messages
from appliance.api.errors import ApiError
from appliance.api.image_fetch import listed_hosts, vetted
from appliance.api.images import sniff
from appliance.api.request import chat_job
from appliance.api.sampling import to_sampling_params
from appliance.limits import Limits
from appliance.ollama_api.requests import parse_ollama_chat, parse_ollama_generate
from appliance.openai_api.chat import parse_chat
from appliance.openai_api.responses import parse_responses

# the first bytes of each format the engine decodes (the worker reads no more than these)
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + bytes(40)
JPEG = b"\xff\xd8\xff\xe0" + bytes(40)
WEBP = b"RIFF\x24\x00\x00\x00WEBPVP8 " + bytes(40)
GIF = b"GIF89a" + bytes(40)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def spec_of(req) -> tuple[list[dict], list[bytes] | None]:
    job = chat_job(req, to_sampling_params(req.sampling, {}), "r")
    return job.prompts[0].messages, job.prompts[0].images


def fields_of(req) -> list[str] | None:
    """Each image's field in the client's request, which the engine's refusal of it names."""
    return chat_job(req, to_sampling_params(req.sampling, {}), "r").prompts[0].image_fields


def conversation_of(req) -> str:
    """The field that holds the conversation in the client's request, which the engine's refusals of it name."""
    return chat_job(req, to_sampling_params(req.sampling, {}), "r").prompts[0].conversation_field


def refused(fn, *args, words: str) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    assert info.value.status == 400, info.value
    assert words in info.value.message, info.value.message
    return info.value


def openai_chat(*parts, limits=Limits()):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": list(parts)}]}, limits)


def image_url(url: str, **more) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def test_magic_bytes():
    assert [sniff(x) for x in (PNG, JPEG, WEBP, GIF, b"")] == ["image/png", "image/jpeg", "image/webp", None, None]


def test_openai_parts_become_image_parts_in_order():
    jpeg = image_url(data_url(JPEG, "image/jpeg"), detail="high")
    req = openai_chat(image_url(data_url(PNG)), {"type": "text", "text": "and"}, jpeg)
    messages, images = spec_of(req)
    assert messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}
    ]
    assert images == [PNG, JPEG]
    assert fields_of(req) == ["messages[0].content[0].image_url.url", "messages[0].content[2].image_url.url"]


def test_text_only_messages_are_unchanged():
    messages, images = spec_of(openai_chat({"type": "text", "text": "a"}, {"type": "text", "text": "b"}))
    assert messages == [{"role": "user", "content": "a\nb"}] and images is None


def test_a_mislabelled_data_url_is_read_by_its_bytes():
    """OpenAI's clients label files image/jpeg whatever they are; the bytes decide (the engine sniffs too)."""
    _, images = spec_of(openai_chat(image_url(data_url(PNG, "image/jpeg"))))
    assert images == [PNG]


@pytest.mark.parametrize(
    ("part", "words"),
    [
        (image_url(data_url(GIF, "image/gif")), "media type 'image/gif'"),
        (image_url(data_url(GIF)), "not a JPEG, PNG or WebP image"),
        (image_url("data:image/png;base64,%%%"), "not valid base64"),
        (image_url("data:image/png;base64,iVBORw0KGgo"), "not valid base64"),  # unpadded
        (image_url("data:image/png," + "x"), "data:<media type>;base64"),
        (image_url("ftp://example.com/a.png"), "data: URL (base64) or an http(s) URL"),
        (image_url(data_url(PNG), detail="low"), 'detail "low" is not supported'),
        (image_url(data_url(PNG), detail="max"), "detail must be auto, low or high"),
        ({"type": "image_url", "image_url": "x"}, '"image_url": {"url": ...}'),
        ({"type": "input_audio", "input_audio": {}}, "text or image_url parts"),
        ({"type": "image", "image": "x"}, "text or image_url parts"),  # the internal part is not JSON-spellable
    ],
)
def test_openai_refusals(part, words):
    """Each names its field: the message starts with it and OpenAI's `param` is it (a part that is no image at
    all: `messages`)."""
    error = refused(openai_chat, part, words=words)
    assert error.message.startswith(f"{error.param}") and error.message.startswith("messages[0].content[0]")
    assert error.param == "messages" if "text or image_url parts" in words else error.param.startswith("messages[0]")


def test_images_only_in_user_messages():
    body = {"model": "m", "messages": [{"role": "assistant", "content": [image_url(data_url(PNG))]}]}
    refused(parse_chat, body, Limits(), words="images go in user messages")


def test_count_and_size_bounds():
    limits = Limits(images=2, image_bytes=len(PNG))
    with pytest.raises(ApiError) as info:
        openai_chat(*[image_url(data_url(PNG))] * 3, limits=limits)
    assert "messages[0].content[2]: a request may carry at most 2 images (--max-images)" in info.value.message
    assert info.value.param == "messages[0].content[2]"
    with pytest.raises(ApiError) as info:
        openai_chat(image_url(data_url(PNG + b"x")), limits=limits)
    assert f"larger than {len(PNG)} bytes (--max-image-bytes)" in info.value.message


def test_oversize_base64_is_refused_by_its_length_before_decoding():
    """Text far past the bound, and not even base64: the length refuses it first (no decoding of megabytes)."""
    with pytest.raises(ApiError) as info:
        openai_chat(image_url("data:image/png;base64," + "!" * 4000), limits=Limits(image_bytes=1000))
    assert "larger than 1000 bytes" in info.value.message


def test_remote_urls_wait_for_the_fetch():
    """An http(s) URL is kept for the route's fetch (appliance/api/image_fetch.py); a job is never built without
    the file."""
    req = openai_chat(image_url("https://example.com/a.png"))
    with pytest.raises(RuntimeError, match="not fetched"):
        spec_of(req)


def test_responses_input_image():
    body = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is it?"},
                    {"type": "input_image", "image_url": data_url(WEBP, "image/webp"), "detail": "auto"},
                ],
            }
        ],
    }
    req = parse_responses(body, Limits())
    messages, images = spec_of(req.chat)
    assert messages[-1]["content"] == [{"type": "text", "text": "what is it?"}, {"type": "image"}]
    assert images == [WEBP]
    assert conversation_of(req.chat) == "input" and conversation_of(openai_chat(image_url(data_url(PNG)))) == "messages"
    assert req.input_items[0]["content"][1] == {
        "type": "input_image",
        "image_url": data_url(WEBP, "image/webp"),
        "detail": "auto",
    }
    assert fields_of(req.chat) == ["input[0].content[1].image_url"]


def responses_images(*images: dict, text: str = "what?") -> dict:
    content = [{"type": "input_text", "text": text}, *images]
    return {"model": "m", "input": [{"role": "user", "content": "hi"}, {"role": "user", "content": content}]}


@pytest.mark.parametrize(
    ("image", "param", "words"),
    [
        ({"type": "input_image", "file_id": "file_1"}, "input[1].content[1].file_id", "no Files API"),
        ({"type": "input_image", "image_url": data_url(GIF)}, "input[1].content[1].image_url", "not a JPEG, PNG"),
        ({"type": "input_image", "image_url": "data:image/png;base64,%%"}, "input[1].content[1].image_url", "base64"),
        ({"type": "input_image", "image_url": 7}, "input[1].content[1].image_url", "non-empty string"),
        ({"type": "input_image", "image_url": "ftp://a/b.png"}, "input[1].content[1].image_url", "http(s) URL"),
        (
            {"type": "input_image", "image_url": data_url(PNG), "detail": "low"},
            "input[1].content[1].detail",
            '"low" is not supported',
        ),
        (
            {"type": "input_image", "image_url": data_url(PNG + bytes(64))},
            "input[1].content[1].image_url",
            "larger than",
        ),
    ],
)
def test_responses_refusals_name_the_responses_field(image, param, words):
    """OpenAI's Responses API names `input[i].content[j]...` as its `param`, never chat's `messages[...]`."""
    error = refused(parse_responses, responses_images(image), Limits(image_bytes=len(PNG) + 8), words=words)
    assert error.param == param and error.message.startswith(param), error.message


def test_responses_count_the_previous_responses_images():
    """Images of the stored conversation (`previous_response_id`) count towards --max-images with this input's;
    the stored conversation keeps them as chat's image_url parts (JSON)."""
    one = {"type": "input_image", "image_url": data_url(PNG)}
    first = parse_responses(responses_images(one, one), Limits(images=3))
    kept = {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "auto"}}
    assert first.messages[-1]["content"][1:] == [kept, kept]
    error = refused(parse_responses, responses_images(one, one), Limits(images=3), first.messages, words="at most 3")
    assert error.param == "input[1].content[2]"
    again = parse_responses(responses_images(one), Limits(images=3), first.messages)
    assert spec_of(again.chat)[1] == [PNG, PNG, PNG]
    fields = fields_of(again.chat)
    assert fields is not None and fields[2] == "input[1].content[1].image_url"  # this input's, in its own spelling


def anthropic(*content):
    return parse_messages({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": list(content)}]})


def anthropic_image(data: bytes, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": b64(data)}}


def test_anthropic_image_blocks():
    req = anthropic(anthropic_image(JPEG, "image/jpeg"), {"type": "text", "text": "describe"})
    messages, images = spec_of(req.chat)
    assert messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]}]
    assert images == [JPEG]
    assert fields_of(req.chat) == ["messages.0.content.0.source.data"]


def test_anthropic_tool_result_images():
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "shoot"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "camera", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [anthropic_image(PNG)], "is_error": False}
                ],
            },
        ],
    }
    messages, images = spec_of(parse_messages(body).chat)
    assert messages[-1] == {"role": "tool", "tool_call_id": "t1", "content": [{"type": "image"}]}
    assert images == [PNG]


@pytest.mark.parametrize(
    ("block", "words"),
    [
        (anthropic_image(PNG, "image/jpeg"), "the image is image/png, not the declared image/jpeg"),
        (anthropic_image(GIF, "image/gif"), "media type 'image/gif'"),
        ({"type": "image", "source": {"type": "base64", "data": b64(PNG)}}, "media_type: Field required"),
        ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "file sources are not supported"),
        ({"type": "image", "source": {"type": "url", "url": "data:image/png;base64,AA=="}}, "an http(s) URL"),
        ({"type": "image", "source": {"type": "url", "url": "https://a.example/x.png", "y": 1}}, "Extra inputs"),
    ],
)
def test_anthropic_refusals(block, words):
    assert refused(anthropic, block, words=words).message.startswith("messages.0.content.0")


def test_ollama_images():
    body = {"model": "m", "messages": [{"role": "user", "content": "what?", "images": [b64(PNG), b64(JPEG)]}]}
    messages, images = spec_of(parse_ollama_chat(body, Limits()).chat)
    assert messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what?"}]}
    ]
    assert images == [PNG, JPEG]
    assert fields_of(parse_ollama_chat(body, Limits()).chat) == ["messages[0].images[0]", "messages[0].images[1]"]
    req = parse_ollama_generate({"model": "m", "prompt": "what?", "images": [b64(WEBP)]}, Limits())
    messages, images = spec_of(req.chat)
    assert messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    assert images == [WEBP]
    assert [conversation_of(r.chat) for r in (parse_ollama_chat(body, Limits()), req)] == ["messages", "prompt"]


def test_ollama_refusals():
    refused(
        parse_ollama_generate, {"model": "m", "prompt": "x", "raw": True, "images": [b64(PNG)]}, Limits(), words="raw"
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["AA="]}]}
    assert "messages[0].images[0]" in refused(parse_ollama_chat, body, Limits(), words="not valid base64").message
    body = {"model": "m", "messages": [{"role": "user", "content": "x", "images": [b64(PNG)] * 3}]}
    refused(parse_ollama_chat, body, Limits(images=2), words="at most 2 images")


@pytest.mark.parametrize(
    ("address", "ok"),
    [
        ("93.184.215.14", True),
        ("2606:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.50", False),
        ("100.64.0.1", False),
        ("169.254.169.254", False),  # the cloud metadata address
        ("224.0.0.1", False),
        ("0.0.0.0", False),
        ("240.0.0.1", False),
        ("::1", False),
        ("fe80::1%eth0", False),
        ("fd00::2", False),
        ("::ffff:127.0.0.1", False),
        ("ff02::1", False),
    ],
)
def test_vetted_addresses(address, ok):
    assert vetted(address) is ok


def test_listed_hosts():
    assert listed_hosts(None) == frozenset()
    assert listed_hosts(" Images.Example.com, [2001:db8::1] ,") == {"images.example.com", "2001:db8::1"}
