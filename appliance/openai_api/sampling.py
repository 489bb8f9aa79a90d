"""A request's sampling values -> `SamplingParams`: the request's value, else the model's generation_config.json
(the key its `Field.model_default` names), else the dataclass default.

validation.py gives each request's values by `SamplingParams` attribute (`Field.param`, its own rules across fields
already applied: beam n / best_of, min_tokens -1, include_stop_str_in_output defaulting to `stream`); what depends on
the model stays as code here: generation_config.json only makes sampling the default when it says
`do_sample: true` (as in Hugging Face), and a request that samples with no top_k from request or model gets OVMS's
top_k 40 (HF writes top_k 0 for "disabled"). Values are converted to the attribute's type (tuples to lists, pairs to
a dict, ints to floats) by its annotation, so a new field needs no line here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from appliance.openai_api import fields as F
from appliance.params import SamplingParams

OVMS_DEFAULT_TOP_K = 40  # OVMS: sampling with no top_k given
# SamplingParams attribute -> its generation_config.json key
MODEL_DEFAULTS = {f.param: f.model_default for f in (*F.COMPLETION, *F.CHAT) if f.param and f.model_default}
_TYPES = {f.name: str(f.type) for f in dataclasses.fields(SamplingParams)}


def _typed(name: str, value: Any) -> Any:
    kind = _TYPES[name]
    if kind in ("float", "int", "bool"):
        return {"float": float, "int": int, "bool": bool}[kind](value)
    if kind == "list[list[int]]":
        return [list(ids) for ids in value]
    if kind.startswith("list["):
        return list(value)
    if kind.startswith("dict["):
        return dict(value)
    return value


def to_sampling_params(sampling: dict[str, Any], generation_defaults: dict) -> SamplingParams:
    values = {name: generation_defaults[key] for name, key in MODEL_DEFAULTS.items() if key in generation_defaults}
    values = {name: value for name, value in values.items() if value is not None}
    values.update(sampling)
    if sampling.get("temperature") is None:
        temperature = generation_defaults.get("temperature")
        sample = generation_defaults.get("do_sample")
        values["temperature"] = (1.0 if temperature is None else temperature) if sample else 0.0
    top_k = values.get("top_k")
    if top_k is None or top_k == 0:
        values["top_k"] = OVMS_DEFAULT_TOP_K if values["temperature"] > 0 and top_k is None else -1
    return SamplingParams(**{name: _typed(name, value) for name, value in values.items()})
