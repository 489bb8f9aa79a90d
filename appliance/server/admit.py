"""A job's admission in the engine process: every check that can refuse it before anything is queued, one small
function each, run in the order a client meets their messages (jobs.py queues what passes).

Two steps, because of the set-up gate (setup_gate.py): `tokenize` (the slot ready, a generation model, images only
for a vision-language model, stop-token ids in the vocabulary, the prompts' ids and their images' features:
prompts.py) runs outside it, since the tokenizer drops the GIL and a 600,000-character prompt's 2 s of encoding
held the gate, and so every other tenant's set-up (a victim's completion went from 0.08 to 1.17 s); an image's
encoding (OpenVINO, also without the GIL) holds only its own model's vision lock, and is skipped for a file the
tenant sent before (the vision feature cache, in the tenant's prefix-cache scope). `admit` (bad words and the
prediction tokenized, the tenant's prefix-cache scope, the num_ctx window, the bounds on set-up work and logprob
volume) runs inside it, one job at a time, tenants in turn. A refusal is `Rejected` with the Failed the worker
answers: the request's fault a 400, a model that cannot serve a 503.

Ollama's num_ctx (Job.context_window, at most the model's context) bounds the prompt and the output together:
max_tokens is capped to what is left of the window (a prompt over it: prompts.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from appliance import protocol as p
from appliance.limits import Limits
from appliance.params import SamplingParams
from appliance.runtime.engine.admission import ParamInvalid
from appliance.runtime.vision.errors import ImageRejected
from appliance.server.prompts import echo_text, fitted, image_parts, image_plans, with_media
from appliance.server.slots import Rejected, Slot, not_ready

if TYPE_CHECKING:
    from appliance.runtime.engine import Engine
    from appliance.runtime.media import Media


@dataclass(frozen=True)
class Tokenized:
    """A job whose model can serve it, with its prompts' ids (and texts, for echo): what the set-up gate admits."""

    job: p.Job
    slot: Slot
    engine: Engine
    prompts: list[list[int]]
    echo: list[str] | None
    window: int | None  # num_ctx, at most the model's context
    media: list[Media | None]  # each prompt's images (vision-language models), None for a prompt without


@dataclass(frozen=True)
class Admitted:
    """A job that passed every check, its params prepared for its engine: ready to be queued as it is."""

    job: p.Job
    engine: Engine
    prompts: list[list[int]]
    accepted: p.Accepted
    media: list[Media | None]


def tokenize(job: p.Job, slot: Slot, stopping: bool, limits: Limits) -> Tokenized:
    """The checks before the set-up gate, ending with the prompts' tokenization (and their images' encoding, each
    checked against `limits.image_pixels`); Rejected at the first that fails."""
    engine = ready_engine(slot, stopping)
    check_task(engine, slot.spec.name)
    check_images(job, engine, slot.spec.name)
    check_stop_token_ids(job.params, engine.manifest.vocab_size)
    window = min(job.context_window, engine.max_context) if job.context_window else None
    pixels, scope = limits.image_pixels, cache_scope(job.tenant, engine)
    fits = []
    for spec in job.prompts:  # every prompt's images counted from their headers before any is encoded
        with refusals_named(spec):
            fits.append(fitted(spec, slot, job.params.max_tokens, window, image_plans(spec, engine, pixels)))
    expanded = []
    for ids, spec, images in fits:  # `spec`: the prompt as fitted to num_ctx
        with refusals_named(spec):
            expanded.append(with_media(ids, images, engine, pixels, scope))
    echo: list[str] | None = None
    if job.echo:
        echo = []
        for spec in job.prompts:
            with refusals_named(spec):
                echo.append(echo_text(spec, engine))
    prompts, media = [ids for ids, _ in expanded], [m for _, m in expanded]
    return Tokenized(job, slot, engine, prompts, echo, window, media)


