"""OpenAI's request fields, declared once: what api/table.py checks and what docs/openapi.json's request schemas say.

Each `Field` names a JSON type, its bounds (numbers, or `Limits` field names so that a flag moves both the check and
the document), the exact OVMS message of each failure, and the document's description. api/table.py walks these
tables in order (the order is the order of the checks, so of which message a body with several faults gets);
appliance/wsgi/openapi.py writes the request schemas from them. Messages and descriptions are `str.format`
templates over the `Limits` fields (and `name`: the field's own name).

Fields whose value has structure (prompt, messages, stop, logit_bias, ...) are `custom`: their JSON schema is
declared here, their check is the parser they name (parsers.py). A field's `param` is the `SamplingParams` attribute
its value sets (builders default to the field's own name; `param=None`: an edge field); the generation_config.json
key that fills it when unset is declared on that attribute (appliance/params.py `from_model`): a new sampling
parameter is its `Field` here and its `SamplingParams` attribute (tests/api/test_fields.py keeps the two in step). The
`Field` machinery and the walk are appliance/api/table.py (every client API's tables use them). Rules across fields
(stream and stream_options, n and best_of, echo and max_tokens, ...) are code in validation.py and the adapters
completions.py and chat.py, and their JSON-schema form in openapi.py. No numpy here: HTTP workers import this.
"""

from __future__ import annotations

from collections.abc import Callable

from appliance.api import parsers as P
from appliance.api.parsers import GRAMMAR_ROOTS, TOKEN_ID_PATTERN, TOOL_NAME_PATTERN, UINT32_MAX
from appliance.api.table import (
    MODEL,
    Bound,
    Field,
    Kind,
    Max,
    Min,
    boolean,
    custom,
    ignored,
    integer,
    max_tokens,
    number,
)
from appliance.limits import Limits

# ---------------------------------------------------------------- schemas of the structured fields


def _token_ids(minimum: int = 0) -> dict:
    return {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": minimum},
        "description": "Token ids (each below the model's vocabulary size, else 400).",
    }


def _completion_prompt(limits: Limits) -> dict:
    text = {"type": "string", "minLength": 1}
    return {
        "anyOf": [
            text,
            _token_ids(),
            {"type": "array", "minItems": 1, "items": {"anyOf": [text, _token_ids()]}, "maxItems": limits.prompts},
        ]
    }


def _tokenize_prompt(limits: Limits) -> dict:
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": limits.prompts}]}


def _messages(limits: Limits) -> dict:
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    image_part = {
        "type": "object",
        "required": ["type", "image_url"],
        "properties": {
            "type": {"const": "image_url"},
            "image_url": {
                "type": "object",
                "required": ["url"],
                "properties": {
                    "url": {
                        "type": "string",
                        "description": "A data URL (data:image/png;base64,...: JPEG, PNG or WebP, at most "
                        f"{limits.image_bytes} bytes decoded, `--max-image-bytes`), or an http(s) URL on a host "
                        "the operator lists (`--image-url-hosts`; none by default).",
                    },
                    "detail": {
                        "enum": ["auto", "high", None],
                        "description": "auto and high: the model's own resolution; low is refused (no downscaled "
                        "reading).",
                    },
                },
            },
        },
    }
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"type": "string", "minLength": 1},
                "content": {
                    "anyOf": [
                        {"type": "string"},
                        {"type": "array", "items": {"anyOf": [text_part, image_part]}},
                        {"type": "null"},
                    ],
                    "description": "Text, or a list of text parts (joined with newlines) and image_url parts (user "
                    f"and tool messages; at most {limits.images} images per request, `--max-images`: the model's "
                    "chat template places each); null = \"\".",
                },
                "name": {"type": ["string", "null"]},
                "tool_call_id": {"type": ["string", "null"]},
                "tool_calls": {"type": ["array", "null"], "items": {"type": "object"}},
            },
            "additionalProperties": True,
        },
        "maxItems": limits.messages,
    }


