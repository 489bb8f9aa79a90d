"""The machinery of every client API's request table: a `Field` (JSON type, bounds, the exact message of each
failure, the document's description, the `SamplingParams` attribute its value sets), its builders, and the walk
that reads a JSON body against a table (`read_body`). Each API declares its own table with these (OpenAI's in
appliance/openai_api/fields.py, Anthropic's in appliance/anthropic_api/request.py) and its own rules across fields;
this module keeps what they share, so a new client API is a table and a module, not a copy of the walk.

Every bound comes from `appliance.limits.Limits`, and every bad input is a 400 here, never an exception further
down: one walk over the parsed body refuses strings that are not valid Unicode (a lone surrogate would fail in the
tokenizer, engine-side) and nesting deeper than `Limits.depth`; numbers too large for a float are refused as
numbers. A JSON null means "not set" for every optional field. Unknown fields are accepted and reported in
`unknown` (the app logs them at debug). No numpy here: HTTP workers import this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from appliance.api import parsers as P
from appliance.api.errors import invalid
from appliance.api.parsers import UINT32_MAX, finite, is_int
from appliance.limits import Limits

Kind = Literal["boolean", "integer", "number", "string", "any", "custom"]


@dataclass(frozen=True)
class Bound:
    """One bound, checked in the order a field lists them. `value`: a number, or a `Limits` field name ("-penalty":
    minus that field; a limit that is None is no bound). `message`: None means the field's type message."""

    side: Literal["min", "max"]
    value: int | float | str
    message: str | None = None
    exclusive: bool = False

    def resolve(self, limits: Limits) -> int | float | None:
        if not isinstance(self.value, str):
            return self.value
        sign, name = (-1, self.value[1:]) if self.value.startswith("-") else (1, self.value)
        value = getattr(limits, name)
        return None if value is None else sign * value


def Min(value: int | float | str, message: str | None = None, *, exclusive: bool = False) -> Bound:  # noqa: N802
    return Bound("min", value, message, exclusive)


def Max(value: int | float | str, message: str | None = None, *, exclusive: bool = False) -> Bound:  # noqa: N802
    return Bound("max", value, message, exclusive)


SAME = "="  # `Field.param`'s default: the SamplingParams attribute of the field's own name


@dataclass(frozen=True)
class Field:
    """One request field. A JSON null means "not set" (optional fields) or missing (`required` ones).

    `param`: the `SamplingParams` attribute the field's value sets, by default the one of its own name (None: an
    edge field, read by the app or by a rule across fields); `sampling_values` passes every set value to it,
    appliance/api/sampling.py builds the `SamplingParams` (with the model's defaults, declared on the attribute)."""

    name: str
    kind: Kind
    message: str = ""  # wrong type (and any failed bound without a message of its own)
    bounds: tuple[Bound, ...] = ()
    also: tuple[int, ...] = ()  # values accepted outside the bounds (top_k: -1)
    required: str | None = None  # the message when missing; None: optional
    description: str = ""
    schema: Callable[[Limits], dict] | None = None  # custom fields: the JSON schema (nullable added if optional)
    parse: P.Parser | None = None  # custom fields: the check (parsers.py)
    param: str | None = SAME

    def __post_init__(self) -> None:
        if self.param == SAME:
            object.__setattr__(self, "param", self.name)

    def text(self, template: str, limits: Limits) -> str:
        return template.format(name=self.name, **vars(limits))


# the builders: `options` are Field's keyword arguments (param, ...)
def boolean(name: str, message: str, description: str = "", **options: Any) -> Field:
    return Field(name, "boolean", message, description=description, **options)


def integer(name: str, message: str, *bounds: Bound, **options: Any) -> Field:
    return Field(name, "integer", message, bounds, **options)


def number(name: str, *bounds: Bound, message: str = "{name} is not a valid number", **options: Any) -> Field:
    return Field(name, "number", message, bounds, **options)


def custom(name: str, schema: Callable[[Limits], dict], description: str = "", **options: Any) -> Field:
    return Field(name, "custom", description=description, schema=schema, **options)


def ignored(name: str) -> Field:
    return Field(name, "any", description="Accepted and ignored.", param=None)