@contextmanager
def refusals_named(spec: p.PromptSpec) -> Iterator[None]:
    """The client's input refused while `spec` is read, as a 400 naming that prompt's own field: an image (its
    format, its pixels, a corrupt file), or text the tokenizer cannot take (the request's fault, not ours)."""
    try:
        yield
    except ImageRejected as exc:
        raise Rejected(image_refusal(exc, spec)) from None
    except (TypeError, ValueError) as exc:
        raise Rejected(p.Failed(400, f"the prompt cannot be tokenized: {exc}", spec.prompt_field)) from None


def admit(t: Tokenized, limits: Limits) -> Admitted:
    """The checks inside the set-up gate, on the job's params as its engine will run them; Rejected at the first
    that fails."""
    params = prepared(t.job.params, t.engine)
    params = scoped(params, t.job.tenant, t.engine)
    params = windowed(params, t.prompts, t.window)
    job = replace(t.job, params=params)
    check_setup(job, t.prompts, t.engine, limits)
    check_generated_logprobs(job, t.prompts, t.engine.max_context, limits)
    check_prompt_logprobs(job, t.prompts, limits)
    accepted = p.Accepted([len(ids) for ids in t.prompts], t.echo, t.slot.serial)
    return Admitted(job, t.engine, t.prompts, accepted, t.media)


def ready_engine(slot: Slot, stopping: bool) -> Engine:
    """The slot's engine, or 503 while it is not ready (loading, failed, unloaded) or the server stops."""
    engine = slot.engine
    if engine is None or slot.state != "ready":
        raise Rejected(not_ready("stopping" if stopping else slot.state))
    return engine


def check_task(engine: Engine, model: str) -> None:
    """400 for an embedding / rerank model (server/encoders/embeddings.py serves those)."""
    task = getattr(engine, "task", "generate")
    if task != "generate":
        raise Rejected(
            p.Failed(
                400,
                f"The model `{model}` is {'an embedding' if task == 'embed' else 'a rerank'} "
                "model: it does not generate text (send it to /v3/embeddings or /v3/rerank, or ask a chat model)",
                "model",
            )
        )


def check_images(job: p.Job, engine: Engine, model: str) -> None:
    """400 for images sent to a text-only model (naming the first image's field), or images that are not the parts
    of the chat's messages."""
    for spec in job.prompts:
        if not spec.images:
            continue
        if engine.vision is None:
            message = f"the model '{model}' reads text only: images are not supported"
            raise Rejected(image_refusal(ImageRejected(message, 0), spec))
        parts = len(image_parts(spec.messages)) if spec.messages is not None else 0
        if parts != len(spec.images):
            message = f"the request has {len(spec.images)} image(s) for {parts} image part(s) of its messages"
            raise Rejected(image_refusal(ImageRejected(message), spec))


def image_refusal(exc: ImageRejected, spec: p.PromptSpec) -> p.Failed:
    """The 400 of an image the engine will not read, naming its field in the client's request (the worker's
    refusals do the same: api/images.py), as the message's start and OpenAI's `param`; a refusal of no one image
    names the field that holds the conversation (PromptSpec.conversation_field: `messages`, Responses' `input`)."""
    fields = spec.image_fields or []
    if exc.image is not None and exc.image < len(fields):
        return p.Failed(400, f"{fields[exc.image]}: {exc}", fields[exc.image])
    return p.Failed(400, str(exc), spec.conversation_field)


def check_stop_token_ids(params: SamplingParams, vocab: int) -> None:
    bad = next((t for t in params.stop_token_ids if t >= vocab), None)
    if bad is not None:
        raise Rejected(
            p.Failed(400, f"stop token id {bad} is out of the vocabulary range [0, {vocab})", "stop_token_ids")
        )


def prepared(params: SamplingParams, engine: Engine) -> SamplingParams:
    """Bad words and the prediction tokenized once for all the request's sequences, off the engine thread."""
    try:
        return engine.prepare(params)
    except (TypeError, ValueError) as exc:  # ParamInvalid names its field; the rest came from bad words
        param = exc.param if isinstance(exc, ParamInvalid) else "bad_words"
        raise Rejected(p.Failed(400, str(exc), param)) from None


