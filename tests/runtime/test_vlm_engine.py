"""The engine serves a vision-language export: greedy tokens equal transformers' in f32 for both families (Qwen2-VL
with M-RoPE, Idefics3 with tiles), with prompts' image rows under continuous batching, chunked prefill and
preemption, and the prefix cache keyed by the picture (RAM and disk tier).

The image features and M-RoPE positions are made here with transformers (the model's own vision tower and rope
index), so these tests check the engine alone; the exported vision parts are checked by tests/export/test_vlm.py.
The tiny models are built from configs and exported once per module (tests/tiny_vlms.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.manifest import Manifest
from appliance.params import SamplingParams
from appliance.runtime.engine import Engine
from appliance.runtime.media import ImageSpan, Media
from tests import tiny_vlms

NEW_TOKENS = 12
F32 = dict(precision="f32")
QUESTION = "What does the gauge read? Answer with the number on its display, please."


@dataclass
class Prompt:
    """One prompt as the engine takes it, and what transformers' generate takes for the same prompt."""

    ids: list[int]
    media: Media | None
    hf: dict[str, Any]


class Family:
    """A tiny exported VLM and its transformers twin: prompts with images, and transformers' greedy tokens."""

    def __init__(self, name: str, root: Path):
        import torch
        from transformers import AutoModelForImageTextToText

        from export.vlm import export_vlm

        self.name = name
        self.src = tiny_vlms.build(name, root / name)
        self.out = root / f"{name}-openvino-fp32"
        export_vlm(self.src, self.out, "openvino", "fp32")
        self.manifest = Manifest.load(self.out)
        self.model = AutoModelForImageTextToText.from_pretrained(self.src, dtype=torch.float32).eval()

    def prompt(self, messages: list[dict], images: list[Any]) -> Prompt:
        return self._qwen2_vl(messages, images) if self.name == "qwen2_vl" else self._idefics3(messages, images)

    def _qwen2_vl(self, messages: list[dict], images: list[Any]) -> Prompt:
        import torch
        from transformers import AutoTokenizer, Qwen2VLImageProcessor

        tokenizer = AutoTokenizer.from_pretrained(self.src)
        text = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        hf: dict[str, Any] = {}
        features: list[np.ndarray] = []
        if images:
            pre = Qwen2VLImageProcessor.from_pretrained(self.src)(images=images, return_tensors="pt")
            grid = pre["image_grid_thw"]
            parts = text.split("<|image_pad|>")
            assert len(parts) == len(images) + 1
            counts = [int(g.prod()) // 4 for g in grid]  # one token per 2x2 merged patches
            text = parts[0] + "".join("<|image_pad|>" * n + part for n, part in zip(counts, parts[1:]))
            hf = {"pixel_values": pre["pixel_values"], "image_grid_thw": grid}
            with torch.no_grad():
                features = [f.numpy() for f in self.model.model.get_image_features(pre["pixel_values"], grid)]
        ids = tokenizer(text)["input_ids"]
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            positions, delta = self.model.model.get_rope_index(
                input_ids, hf.get("image_grid_thw"), None, torch.ones_like(input_ids)
            )
        media = Media(
            _spans(ids, self.manifest, features, images),
            len(ids),
            mrope=positions[:, 0].numpy().astype(np.int64),
            rope_delta=int(delta.reshape(-1)[0]),
        )
        return Prompt(ids, media, {"input_ids": input_ids, **hf})

    def _idefics3(self, messages: list[dict], images: list[Any]) -> Prompt:
        import torch
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(self.src)
        text = str(processor.apply_chat_template(messages, add_generation_prompt=True))
        inputs = processor(text=text, images=[images] if images else None, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        hf: dict[str, Any] = {"input_ids": inputs["input_ids"]}
        if not images:
            return Prompt(ids, None, hf)
        hf |= {"pixel_values": inputs["pixel_values"], "pixel_attention_mask": inputs["pixel_attention_mask"]}
        with torch.no_grad():
            tiles = self.model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])
        rows = tiles.reshape(-1, self.manifest.hidden_size).numpy()
        return Prompt(ids, Media(_spans(ids, self.manifest, [rows], images), len(ids)), hf)

    def generate(self, prompt: Prompt, new_tokens: int = NEW_TOKENS) -> list[int]:
        """transformers' greedy tokens (eos ignored, as the engine's ignore_eos)."""
        return self.sequences(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None)[0]

    def sequences(self, prompt: Prompt, **options: Any) -> list[list[int]]:
        """transformers' generate(**options) on the prompt, without sampling: each returned sequence's new tokens."""
        import torch

        ids = prompt.hf["input_ids"]
        with torch.no_grad():
            out = self.model.generate(
                **prompt.hf, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **options
            )
        return [row[ids.shape[1] :].tolist() for row in out]