def _stream_options(limits: Limits) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "include_usage": {
                "type": ["boolean", "null"],
                "description": "Add `\"usage\": null` to every chunk and, after the finish "
                "chunk, one chunk with `choices: []` and the usage.",
            }
        },
    }


def _stop(limits: Limits) -> dict:
    text = {"type": "string", "maxLength": limits.stop_chars}
    return {"anyOf": [text, {"type": "array", "maxItems": limits.stop_strings, "items": dict(text)}]}


def _stop_token_ids(limits: Limits) -> dict:
    return {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": UINT32_MAX},
        "maxItems": limits.stop_token_ids,
    }


def _logit_bias(limits: Limits) -> dict:
    return {
        "type": "object",
        "propertyNames": {"pattern": f"^({TOKEN_ID_PATTERN})$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "maxProperties": limits.logit_bias,
    }


def _typed(kind: str, properties: dict | None = None, required: tuple[str, ...] = ()) -> dict:
    return {
        "type": "object",
        "required": ["type", *required],
        "properties": {"type": {"const": kind}, **(properties or {})},
    }


def _response_format(limits: Limits) -> dict:
    text = {"type": "string", "minLength": 1, "maxLength": limits.grammar_chars}
    grammar = {"syntax": {"enum": ["lark", "gbnf"]}, "definition": text}
    return {
        "anyOf": [
            _typed("text"),
            _typed("json_object", {"schema": {"type": ["string", "object", "null"]}}),
            _typed(
                "json_schema",
                {
                    "json_schema": {
                        "type": "object",
                        "required": ["schema"],
                        "properties": {
                            "name": {"type": ["string", "null"]},
                            "description": {"type": ["string", "null"]},
                            "schema": {"type": "object"},
                            "strict": {"type": ["boolean", "null"]},
                        },
                    }
                },
                ("json_schema",),
            ),
            _typed("regex", {"schema": text}, ("schema",)),
            _typed("grammar", grammar, ("syntax", "definition")),
            _typed(
                "grammar",
                {"grammar": {"type": "object", "required": ["syntax", "definition"], "properties": grammar}},
                ("grammar",),
            ),
        ]
    }


def _grammar_root(limits: Limits) -> dict:
    return {"type": "string", "enum": [*GRAMMAR_ROOTS, None]}  # null: not set


def _tools(limits: Limits) -> dict:
    function = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": f"^{TOOL_NAME_PATTERN}$"},
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"]},
            "strict": {"type": ["boolean", "null"]},
        },
    }
    return {
        "type": "array",
        "maxItems": limits.tools,
        "items": _typed("function", {"function": function}, ("function",)),
    }


def _tool_choice(limits: Limits) -> dict:
    named = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
    return {"anyOf": [{"enum": ["none", "auto", "required"]}, _typed("function", {"function": named}, ("function",))]}


def _id_lists(count: str) -> Callable[[Limits], dict]:
    """Friendli's stop_tokens / bad_word_tokens: [{"tokens": [ids]}], at most `count` entries."""

    def schema(limits: Limits) -> dict:
        ids = {
            "type": "array",
            "minItems": 1,
            "maxItems": limits.token_sequence,
            "items": {"type": "integer", "minimum": 0, "maximum": UINT32_MAX},
        }
        entry = {"type": "object", "required": ["tokens"], "properties": {"tokens": ids}}
        return {"type": "array", "maxItems": getattr(limits, count), "items": entry}

    return schema


def _bad_words(limits: Limits) -> dict:
    word = {"type": "string", "minLength": 1, "maxLength": limits.stop_chars}
    return {"type": "array", "maxItems": limits.bad_words, "items": word}


def _prediction(limits: Limits) -> dict:
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "additionalProperties": False,
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    content = {
        "anyOf": [{"type": "string", "maxLength": limits.prediction_chars}, {"type": "array", "items": text_part}]
    }
    return {
        "type": "object",
        "required": ["type", "content"],
        "additionalProperties": False,
        "properties": {"type": {"const": "content"}, "content": content},
    }


