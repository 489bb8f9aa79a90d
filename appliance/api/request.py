"""The one internal request every client API builds: `EdgeOptions` (what the app itself reads: model, stream,
timeout, n, ...), the set sampling values by `SamplingParams` attribute, and the chat messages or raw prompts, and
the engine `Job` each makes. Chat-shaped requests (OpenAI chat, Responses, Anthropic Messages, Ollama chat) end in
`ChatRequest` -> `chat_job`; raw prompts (OpenAI completions, Ollama generate) in `CompletionRequest` ->
`completion_job`. So a client API is a translation of its body into one of these two and nothing below it changes.

Tools (tool_calls.py): tool_choice "none" passes no tools; "required" and a named tool constrain the output with a
Lark grammar of calls whose arguments follow each tool's parameters schema; a response_format beside them shapes a
later turn's text (`chat_job`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from appliance.api.errors import invalid
from appliance.api.images import split_images
from appliance.api.parsers import Prompt
from appliance.api.tool_calls import GrammarTooLong, tool_grammar
from appliance.limits import Limits
from appliance.params import TOOL_CALL_FORMATS, SamplingParams
from appliance.protocol import Job, PromptSpec

DEFAULT_TOOL_PARSER = TOOL_CALL_FORMATS[0]  # an engine that names none (tool_prompt's default too)


ToolChoice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ChatRequest:
    edge: EdgeOptions
    sampling: dict[str, Any]
    # chat messages; a message with images has list content, each image {"type": "image", "image": images.Image}
    messages: tuple[dict, ...]
    # each {"type": "function", "function": {"name", "description"?, "parameters"?: JSON schema, "strict"?}}
    tools: tuple[dict, ...] = ()
    tool_choice: ToolChoice = "auto"  # "auto" when tools are given and tool_choice is not
    tool_name: str | None = None  # tool_choice "named": the function that must be called
    parallel_tool_calls: bool = True
    # the client's field that holds `messages` (Responses: `input`, Ollama generate: `prompt`), which the engine's
    # refusals of the conversation name (PromptSpec.conversation_field)
    conversation: str = "messages"


@dataclass(frozen=True)
class EdgeOptions:
    """What the app itself reads of a generation request (the rest is `sampling`, for the engine)."""

    model: str
    stream: bool = False
    include_usage: bool = False
    timeout: float | None = None  # seconds; past it the request is cancelled and answered 429
    n: int = 1  # choices per prompt (sampling: n sequences; beam search: SamplingParams.n of one search)
    seeds: tuple[int, ...] | None = None  # Friendli: one seed per choice (len n)
    return_raw_tokens: bool = False  # Cerebras: each choice also carries its token ids (`tokens`)
    unknown: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompletionRequest:
    edge: EdgeOptions
    sampling: dict[str, Any]  # SamplingParams attribute -> the request's value (unset ones absent; sampling.py)
    prompts: tuple[Prompt, ...]
    echo: bool = False


def chat_job(
    req: ChatRequest, params: SamplingParams, request_id: str, tool_parser: str = "", limits: Limits = Limits()
) -> Job:
    """The engine's job. tool_choice required / named: the output is calls only, constrained by the tools' grammar
    (each call's arguments follow its tool's parameters schema). A response_format sent with it (agent frameworks
    send both: an agent with an output type and a forced tool, as openai-agents and instructor's Responses mode do)
    constrains text, and this turn writes none: it shapes the turn that answers in text (the client sends the tool
    results back under tool_choice auto or none, whose grammar is the format), as OpenAI answers the pair. So the
    tools' grammar replaces the format's here and no constraint on this output is lost."""
    tools = list(req.tools) if req.tools and req.tool_choice != "none" else None
    if tools and req.tool_choice in ("required", "named"):
        named = req.tool_name if req.tool_choice == "named" else None
        fmt = tool_parser or DEFAULT_TOOL_PARSER
        try:
            grammar = tool_grammar(
                tools, fmt, parallel=req.parallel_tool_calls, name=named, max_chars=limits.grammar_chars
            )
        except GrammarTooLong as exc:
            raise invalid(str(exc), "tools") from None
        except ValueError as exc:
            raise invalid(str(exc), "tool_choice") from None
        params = replace(params, grammar=grammar)
    messages, images, fields = split_images(req.messages)  # each image a {"type": "image"} part, the files beside
    spec = PromptSpec(
        messages=messages, tools=tools, images=images, image_fields=fields, conversation_field=req.conversation
    )
    return Job(request_id, [spec], params, n=req.edge.n)


def completion_job(req: CompletionRequest, params: SamplingParams, request_id: str) -> Job:
    prompts = [PromptSpec(text=p) if isinstance(p, str) else PromptSpec(token_ids=list(p)) for p in req.prompts]
    if req.echo and params.logprobs is not None:  # echo + logprobs: the echoed prompt's tokens get logprobs too
        params = replace(params, prompt_logprobs=params.logprobs)
    seeds = list(req.edge.seeds) if req.edge.seeds is not None else None  # Friendli: choice j's seed
    return Job(request_id, prompts, params, n=req.edge.n, echo=req.echo, seeds=seeds)
