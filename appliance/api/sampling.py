"""A request's sampling values -> `SamplingParams`: the request's value, else the model's generation_config.json
(the key the attribute's `from_model` names, appliance/params.py: one declaration for every client API), else the
dataclass default.

Each adapter gives a request's values by `SamplingParams` attribute (`Field.param` via api/table.py's
`sampling_values`, its own rules across fields already applied, e.g. appliance/openai_api/validation.py's: beam n /
best_of, min_tokens -1, include_stop_str_in_output defaulting to `stream`); what depends on the model stays as code
here: generation_config.json only makes sampling the default when it says `do_sample: true` (as in Hugging Face),
and a request that samples with no top_k from request or model gets OVMS's top_k 40 (HF writes top_k 0 for
"disabled"). Values are converted to the attribute's type (tuples to lists, pairs to a dict, ints to floats) by its
annotation, so a new field needs no line here.

The annotations are resolved as types (typing.get_type_hints), never matched as strings: `float | None` is an
Optional float (None stays None, 1 becomes 1.0), however it is spelled. An annotation of a kind this module does not
know how to convert fails at import (`_converter`), so a new field's type is handled or the tests say so.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

from appliance.params import Grammar, SamplingParams

OVMS_DEFAULT_TOP_K = 40  # OVMS: sampling with no top_k given
# SamplingParams attribute -> its generation_config.json key
MODEL_DEFAULTS = {
    f.name: f.metadata["model_default"] for f in dataclasses.fields(SamplingParams) if "model_default" in f.metadata
}
_SCALARS: dict[Any, Callable[[Any], Any]] = {float: float, int: int, bool: bool}
_AS_IS = (str, Grammar)  # values of these types are passed on unchanged


def _same(value: Any) -> Any:
    return value


def _converter(hint: Any) -> Callable[[Any], Any]:
    """The function that turns a validated request value into an attribute of type `hint`; TypeError for a type it
    cannot convert."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:  # Optional[X], X | None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = _converter(rest[0])
            return lambda value: None if value is None else inner(value)
    if hint in _SCALARS:
        return _SCALARS[hint]
    if origin is list and args and typing.get_origin(args[0]) is list:  # list[list[int]]: token id lists
        return lambda value: [list(item) for item in value]
    if origin is list:
        return list
    if origin is dict:
        return dict
    if hint in _AS_IS or origin is typing.Literal:
        return _same
    raise TypeError(f"SamplingParams: no conversion for the annotation {hint!r}")


_CONVERT = {name: _converter(hint) for name, hint in typing.get_type_hints(SamplingParams).items()}


def _typed(name: str, value: Any) -> Any:
    return _CONVERT[name](value)


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