def _seeds(limits: Limits) -> dict:
    one = {"type": "integer", "minimum": 0, "maximum": UINT32_MAX}
    return {"anyOf": [one, {"type": "array", "minItems": 1, "maxItems": limits.n, "items": one}]}


# ---------------------------------------------------------------- the tables (check order)

MAX_TOKENS_TEXT = (
    "Generated tokens at most (unsigned 32-bit). Also bounded by `--max-tokens-limit` (400 above it) "
    "and by the model's context: prompt + max_tokens over it is a 400 \"Number of prompt tokens: X + "
    "max tokens value: Y exceeds model max length: Z\". Not set: until a stop condition or the end of "
    "the context."
)
OPEN = Min(0, "{name} must be greater than 0", exclusive=True)


SEED = integer(
    "seed",
    "seed is not an integer",
    Min(0, "seed out of range [0, 4294967295]"),
    Max(UINT32_MAX, "seed out of range [0, 4294967295]"),
    description="Choice j of `n` uses seed + j. Not set: a random seed.",
)


def response_format(description: str) -> Field:
    return custom(
        "response_format",
        _response_format,
        "Structured output: the text must match (constrained decoding; docs/serving.md \"Structured output and "
        "parameters of other APIs\"). `text`; `json_object` (any JSON object; Friendli's `schema`, a JSON schema "
        "as a string, too); `json_schema` with `json_schema.schema` (an object); Friendli's `regex` with `schema` "
        "the expression; `grammar` with `syntax` lark or gbnf and `definition` (flat, or nested in `grammar` as "
        "OpenAI's custom tools write it). At most {grammar_chars} characters of schema (canonical JSON), regex or "
        "grammar; one that does not compile is a 400. Not with beam search. " + description,
        parse=P.response_format,
        param="grammar",
    )


# speculative decoding (docs/serving.md "Speculative decoding"): OVMS's request names; they change the speed, never
# the output. OVMS refuses num_assistant_tokens 0; here 0 turns speculation off for the request.
SPECULATION = (
    integer(
        "num_assistant_tokens",
        "num_assistant_tokens is not an unsigned integer",
        Min(0, "num_assistant_tokens out of range [0, {assistant_tokens}]"),
        Max("assistant_tokens", "num_assistant_tokens out of range [0, {assistant_tokens}]"),
        description="Speculative decoding: the draft tokens one step verifies for this request (a draft model "
        "drafts fewer while its drafts fail), at most {assistant_tokens}; 0 = no speculation for this request. "
        "Not set: the model's `--num-assistant-tokens`. Not together with `assistant_confidence_threshold` "
        "(OVMS). A 400 on a model with static shapes or ONNX (they decode one token per step).",
    ),
    number(
        "assistant_confidence_threshold",
        Min(0, "assistant_confidence_threshold must be greater than 0", exclusive=True),
        Max(1, "assistant_confidence_threshold must be less than 1", exclusive=True),
        message="assistant_confidence_threshold must be a positive number",
        description="Draft-model speculative decoding: the draft stops drafting once its next token's probability "
        "falls below this, in (0, 1). Only on a model served with `--draft-model` (else 400); not together with "
        "`num_assistant_tokens` (OVMS).",
    ),
    integer(
        "max_ngram_size",
        "max_ngram_size is not an unsigned integer",
        Min(1, "max_ngram_size out of range [1, {ngram_size}]"),
        Max("ngram_size", "max_ngram_size out of range [1, {ngram_size}]"),
        description="Prompt lookup: the longest n-gram of the latest tokens looked up in the prompt and output, in "
        "[1, {ngram_size}]. On any paged model it turns prompt lookup on for this request. Not set: the model's "
        "`--max-ngram-size`. A 400 on a model with static shapes or ONNX.",
    ),
    custom(
        "prediction",
        _prediction,
        "OpenAI's Predicted Outputs: `{{\"type\": \"content\", \"content\": text or [{{\"type\": \"text\", "
        "\"text\"}}]}}` (parts joined as they are), text the answer is expected to repeat, at most "
        "{prediction_chars} characters. A hint: on a paged model it turns prompt lookup on for this request, "
        "drafting from the prediction too; elsewhere it has no effect. The output is the same either way; "
        "`usage.completion_tokens_details` says how many draft tokens were accepted and rejected.",
        parse=P.prediction,
    ),
)


