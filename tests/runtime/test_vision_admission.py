"""A job's images in the engine process (appliance/server/admit.py, prompts.py, jobs.py): the chat's image parts go
through the model's VisionEncoder in `tokenize`, outside the set-up gate; refusals are 400s naming the refused
image's field in the client's request (PromptSpec.image_fields); num_ctx's message dropping drops the images of the
messages it leaves out (and their fields); the media reach the engine's submission.

A unit test of the admission functions: the engine is a stand-in holding the real parts admission reads (the tiny
VLM export's manifest, tokenizer and VisionEncoder), since the engine that runs a VLM is another part's."""

from __future__ import annotations

import io
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from appliance import protocol as p
from appliance.config import EngineConfig
from appliance.limits import Limits
from appliance.params import SamplingParams
from appliance.runtime.tokenizer import Tokenizer
from appliance.runtime.vision.decode import decode, open_header
from appliance.runtime.vision.encoder import VisionEncoder
from appliance.server.admit import Tokenized, admit, tokenize
from appliance.server.jobs import queue_choices
from appliance.server.slots import Rejected, Slot
from appliance.settings import ModelSpec
from tests import tiny_vlms

QUESTION = "What does the gauge read?"


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    tiny_vlms.image(seed).save(out, "PNG")
    return out.getvalue()


def _slot(out, manifest, vision) -> Slot:
    tokenizer = Tokenizer.from_dir(out)
    engine = SimpleNamespace(
        manifest=manifest,
        tokenizer=tokenizer,
        vision=vision,
        max_context=manifest.max_context,
        backend=SimpleNamespace(max_prompt=None),
        config=EngineConfig(precision="f32"),
        prepare=lambda params: params,
    )
    return Slot(ModelSpec(name="tiny-vlm", model_dir=str(out)), serial=1, state="ready", engine=engine)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def qwen(vlm_export) -> Slot:
    _, out, manifest = vlm_export("qwen2_vl")
    return _slot(out, manifest, VisionEncoder(out, manifest, EngineConfig(precision="f32")))


def _job(messages: list[dict], images: list[bytes] | None, **fields) -> p.Job:
    where = [f"input[{i}].content[0].image_url" for i in range(len(images))] if images else None  # Responses'
    spec = p.PromptSpec(messages=messages, images=images, image_fields=where, conversation_field="input")
    return p.Job(request_id="r", prompts=[spec], params=SamplingParams(max_tokens=4), **fields)


def _user(*images: int, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}


def _refusal(slot: Slot, job: p.Job, limits: Limits | None = None) -> p.Failed:
    with pytest.raises(Rejected) as caught:
        tokenize(job, slot, False, limits or Limits())
    return caught.value.failed


def test_images_become_expanded_ids_and_media(qwen: Slot):
    assert qwen.engine is not None
    messages = [_user(0), {"role": "assistant", "content": "Forty."}, _user(1, text="And now?")]
    job = _job(messages, [_png(0), _png(1)])
    tokenized = tokenize(job, qwen, False, Limits())
    prompt = qwen.engine.tokenizer.encode_chat(messages)
    ids, media = tiny_vlms.prepared(qwen.engine.vision, prompt, [_png(0), _png(1)], Limits().image_pixels)
    assert tokenized.prompts == [ids] and tokenized.media[0] is not None
    assert [s.digest for s in tokenized.media[0].images] == [decode(_png(i), 10**6).digest for i in (0, 1)]
    assert all(np.array_equal(a.features, b.features) for a, b in zip(tokenized.media[0].images, media.images))
    admitted = admit(tokenized, Limits())
    assert admitted.media == tokenized.media and admitted.accepted.prompt_tokens == [len(ids)]  # images counted


def test_a_text_prompt_has_no_media(qwen: Slot):
    tokenized = tokenize(_job([{"role": "user", "content": QUESTION}], None), qwen, False, Limits())
    assert tokenized.media == [None]


def test_num_ctx_drops_the_images_of_the_messages_it_drops(qwen: Slot):
    assert qwen.engine is not None
    last = _user(1, text="And now?")
    messages = [_user(0), {"role": "assistant", "content": "Forty."}, last]
    alone = tiny_vlms.prepared(qwen.engine.vision, qwen.engine.tokenizer.encode_chat([last]), [_png(1)], 10**6)[0]
    both = tokenize(_job(messages, [_png(0), _png(1)]), qwen, False, Limits()).prompts[0]
    window = len(alone) + 1  # the last message with its image fits; not with the first one's too
    assert len(both) >= window
    tokenized = tokenize(_job(messages, [_png(0), _png(1)], context_window=window), qwen, False, Limits())
    media = tokenized.media[0]
    assert tokenized.prompts == [alone] and media is not None and len(media.images) == 1
    assert media.images[0].digest == decode(_png(1), 10**6).digest  # the kept message's image, not the dropped one's
    cut = _refusal(qwen, _job(messages, [_png(0), _png(1)[:300]], context_window=window))  # its field kept too
    assert cut.param == "input[1].content[0].image_url" and "corrupt or truncated" in cut.message, cut
    refused = _refusal(qwen, _job(messages, [_png(0), _png(1)], context_window=len(alone) - 1))
    assert refused.status == 400 and refused.param == "num_ctx" and f"is {len(alone)} tokens" in refused.message