def scoped(params: SamplingParams, tenant: str | None, engine: Engine) -> SamplingParams:
    """API keys kept apart in the prefix cache when the engine is configured so."""
    scope = cache_scope(tenant, engine)
    return replace(params, cache_scope=scope) if scope else params


def cache_scope(tenant: str | None, engine: Engine) -> str:
    """The request's namespace in the engine's caches (the prefix cache, the vision feature cache): its API key
    with `--prefix-cache-sharing keys`, else "" (one namespace)."""
    return tenant if tenant and engine.config.prefix_cache_sharing == "keys" else ""


def windowed(params: SamplingParams, prompts: list[list[int]], window: int | None) -> SamplingParams:
    """num_ctx: max_tokens capped to what the longest prompt leaves of the window."""
    if window is None:
        return params
    room = window - max(map(len, prompts))
    if params.max_tokens is None or params.max_tokens > room:
        return replace(params, max_tokens=room)
    return params


def check_setup(job: p.Job, prompts: list[list[int]], engine: Engine, limits: Limits) -> None:
    """Rejected (400) when the request's set-up work on the engine thread (limits.py's `setup_work`: ban tables,
    the prediction's draft index, the no-repeat n-gram index, per sequence) is over the limit."""
    params = job.params
    beam = params.best_of is not None and params.best_of > 1  # beams share their root's tables; no speculation
    per_prompt = 1 if beam else job.n
    bad = sum(map(len, params.bad_word_tokens))
    ngram = params.max_ngram_size or engine.config.max_ngram_size
    predicted = len(params.prediction_ids or ()) * ngram if not beam else 0
    repeat = max(0, params.no_repeat_ngram - 1)
    work = sum((bad + predicted + len(ids) * repeat) * per_prompt for ids in prompts)
    if work > limits.setup_work:
        raise Rejected(
            p.Failed(
                400,
                f"this request's set-up work is {work} positions (per sequence: {bad} bad word tokens + "
                f"{len(params.prediction_ids or ())} prediction tokens x n-gram size {ngram} + prompt tokens x "
                f"(no_repeat_ngram {params.no_repeat_ngram} - 1); {len(prompts) * per_prompt} sequences), more than "
                f"the limit of {limits.setup_work} per request",
                "bad_words" if bad else "prediction" if predicted else "no_repeat_ngram",
            )
        )


def check_generated_logprobs(job: p.Job, prompts: list[list[int]], context: int, limits: Limits) -> None:
    """Rejected (400) when the request could produce more generated logprobs (n x tokens x (1 + logprobs)) than
    the limits table's `generated_logprobs`: the HTTP worker holds them until a unary response is built."""
    k = job.params.logprobs
    if k is None:
        return
    cap = job.params.max_tokens
    tokens = sum(max(0, context - len(ids)) if cap is None else min(cap, context) for ids in prompts)
    volume = tokens * (1 + k) * job.n
    if volume > limits.generated_logprobs:
        raise Rejected(
            p.Failed(
                400,
                f"logprobs: up to {tokens} generated tokens x (1 + {k}) logprobs x n {job.n} = {volume} entries, "
                f"more than the limit of {limits.generated_logprobs} per request (lower max_tokens, n or logprobs)",
                "logprobs",
            )
        )


def check_prompt_logprobs(job: p.Job, prompts: list[list[int]], limits: Limits) -> None:
    """Rejected (400) for echo + logprobs over the limits table's `prompt_logprobs`: an entry per prompt token and
    alternative, per choice."""
    k = job.params.prompt_logprobs
    volume = sum(map(len, prompts)) * (1 + k) * job.n if k is not None else 0
    if volume > limits.prompt_logprobs:
        raise Rejected(
            p.Failed(
                400,
                f"echo with logprobs: {sum(map(len, prompts))} prompt tokens x (1 + {k}) "
                f"logprobs x n {job.n} = {volume} entries, more than the limit of "
                f"{limits.prompt_logprobs} per request",
                "logprobs",
            )
        )