def generation(max_tokens_fields: tuple[Field, ...], seed: Field = SEED) -> tuple[Field, ...]:
    """The fields completions and chat share, with the endpoint's max_tokens field(s) and seed in their place."""
    return (
        MODEL,
        boolean(
            "stream",
            "Stream is not bool",
            "Answer with Server-Sent Events (`text/event-stream`) instead of one JSON body. Default false.",
            param=None,
        ),
        custom(
            "stream_options",
            _stream_options,
            "Only with `stream: true`; the only key is `include_usage`.",
            parse=P.stream_options,
            param=None,
        ),
        boolean(
            "ignore_eos", "ignore_eos accepts values true or false", "Keep generating past the end-of-sequence token."
        ),
        *max_tokens_fields,
        number(
            "frequency_penalty",
            Min("-penalty", "{name} out of range(-{penalty}, {penalty})"),
            Max("penalty", "{name} out of range(-{penalty}, {penalty})"),
        ),
        number(
            "presence_penalty",
            Min("-penalty", "{name} out of range(-{penalty}, {penalty})"),
            Max("penalty", "{name} out of range(-{penalty}, {penalty})"),
        ),
        number(
            "repetition_penalty",
            OPEN,
            Max("repetition_penalty", "repetition_penalty out of range(0.0, {repetition_penalty}]"),
        ),
        number(
            "length_penalty",
            Min("-length_penalty", "length_penalty out of range(-{length_penalty}, {length_penalty})"),
            Max("length_penalty", "length_penalty out of range(-{length_penalty}, {length_penalty})"),
            description="Beam search (`best_of` > 1): the score of a finished beam is divided by its length to "
            "this power (transformers' `length_penalty`). Default 1.",
        ),
        number(
            "temperature",
            Min(0, "temperature out of range(0.0, {temperature})"),
            Max("temperature", "temperature out of range(0.0, {temperature})"),
            description="0 = greedy. Default: the model's generation_config.json (sampling only with do_sample), "
            "else 0.",
        ),
        number(
            "top_p",
            Min(0, "top_p out of range(0.0, 1.0)"),
            Max(1, "top_p out of range(0.0, 1.0)"),
        ),
        number(
            "min_p",
            Min(0, "min_p out of range [0.0, 1.0)"),
            Max(1, "min_p out of range [0.0, 1.0)", exclusive=True),
        ),
        number(
            "typical_p",
            Min(0, "typical_p out of range(0.0, 1.0]", exclusive=True),
            Max(1, "typical_p out of range(0.0, 1.0]"),
            description="Locally typical sampling (Meister et al. 2022; transformers', llama.cpp's and Ollama's "
            "`typical_p`): keep the tokens whose surprisal is closest to the entropy of the next-token "
            "distribution until they hold this much of its probability, after temperature, top_k, top_p and "
            "min_p (transformers' order). 1 = off (the default); sampling only.",
        ),
        integer(
            "top_k",
            "top_k is not an integer",
            Min(1, "top_k must be -1 (all tokens) or a positive integer"),
            Max(UINT32_MAX, "top_k must be -1 (all tokens) or a positive integer"),
            also=(-1,),
            description="-1 = all tokens. Sampling with no top_k from the request or the model uses 40 (OVMS).",
        ),
        seed,
        custom(
            "stop",
            _stop,
            "Up to {stop_strings} stop strings of at most {stop_chars} characters (empty strings are "
            "ignored). Unary answers leave the stop string out unless `include_stop_str_in_output`; so do "
            "streams on `/v1` (OpenAI's rule), while streams on `/v3` include it (OVMS's) unless "
            "`include_stop_str_in_output` is false.",
            parse=P.stop,
        ),
        boolean(
            "include_stop_str_in_output",
            "include_stop_str_in_output accepts values true or false",
            "Default false, except for streams on `/v3` (OVMS): true. False with `stream: true` streams the "
            "unary answer's text: what may begin a stop string is held back until decided.",
        ),
        boolean("skip_special_tokens", "skip_special_tokens is not a bool", "Default true."),
        custom(
            "stop_token_ids",
            _stop_token_ids,
            "At most {stop_token_ids} token ids, each below the model's vocabulary size (else 400).",
            parse=P.stop_token_ids,
        ),
        integer(
            "min_tokens",
            "min_tokens is not an unsigned integer",
            Min(0),
            Max(UINT32_MAX),
            also=(-1,),
            description="Stop tokens (EOS, `stop_token_ids`) are masked until this many tokens. -1 (Cerebras): "
            "until `max_tokens`, or without it the end of the context.",
        ),
        custom(
            "logit_bias",
            _logit_bias,
            "At most {logit_bias} entries (as OpenAI). Token id (canonical ASCII "
            "decimal: no sign, spaces or leading zeros; at most 4294967295) -> bias "
            "added to its logit; ids outside the vocabulary have no effect.",
            parse=P.logit_bias,
        ),
        number(
            "timeout",
            Min(0, exclusive=True),
            Max("timeout", "timeout must be at most {timeout:g} seconds"),
            message="timeout must be a positive number of seconds",
            description="Seconds, at most {timeout:g} (a day). Past it the request is cancelled and answered 429 "
            "`timeout` (in-band error event if the stream already started).",
            param=None,
        ),
        integer(
            "best_of",
            "best_of is not an integer",
            Min(1, "best_of value should be greater than 0"),
            Max("best_of", "best_of exceeds limit provided in graph config: {best_of}"),
            description="Above 1: beam search with this many beams, answering the `n` best (n <= best_of). Not "
            "together with `stream: true`.",
        ),
        integer(
            "n",
            "n is not an integer",
            Min(1, "n value should be greater than 0"),
            Max("n", "n exceeds limit provided in graph config: {n}"),
            description="Independent choices per prompt (seed + j for choice j). n x prompts (beam search: "
            "prompts) above the server's `--max-queued` is a 400: it could never be queued.",
        ),
        *SPECULATION,
        ignored("user"),
    )