def test_bad_images_are_400s_naming_their_field(qwen: Slot):
    gif = io.BytesIO()
    tiny_vlms.image().save(gif, "GIF")
    first, second = "input[0].content[0].image_url", "input[1].content[0].image_url"
    failed = _refusal(qwen, _job([_user(0)], [gif.getvalue()]))
    assert (failed.status, failed.param) == (400, first) and "GIF images are not accepted" in failed.message
    assert failed.message.startswith(f"{first}: ")
    two = [_user(0), {"role": "assistant", "content": "Forty."}, _user(1)]
    failed = _refusal(qwen, _job(two, [_png(0), _png(1)]), Limits(image_pixels=1000))  # headers: the first
    assert "more than the limit of 1000 pixels" in failed.message and failed.param == first
    failed = _refusal(qwen, _job(two, [_png(0), _png(1)[:300]]))  # decoding: the second, after the first's header
    assert "corrupt or truncated" in failed.message and failed.param == second, failed
    failed = _refusal(qwen, _job([_user(0)], [_png(0), _png(1)]))  # about no one image: the conversation's field
    assert failed == p.Failed(400, "the request has 2 image(s) for 1 image part(s) of its messages", "input")
    generate = _job([_user(0)], [_png(0), _png(1)])  # Ollama generate: its images at `images[i]`, its text `prompt`
    generate.prompts[0] = replace(
        generate.prompts[0], image_fields=["images[0]", "images[1]"], conversation_field="prompt"
    )
    assert _refusal(qwen, generate).param == "prompt"  # the declared field, not the images' root
    too_long = _refusal(qwen, _job([{"role": "user", "content": "x" * 10**6}], None))  # refused before it is encoded
    assert too_long.param == "input" and "characters" in too_long.message, too_long


def test_each_header_is_read_once(qwen: Slot, monkeypatch):
    """Admission reads each image's header once: the plan it makes fits the prompt and then expands it, and only
    the decode opens the file again (decode.py's own parse)."""
    from appliance.runtime.vision import encoder

    reads: list[bytes] = []
    monkeypatch.setattr(encoder, "open_header", lambda data, pixels: reads.append(data) or open_header(data, pixels))
    tokenized = tokenize(_job([_user(0, 1)], [_png(0), _png(1)]), qwen, False, Limits())
    assert reads == [_png(0), _png(1)] and len(tokenized.media[0].images) == 2  # type: ignore[union-attr]


def test_a_prompt_its_images_push_past_the_context_is_refused_before_encoding(qwen: Slot, monkeypatch):
    assert qwen.engine is not None
    text = len(qwen.engine.tokenizer.encode_chat([_user(0)]))
    assert qwen.engine.vision.plans([_png(0)], 10**6)[0].tokens > 3  # the image is more tokens than its placeholder
    monkeypatch.setattr(qwen.engine.vision, "prepare", lambda *a: pytest.fail("an image encoded"))
    slot = replace(qwen, engine=SimpleNamespace(**{**vars(qwen.engine), "max_context": text + 2}))
    failed = _refusal(slot, _job([_user(0)], [_png(0)]))
    assert failed.status == 400 and f"exceeds model max length: {text + 2}" in failed.message, failed.message


def test_a_text_only_model_refuses_images(qwen: Slot):
    text_only = replace(qwen, engine=SimpleNamespace(**{**vars(qwen.engine), "vision": None}))
    failed = _refusal(text_only, _job([_user(0)], [_png(0)]))
    at = "input[0].content[0].image_url"
    assert failed == p.Failed(400, f"{at}: the model 'tiny-vlm' reads text only: images are not supported", at)


def test_media_reach_the_engine_submission(qwen: Slot):
    tokenized: Tokenized = tokenize(_job([_user(0)], [_png(0)]), qwen, False, Limits())
    calls: list[tuple] = []
    engine = SimpleNamespace(
        submit_prompts=lambda requests, **kw: calls.append(("prompts", kw)) or [[object()] for _ in requests],
        submit=lambda ids, params, request_id=None, **kw: calls.append(("submit", kw)) or object(),
    )
    queue_choices(engine, tokenized.job, tokenized.prompts, [], tokenized.media)  # type: ignore[arg-type]
    beams = replace(tokenized.job, params=replace(tokenized.job.params, best_of=2))
    queue_choices(engine, beams, tokenized.prompts, [], tokenized.media)  # type: ignore[arg-type]
    queue_choices(engine, tokenized.job, tokenized.prompts, [], [None])  # type: ignore[arg-type]
    assert calls == [
        ("prompts", {"media": tokenized.media}),
        ("submit", {"media": tokenized.media[0]}),
        ("prompts", {}),  # a text job's submission as it always was
    ]


def test_a_tenant_repeating_an_image_skips_its_encode_and_another_tenant_does_not(vlm_export):
    """The vision feature cache in the request's prefix-cache scope: with `keys` sharing (the default) the same file
    from the same API key is encoded once, from another key (or without a key) anew; with `shared`, every key hits."""
    _, out, manifest = vlm_export("qwen2_vl")
    for sharing, encodes in (("keys", [1, 1, 2, 3]), ("shared", [1, 1, 1, 1])):
        config = EngineConfig(precision="f32", prefix_cache_sharing=sharing)
        slot = _slot(out, manifest, VisionEncoder(out, manifest, config))
        slot.engine.config = config  # type: ignore[union-attr]
        vision = slot.engine.vision  # type: ignore[union-attr]
        counts, prompts = [], []
        for tenant in ("key-a", "key-a", "key-b", ""):
            tokenized = tokenize(_job([_user(0)], [_png(0)], tenant=tenant), slot, False, Limits())
            counts.append(vision.encodes)
            prompts.append((tokenized.prompts, tokenized.media[0].images[0].digest))  # type: ignore[union-attr]
        assert counts == encodes, sharing
        assert all(p == prompts[0] for p in prompts)  # a hit is the same prompt as an encode
