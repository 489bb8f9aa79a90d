"""Structured output (runtime/grammar.py): the compiler's errors and cache, the matcher, the mask on fake logits,
and the engine through its Python API on the default model: outputs match their JSON schema / regex / Lark / GBNF
grammar, greedy and sampled, with n > 1, streaming and logprobs; invalid grammars and beam search are refused."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from appliance.manifest import Manifest
from appliance.params import Grammar, SamplingParams
from appliance.runtime import grammar as grammar_mod
from appliance.runtime.engine import Engine
from appliance.runtime.grammar import GrammarCompiler, GrammarError, apply_grammar_masks
from appliance.runtime.sampling import SequenceSampler, apply_processors

EOS = 2  # the default model's <|im_end|>


@pytest.fixture(scope="module")
def compiler(model_dir) -> GrammarCompiler:
    m = Manifest.load(model_dir)
    return GrammarCompiler(model_dir / m.tokenizer_file, m.vocab_size, [EOS])


def ids_of(compiler: GrammarCompiler, text: str) -> list[int]:
    return compiler.tokenizer.tokenize_str(text)


# ---------------------------------------------------------------- the compiler and the matcher


@pytest.mark.parametrize(
    "kind, text, message",
    [
        ("regex", "[a-z", 'invalid regex "[a-z": unclosed character class'),
        ("json_schema", '{"type": "foo"}', "invalid JSON schema: Invalid type: foo"),
        ("json_schema", '{"type": "string", "format": "bogus"}', "invalid JSON schema: Unknown format: bogus"),
        ("json_schema", "{not json", "invalid JSON schema: "),
        ("lark", "start: foo", 'invalid Lark grammar: at 1(8): unknown name: "foo"'),
        ("gbnf", "root ::= foo", "invalid GBNF grammar: Rule 'foo' not found"),
    ],
)
def test_invalid_grammars_raise_a_readable_error(compiler, kind, text, message):
    with pytest.raises(GrammarError) as err:
        compiler.check(Grammar(kind, text))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)  # a 400 wherever ValueErrors are


def test_compiled_grammars_are_cached_and_bounded(compiler, monkeypatch):
    g = Grammar("regex", "cached[0-9]")
    compiler.check(g)
    assert compiler._cache.get(g) is compiler._prototype(g)  # the second use compiles nothing
    monkeypatch.setattr(grammar_mod, "GRAMMAR_CACHE_SIZE", 2)
    for i in range(3):
        compiler.check(Grammar("regex", f"x{i}"))
    assert len(compiler._cache) == 2 and g not in compiler._cache
    assert not compiler.matcher(g).finished  # an evicted grammar compiles again


def test_matcher_consumes_finishes_and_rejects(compiler):
    m = compiler.matcher(Grammar("regex", "yes|no"))
    assert not m.finished
    for t in ids_of(compiler, "yes"):
        m.consume(t)
    assert m.finished  # nothing but EOS can follow
    other = compiler.matcher(Grammar("regex", "yes|no"))
    with pytest.raises(RuntimeError, match="grammar rejected token"):
        other.consume(ids_of(compiler, "maybe")[0])


def allowed(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(row)).tolist())


def test_masks_apply_to_grammar_rows_only_and_win_over_earlier_masks(compiler):
    V = compiler.n_vocab
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, V)).astype(np.float32)
    seqs = [SequenceSampler(SamplingParams()) for _ in range(3)]
    seqs[0].grammar = compiler.matcher(Grammar("regex", "[0-9]+"))
    seqs[2].grammar = compiler.matcher(Grammar("regex", "a"))
    seqs[2].grammar.consume(ids_of(compiler, "a")[0])  # only EOS may follow now
    x = logits.copy()
    x[2, EOS] = -np.inf  # an earlier mask (min_tokens) took the only allowed token
    apply_grammar_masks(x, logits, seqs)
    assert np.array_equal(x[1], logits[1])  # no grammar: untouched
    digits = allowed(x[0])
    assert EOS not in digits and digits  # nothing accepted yet: no EOS
    assert all(compiler.tokenizer.decode_str([t]).isdigit() for t in digits)
    assert np.array_equal(x[0, sorted(digits)], logits[0, sorted(digits)])  # allowed values unchanged
    assert allowed(x[2]) == {EOS} and x[2, EOS] == logits[2, EOS]  # the grammar wins: raw logit under its mask


def test_min_tokens_cannot_push_a_finished_grammar_past_eos(compiler):
    """The sampler's own dead-row fallback must not undo the grammar: EOS is the one token left."""
    s = SequenceSampler(SamplingParams(min_tokens=5), eos_ids=[EOS])
    s.grammar = compiler.matcher(Grammar("regex", "a"))
    s.append(ids_of(compiler, "a")[0])
    logits = np.random.default_rng(1).standard_normal((1, compiler.n_vocab)).astype(np.float32)
    x = apply_processors(logits, [s])
    assert allowed(x[0]) == {EOS}