DEPTH_TEXT = (
    "Every string must be valid Unicode (no lone surrogates) and objects and arrays nest at most {depth} "
    "deep (the body is level 1), else 400."
)


def _token_lists(name: str, count: str, description: str, param: str) -> Field:
    return custom(name, _id_lists(count), description, parse=P.token_lists(name, count), param=param)


BAD_WORDS = custom(
    "bad_words",
    _bad_words,
    "Friendli and vLLM: strings never generated (tokenized with and without a leading space); at most {bad_words} "
    "entries (completions: together with `bad_word_tokens`), each at most {stop_chars} characters.",
    parse=P.bad_words,
)

COMPLETION = (
    *generation(
        (max_tokens("max_tokens", positive=False, description=MAX_TOKENS_TEXT),),
        custom(
            "seed",
            _seeds,
            "Choice j of `n` uses seed + j. A list (Friendli): one seed per choice, exactly `n` of them. Not "
            "set: a random seed.",
            parse=P.seeds,
        ),
    ),
    custom(
        "prompt",
        _completion_prompt,
        "A string, a list of strings, token ids, or a list of token-id lists (one "
        "choice set per prompt; at most {prompts} prompts, `--max-prompts`). A text "
        "prompt gets the tokenizer's special tokens (BOS), as in OVMS. Required unless `tokens` is given "
        '("prompt is missing").',
        parse=P.prompts,
        param=None,
    ),
    custom(
        "tokens",
        lambda limits: _token_ids(),
        "Friendli: the prompt as token ids (as `prompt: [ids]`); not together with `prompt`.",
        parse=P.tokens,
        param=None,
    ),
    boolean(
        "echo",
        "echo accepts values true or false",
        "Prefix each choice's text with its prompt (`completion_tokens` excludes it). With echo, `max_tokens: 0` "
        "answers the prompt alone.",
        param=None,
    ),
    integer(
        "logprobs",
        "logprobs is not an integer",
        Min(0, "logprobs out of range [0, {logprobs}]"),
        Max("logprobs", "logprobs out of range [0, {logprobs}]"),
        description="Log-probabilities of the chosen tokens plus this many alternatives (OVMS: 1 only, not "
        "streaming). With `echo`, the prompt's tokens come first, the very first with a null "
        "logprob. `echo` + `logprobs`: prompt tokens x (1 + logprobs) x n may be at most "
        "{prompt_logprobs} per request (`--max-prompt-logprobs`, else 400).",
    ),
    boolean(
        "include_output_logprobs",
        "include_output_logprobs accepts values true or false",
        "Friendli: true = the chosen tokens' logprobs (`logprobs: 0`) when `logprobs` is not set.",
        param=None,
    ),
    response_format("Not together with `grammar_root`."),
    custom(
        "grammar_root",
        _grammar_root,
        "Cerebras: the output is one JSON value of this kind (`value` / `root`: any; `object`, `array`, `string`, "
        "`number`, `integer`, `boolean`, `null`). Roots of Cerebras's own tool-call grammar (`funcall`, "
        "`tool_name`, `tool_args`, ...) are a 400. Not together with `response_format`.",
        parse=P.grammar_root,
        param="grammar",
    ),
    integer(
        "num_beams",
        "num_beams is not an integer",
        Min(1, "num_beams value should be greater than 0"),
        Max("best_of", "num_beams exceeds limit provided in graph config: {best_of}"),
        description="Friendli's name of `best_of` (beam search with this many beams, n <= num_beams); not "
        "together with `best_of`.",
        param="best_of",
    ),
    boolean(
        "early_stopping",
        "early_stopping accepts values true or false",
        "Beam search: true = stop once `best_of` hypotheses finished (transformers). True without beam search is "
        "a 400.",
    ),
    _token_lists(
        "stop_tokens",
        "stop_token_ids",
        "Friendli: `[{{\"tokens\": [ids]}}]`, at most {stop_token_ids} entries of at most {token_sequence} ids: one "
        "id is a stop token (as `stop_token_ids`), several stop when generated in a row.",
        "stop_token_sequences",
    ),
    BAD_WORDS,
    _token_lists(
        "bad_word_tokens",
        "bad_words",
        "Friendli: `[{{\"tokens\": [ids]}}]`: token sequences never generated (at most {token_sequence} ids each).",
        "bad_word_tokens",
    ),
    integer(
        "no_repeat_ngram",
        "no_repeat_ngram is not an unsigned integer",
        Min(0),
        Max("no_repeat_ngram", "no_repeat_ngram out of range [0, {no_repeat_ngram}]"),
        description="Friendli: no n-gram of this size occurs twice in prompt + output; 0 and 1 = off; at most "
        "{no_repeat_ngram}.",
    ),
    integer(
        "max_total_tokens",
        "max_total_tokens is not a positive integer",
        Min(1),
        Max(UINT32_MAX),
        description="Friendli: prompt + generated tokens at most (400 when the prompt leaves no room); not "
        "together with `max_tokens`.",
    ),
    integer(
        "min_total_tokens",
        "min_total_tokens is not an unsigned integer",
        Min(0),
        Max(UINT32_MAX),
        description="Friendli: stop tokens are masked until prompt + generated reach this; at most `max_total_tokens`.",
    ),
    boolean(
        "return_raw_tokens",
        "return_raw_tokens accepts values true or false",
        "Cerebras: each choice carries `tokens`, its generated token ids (stream chunks: the delta's ids).",
        param=None,
    ),
)

