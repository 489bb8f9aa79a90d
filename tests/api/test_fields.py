"""The request-field table (appliance/openai_api/fields.py) and `SamplingParams` stay in step: a sampling parameter
is written in those two places, and this test says when one of them is missing.

Every `Field.param` names a `SamplingParams` attribute; every attribute a request can set has a `Field` (the
engine-only ones are listed here, with why); every `model_default` names a field that sets an attribute; every
structured field carries its parser.
"""

from __future__ import annotations

import dataclasses

from appliance.openai_api import fields as F
from appliance.openai_api.sampling import MODEL_DEFAULTS, to_sampling_params
from appliance.params import SamplingParams

TABLES = {"completions": F.COMPLETION, "chat": F.CHAT, "tokenize": F.TOKENIZE}
# SamplingParams attributes no request field sets directly
ENGINE_ONLY = {
    "prompt_logprobs": "completions echo + logprobs (completions.completion_job)",
    "min_tokens_to_limit": "min_tokens -1 (validation._generation)",
    "prediction_ids": "prediction tokenized engine-side (Engine.prepare)",
    "cache_scope": "the API key's prefix-cache namespace (engine side)",
}


def test_every_param_names_a_sampling_params_attribute():
    attributes = {f.name for f in dataclasses.fields(SamplingParams)}
    for table, fields in TABLES.items():
        for f in fields:
            assert f.param is None or f.param in attributes, (table, f.name, f.param)


def test_every_settable_sampling_params_attribute_has_a_field():
    settable = {f.param for fields in TABLES.values() for f in fields if f.param is not None}
    for attribute in dataclasses.fields(SamplingParams):
        assert (attribute.name in settable) != (attribute.name in ENGINE_ONLY), attribute.name


def test_structured_fields_carry_their_parser_and_defaults_name_a_param():
    for fields in TABLES.values():
        for f in fields:
            assert (f.kind == "custom") == (f.parse is not None), f.name
            assert f.model_default is None or f.param is not None, f.name
    assert MODEL_DEFAULTS["min_tokens"] == "min_new_tokens"


def test_unset_fields_are_the_dataclass_defaults():
    """A request that sets nothing, on a model with no generation_config.json, is SamplingParams() (stop strings
    left out of unary answers: OVMS)."""
    assert to_sampling_params({"include_stop_str_in_output": False}, {}) == SamplingParams()