def _spans(ids: list[int], manifest: Manifest, features: list[np.ndarray], images: list[Any]) -> tuple[ImageSpan, ...]:
    """The runs of image tokens in `ids`, each with its rows of the images' features (in order) and a key from
    its image's pixels (an Idefics3 image is several runs, one per tile: each run gets its own digest)."""
    assert manifest.vision is not None
    mask = np.asarray(ids) == manifest.vision.image_token_id
    rows = np.concatenate(features) if features else np.zeros((0, manifest.hidden_size), np.float32)
    assert mask.sum() == len(rows)
    starts = [i for i in range(len(ids)) if mask[i] and (i == 0 or not mask[i - 1])]
    spans, used = [], 0
    per_image = len(starts) // max(len(images), 1)
    for j, start in enumerate(starts):
        end = start
        while end < len(ids) and mask[end]:
            end += 1
        pixels = np.asarray(images[j // per_image]).tobytes()
        digest = hashlib.blake2b(pixels + j.to_bytes(4, "little")).digest()
        spans.append(ImageSpan(start, end - start, digest, rows[used : used + end - start].astype(np.float32)))
        used += end - start
    return tuple(spans)


def _user(text: str, images: int = 0) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}


@pytest.fixture(scope="module", params=tiny_vlms.FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp("vlm"))


def _prompts(family: Family) -> dict[str, Prompt]:
    one, two = tiny_vlms.image(1), tiny_vlms.image(2)
    turns = [_user(QUESTION, 1), {"role": "assistant", "content": "It reads 42."}, _user("And in Fahrenheit?")]
    return {  # image prompts last: the newest running sequences are the first preempted
        "text": family.prompt([_user("Say something about gauges.")], []),
        "text 2": family.prompt([_user(QUESTION)], []),
        "one image": family.prompt([_user(QUESTION, 1)], [one]),
        "two images": family.prompt([_user("Which of the two gauges reads higher?", 2)], [one, two]),
        "multi-turn": family.prompt(turns, [one]),
    }


def _run(engine: Engine, prompts: dict[str, Prompt]) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    handles = {k: engine.submit(p.ids, params, media=p.media) for k, p in prompts.items()}  # batched together
    return {k: h.results()[0].token_ids for k, h in handles.items()}


def test_greedy_equals_transformers_batched_and_chunked(family: Family) -> None:
    """Every prompt at once (image prompts batched with text-only ones) in prefill chunks of 7 tokens, so that
    chunks cut image spans in the middle: each one's greedy tokens equal transformers' for it alone."""
    prompts = _prompts(family)
    assert max(s.length for p in prompts.values() if p.media for s in p.media.images) > 1  # a span 7 can cut
    expected = {k: family.generate(p) for k, p in prompts.items()}
    engine = Engine(family.out, EngineConfig(**F32, max_num_batched_tokens=7))
    try:
        assert _run(engine, prompts) == expected
    finally:
        engine.shutdown()


def test_greedy_equals_transformers_preempted(family: Family) -> None:
    """A KV pool too small for the prompts together: sequences are preempted and recompute their image rows."""
    prompts = _prompts(family)
    longest = max(len(p.ids) for p in prompts.values()) + NEW_TOKENS
    # every sequence fits alone, two do not: prefills of 16 tokens admit the next one while the first decodes
    cfg = EngineConfig(**F32, kv_cache_tokens=longest + 32, max_num_batched_tokens=16, prefix_caching=False)
    engine = Engine(family.out, cfg)
    preempted = []
    preempt = engine.scheduler.preempt  # observed, not replaced: which sequences recompute their prompt

    def observe(seq: Any) -> None:
        preempted.append(seq.media is not None)
        preempt(seq)

    engine.scheduler.preempt = observe  # type: ignore[method-assign]
    try:
        got = _run(engine, prompts)
        assert any(preempted)  # an image prompt was preempted and fed its rows again
    finally:
        engine.shutdown()
    assert got == {k: family.generate(p) for k, p in prompts.items()}


PREFIX = "Here is a photo from the boiler room camera, taken this morning before the shift started."


def _cached(engine: Engine, prompt: Prompt) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens the prefix cache supplied (usage.prompt_tokens_details.cached_tokens)."""
    handle = engine.submit(prompt.ids, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), media=prompt.media)
    chunks = [chunk for _, chunk in handle.events()]
    assert not chunks[-1].error
    return [t for c in chunks for t in c.token_ids], chunks[-1].cached_tokens


def test_prefix_cache_keys_images_by_picture(family: Family, tmp_path: Path) -> None:
    """The same picture again is a hit through its image's full blocks; another picture behind the same token ids
    hits only the text before it. A fresh engine on the same disk directory follows the same rule."""
    message = {
        "role": "user",
        "content": [{"type": "text", "text": PREFIX}, {"type": "image"}, {"type": "text", "text": QUESTION}],
    }
    same = family.prompt([message], [tiny_vlms.image(1)])
    other = family.prompt([message], [tiny_vlms.image(3)])
    assert same.ids == other.ids and same.media is not None and other.media is not None
    cfg = EngineConfig(**F32, kv_disk_dir=str(tmp_path))
    engine = Engine(family.out, cfg)
    bs = engine.pool.block_size
    first, last = same.media.images[0].start, same.media.images[-1].end
    assert first >= bs and len(same.ids) > last + 1  # a full block of text before the image, and text after it
    before, through = first // bs * bs, (len(same.ids) - 1) // bs * bs  # what a hit can cover of each prompt
    try:
        want, cold = _cached(engine, same)
        again, hit = _cached(engine, same)
        changed, miss = _cached(engine, other)
    finally:
        engine.shutdown()
    assert (cold, hit, miss) == (0, through, before) and through >= last > before  # the image, all of it, or none
    assert again == want and want == family.generate(same) and changed == family.generate(other)
    third = family.prompt([message], [tiny_vlms.image(4)])  # a picture the disk has never seen
    restarted = Engine(family.out, cfg)  # RAM empty: what hits comes from the disk tier
    try:
        new, new_hit = _cached(restarted, third)
        text_blocks = restarted.stats()["kv_disk_hit_blocks"]
        again_disk, hit_disk = _cached(restarted, same)
        stats = restarted.stats()
    finally:
        restarted.shutdown()
    assert (new_hit, text_blocks) == (before, before // bs) and new == family.generate(third)
    assert hit_disk == through and stats["kv_disk_hit_blocks"] == through // bs, stats  # the text blocks in RAM now
    assert again_disk == want


def test_choices_beams_and_prompt_lists_share_the_images(family: Family) -> None:
    """n > 1 choices fork the leader's prompt (M-RoPE decode positions from the shared Media), beams fork each
    other, a prompt list carries media per prompt: each equals transformers (greedy; beam search with eos)."""
    prompts = _prompts(family)
    image, text = prompts["one image"], prompts["text"]
    assert image.media is not None
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = Engine(family.out, EngineConfig(**F32))
    try:
        eos = engine.eos_token_ids
        choices = engine.submit_choices(image.ids, [greedy, greedy], media=image.media)
        beams = engine.submit(image.ids, SamplingParams(max_tokens=NEW_TOKENS, best_of=3, n=2), media=image.media)
        listed = engine.submit_prompts([(image.ids, [greedy], None), (text.ids, [greedy], None)], [image.media, None])
        got_choices = [h.results()[0].token_ids for h in choices]
        got_beams = [r.token_ids for r in beams.results()]
        got_listed = [h[0].results()[0].token_ids for h in listed]
        with pytest.raises(ValueError, match="laid out for"):
            engine.submit(image.ids[:-1], greedy, media=image.media)
        span = image.media.images[0]
        with pytest.raises(ValueError, match="image tokens"):
            engine.submit(
                image.ids[: span.start] + image.ids[:1] + image.ids[span.start + 1 :], greedy, media=image.media
            )
        narrow = replace(span, features=span.features[:, :-1])
        with pytest.raises(ValueError, match="image features must be"):
            engine.submit(image.ids, greedy, media=replace(image.media, images=(narrow, *image.media.images[1:])))
        with pytest.raises(ValueError, match="1 media for 2 prompts"):
            engine.submit_prompts([(image.ids, [greedy], None), (text.ids, [greedy], None)], [image.media])
    finally:
        engine.shutdown()
    want = family.generate(image)
    assert got_choices == [want, want] and got_listed == [want, family.generate(text)]
    beam_options = dict(num_beams=3, num_return_sequences=2, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    assert got_beams == [_until_eos(s, eos) for s in family.sequences(image, **beam_options)]


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    cut = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if cut is None else tokens[: cut + 1]


def test_a_text_model_takes_no_images(model_dir: Path) -> None:
    engine = Engine(model_dir)
    try:
        media = Media((), 3)
        with pytest.raises(ValueError, match="reads text only"):
            engine.submit([1, 2, 3], SamplingParams(max_tokens=1), media=media)
    finally:
        engine.shutdown()


def test_speculative_drafts_take_decode_positions(family: Family) -> None:
    """Draft tokens past an image prompt (a predicted output, verified in one step) sit at index + rope_delta on
    every M-RoPE axis: a right prediction is accepted and a wrong one rejected, the tokens unchanged."""
    image = _prompts(family)["two images"]
    want = family.generate(image)
    engine = Engine(family.out, EngineConfig(**F32, speculation_max_batch=8))
    engine.speculation.policy = None  # every step drafts, whatever the box's step costs
    drafts = []
    try:
        for prediction in (want, want[:1] + [want[0] + 1] * (NEW_TOKENS - 1)):
            before = engine.counters["draft_tokens"], engine.counters["accepted_draft_tokens"]
            params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, prediction_ids=prediction)
            assert engine.submit(image.ids, params, media=image.media).results()[0].token_ids == want
            drafts.append(
                (engine.counters["draft_tokens"] - before[0], engine.counters["accepted_draft_tokens"] - before[1])
            )
    finally:
        engine.shutdown()
    assert drafts[0][1] > 0 and drafts[1][0] > drafts[1][1], drafts