CHAT = (
    *generation(
        (
            max_tokens("max_tokens", positive=True, description=MAX_TOKENS_TEXT),
            max_tokens(
                "max_completion_tokens",
                positive=True,
                description="OpenAI's newer name of max_tokens; wins when both are set.",
                param="max_tokens",
            ),
        )
    ),
    custom(
        "messages",
        _messages,
        "At most {messages} messages (`--max-messages`). Only `role`, `content`, `name`, "
        "`tool_call_id` and `tool_calls` reach the chat template; other message fields are "
        "dropped.",
        required="messages missing in request",
        parse=P.messages,
        param=None,
    ),
    boolean("logprobs", "logprobs accepts values true or false", "Log-probabilities of the chosen tokens.", param=None),
    integer(
        "top_logprobs",
        "top_logprobs is not an integer",
        Min(0, "top_logprobs out of range [0, {logprobs}]"),
        Max("logprobs", "top_logprobs out of range [0, {logprobs}]"),
        description="Alternatives per token; needs `logprobs: true`.",
        param=None,
    ),
    response_format(
        "With `tool_choice` required or named the answer is calls only, each constrained by its tool's parameters: "
        "the format then shapes the text of a later turn (tool_choice auto or none)."
    ),
    custom(
        "tools",
        _tools,
        "At most {tools} functions (`{{\"type\": \"function\", \"function\": {{\"name\", \"description\"?, "
        "\"parameters\"?: a JSON schema, \"strict\"?}}}}`), names unique, passed to the chat template.",
        parse=P.tools,
        param=None,
    ),
    custom(
        "tool_choice",
        _tool_choice,
        "`none`, `auto` (default with tools), `required` (at least one call) or `{{\"type\": \"function\", "
        "\"function\": {{\"name\"}}}}` naming one of `tools` (that call); required and named calls are "
        "grammar-constrained to the tool's parameters: the parameters schemas of the tools they may call, at most "
        "{grammar_chars} characters of JSON together (a 400 naming `tools`). Only with `tools` (as OpenAI).",
        parse=P.tool_choice,
        param=None,
    ),
    boolean(
        "parallel_tool_calls",
        "parallel_tool_calls accepts values true or false",
        "false: at most one call per answer. Default true.",
        param=None,
    ),
    BAD_WORDS,
)