def max_tokens(name: str, *, positive: bool, description: str, param: str = SAME) -> Field:
    """max_tokens (completions: 0 allowed with echo) and chat's max_tokens / max_completion_tokens (at least 1)."""
    zero = (Min(1, "{name} value should be greater than 0"),) if positive else ()
    return integer(
        name,
        "{name} is not an unsigned integer",
        Min(0),
        Max(UINT32_MAX),
        Max("max_tokens", "{name} exceeds limit provided in graph config: {max_tokens}"),
        *zero,
        description=description,
        param=param,
    )


MODEL = Field(
    "model",
    "string",
    "model is not a string",
    required="model missing in request",
    description="The served model name (`GET /v3/models`); another name gets 404 `model_not_found`.",
    param=None,
)


# ---------------------------------------------------------------- field readers


@dataclass
class _Body:
    """A JSON object; null reads as absent; remembers which fields were read (the rest are `unknown`)."""

    data: dict
    seen: set = field(default_factory=set)

    def raw(self, name: str) -> Any:
        self.seen.add(name)
        return self.data.get(name)

    def unknown(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.data) - self.seen))


def _object(body: Any, limits: Limits) -> _Body:
    if not isinstance(body, dict):
        raise invalid("Received json is not an object")
    _check_tree(body, limits.depth)
    return _Body(body)


def _check_tree(body: dict, max_depth: int) -> None:
    """One walk over the parsed body (iterative: no recursion to exhaust): every string, keys included, must encode
    as UTF-8 (JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer takes), and objects and arrays
    nest at most `max_depth` deep (the body itself is level 1). The error names the top-level field at fault."""
    for name, value in body.items():
        stack = [(name, 2), (value, 2)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise invalid(
                        f"{name} contains a string that is not valid Unicode (a lone surrogate)", name
                    ) from None
            elif isinstance(item, (dict, list)):
                if depth > max_depth:
                    raise invalid(f"{name} nests objects and arrays deeper than {max_depth} levels", name)
                if isinstance(item, dict):
                    stack.extend((k, depth + 1) for k in item)
                    stack.extend((v, depth + 1) for v in item.values())
                else:
                    stack.extend((v, depth + 1) for v in item)


# ---------------------------------------------------------------- the table walk


def _read(b: _Body, table: tuple[Field, ...], limits: Limits) -> dict[str, Any]:
    """Every field of `table`, in its order, checked alone (custom ones by their parser): name -> value (None: not
    set)."""
    out: dict[str, Any] = {}
    for f in table:
        value = b.raw(f.name)
        if value is None:
            if f.required:
                raise invalid(f.required, f.name)
            out[f.name] = None
        elif f.parse is not None:
            out[f.name] = f.parse(value, limits, out)
        else:
            out[f.name] = _scalar(f, value, limits)
    return out


def _scalar(f: Field, value: Any, limits: Limits) -> Any:
    """A boolean, string, integer or number field's value, checked against its type and bounds in their order."""
    if f.kind == "any":
        return value
    if f.kind == "number":
        value = finite(value)
        ok = value is not None
    else:
        ok = (
            isinstance(value, bool)
            if f.kind == "boolean"
            else isinstance(value, str)
            if f.kind == "string"
            else is_int(value)
        )
    if not ok:
        raise invalid(f.text(f.message, limits), f.name)
    if value in f.also:  # top_k: -1
        return value
    for bound in f.bounds:
        edge = bound.resolve(limits)
        if edge is None:
            continue
        outside = value < edge if bound.side == "min" else value > edge
        if outside or (bound.exclusive and value == edge):
            raise invalid(f.text(bound.message or f.message, limits), f.name)
    return value


def read_body(body: Any, table: tuple[Field, ...], limits: Limits) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A JSON body's fields of `table`, each checked alone (name -> value, None: not set), and the names of its
    other fields (`unknown`)."""
    b = _object(body, limits)
    values = _read(b, table, limits)
    return values, b.unknown()


def sampling_values(values: dict[str, Any], table: tuple[Field, ...]) -> dict[str, Any]:
    """The set values of the fields that set a SamplingParams attribute (`Field.param`), by attribute; where two
    fields set one attribute, the later in the table wins (chat's max_completion_tokens over max_tokens) unless a
    rule refused both."""
    return {f.param: values[f.name] for f in table if f.param is not None and values[f.name] is not None}