# ---------------------------------------------------------------- the engine (Python API, default model)

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["colors", "score"],
    },
    {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 20}},
                "required": ["name"],
            },
            "ok": {"type": "boolean"},
        },
        "required": ["city", "ok"],
    },
]


@pytest.fixture(scope="module")
def engine(model_dir):
    e = Engine(model_dir)
    yield e
    e.shutdown()


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)


def run(engine: Engine, text: str, grammar: Grammar, **kw):
    params = SamplingParams(**{"max_tokens": 80, "grammar": grammar, **kw})
    return engine.submit(chat(engine, text), params).results()[0]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("sampled", [False, True])
def test_json_schema_output_validates(engine, schema, sampled):
    kw = {"temperature": 1.0, "seed": 7} if sampled else {}
    r = run(engine, "Answer in JSON.", Grammar("json_schema", json.dumps(schema)), **kw)
    assert r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.text), schema)


def test_regex_lark_and_gbnf_outputs_match(engine):
    r = run(engine, "What is your phone number?", Grammar("regex", r"\d{3}-\d{4}"))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.text) and r.finish_reason == "stop"
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    r = run(engine, "Is the sky blue?", Grammar("lark", lark), temperature=1.0, seed=3)
    assert r.text in ("The answer is yes.", "The answer is no.") and r.finish_reason == "stop"
    gbnf = 'root ::= item ("," item){2}\nitem ::= [a-z]{1,12}'  # bounded: it ends within max_tokens, whatever
    r = run(engine, "List three fruits.", Grammar("gbnf", gbnf))  # the model's numerics (bf16 or f32) favour
    assert re.fullmatch(r"[a-z]+(,[a-z]+){2}", r.text) and r.finish_reason == "stop"


def test_a_stop_string_cuts_grammar_output(engine):
    r = run(engine, "Name three animals.", Grammar("regex", "[a-z]{1,8} [a-z]{1,8} [a-z]{1,8}"), stop=[" "])
    assert re.fullmatch("[a-z]{1,8}", r.text) and r.finish_reason == "stop"


def test_lark_embeds_a_json_schema(engine):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    schema |= {"additionalProperties": False, "x-guidance": layout}
    lark = f'start: "<call>" obj "</call>"\nobj: %json {json.dumps(schema)}'
    r = run(engine, "Call the tool.", Grammar("lark", lark))
    assert r.text.startswith("<call>") and r.text.endswith("</call>")
    assert isinstance(json.loads(r.text[len("<call>") : -len("</call>")])["x"], int)


def test_n_choices_each_follow_the_grammar(engine):
    schema = SCHEMAS[0]
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, grammar=Grammar("json_schema", json.dumps(schema)))
        for s in range(3)
    ]
    for h in engine.submit_choices(chat(engine, "Give me a person as JSON."), params):
        r = h.results()[0]
        jsonschema.validate(json.loads(r.text), schema)


def test_streaming_logprobs_and_ignore_eos(engine):
    """The streamed text is the grammar's text; logprobs stay the model's raw ones; a finished grammar ends the
    choice "stop" even with ignore_eos, and no text follows it."""
    g = Grammar("json_schema", json.dumps(SCHEMAS[0]))
    params = SamplingParams(max_tokens=80, grammar=g, logprobs=2, ignore_eos=True, min_tokens=60)
    chunks = list(engine.submit(chat(engine, "Give me a person as JSON."), params))
    text = "".join(c.text for c in chunks)
    jsonschema.validate(json.loads(text), SCHEMAS[0])
    assert chunks[-1].finish_reason == "stop" and sum(len(c.token_ids) for c in chunks) < 60
    lps = [lp for c in chunks for lp in c.logprobs or []]
    assert lps and all(lp.logprob is not None and lp.logprob <= 0 for lp in lps)
    # greedy under the mask: had logprobs been the masked ones, every chosen token would be their top one
    assert all(lp.top for lp in lps) and any(lp.top[0][0] != lp.token_id for lp in lps)


def test_max_tokens_cuts_mid_json_with_length(engine):
    r = run(engine, "Give me a person as JSON.", Grammar("json_schema", json.dumps(SCHEMAS[0])), max_tokens=4)
    assert r.finish_reason == "length" and r.completion_tokens == 4 and r.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


def test_invalid_grammars_and_beam_search_are_refused_on_submit(engine):
    ids = chat(engine, "hi")
    for g in (Grammar("json_schema", '{"type": "foo"}'), Grammar("regex", "(a"), Grammar("lark", "start: x")):
        with pytest.raises(GrammarError):
            engine.submit(ids, SamplingParams(max_tokens=4, grammar=g))
    with pytest.raises(ValueError, match="beam search"):
        engine.submit(ids, SamplingParams(max_tokens=4, best_of=2, grammar=Grammar("regex", "a+")))