TOKENIZE = (
    MODEL,
    custom(
        "prompt",
        _tokenize_prompt,
        "Tokenized with the tokenizer's special tokens, as a completion prompt is. A "
        "list holds at most {prompts} prompts (`--max-prompts`).",
        required="prompt is missing",
        parse=P.tokenize_prompt,
        param=None,
    ),
)

REQUESTS: dict[str, tuple[tuple[Field, ...], str]] = {  # components.schemas name -> (fields, description)
    "CompletionRequest": (
        COMPLETION,
        "OVMS's completions request (`/work/shared/reference/ovms-openai-api.md`). "
        "Unknown fields are accepted (logged at debug level); a JSON null means \"not "
        "set\" for every optional field. " + DEPTH_TEXT,
    ),
    "ChatCompletionRequest": (
        CHAT,
        "Chat completions: the messages go through the model's chat template (engine "
        "side; a template error is a 400 with its message). Unknown fields are accepted. " + DEPTH_TEXT,
    ),
    "TokenizeRequest": (TOKENIZE, DEPTH_TEXT),
}


__all__ = [
    "Bound",
    "Field",
    "Kind",
    "UINT32_MAX",
    "TOKEN_ID_PATTERN",
    "TOOL_NAME_PATTERN",
    "GRAMMAR_ROOTS",
    "COMPLETION",
    "CHAT",
    "TOKENIZE",
    "REQUESTS",
]
