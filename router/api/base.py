"""What every API's types share: the strict base model, the field types used everywhere, the declaration of a
field Conveyor refuses, and pydantic's errors turned into Conveyor's one-line messages."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import pydantic
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

# Protobuf fields these values end up in (uint64 seed, uint32 top_k): larger values would fail at send time.
SEED_LIMIT = 2**64
UINT32_MAX = 2**32 - 1


class ValidationError(ValueError):
    """A problem with the request itself: HTTP answers 422 with this message, gRPC INVALID_ARGUMENT."""


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema, or null. A `const` is checked first: beside a `type` (`Literal[False]` is `{"const": false,
    "type": "boolean"}`) a null would still break the const."""
    if "const" in schema:
        rest = {k: v for k, v in schema.items() if k not in ("const", "type")}
        return {**rest, "enum": [schema["const"], None]}
    kind = schema.get("type")
    if isinstance(kind, str):
        nullable = {**schema, "type": [kind, "null"]}
        if "enum" in schema and None not in schema["enum"]:
            nullable["enum"] = [*schema["enum"], None]
        return nullable
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]} if None not in schema["enum"] else schema
    if {"type": "null"} in schema.get("anyOf", ()):
        return schema
    rest = {k: v for k, v in schema.items() if k in ("description", "default", "title", LIMIT)}
    inner = {k: v for k, v in schema.items() if k not in rest}
    return {**rest, "anyOf": [inner, {"type": "null"}]}


def _null_is_unset(schema: dict[str, Any]) -> None:
    """The document says what `Schema._drop_nulls` does: an optional field may be null."""
    required = set(schema.get("required", ()))
    for name, field in schema.get("properties", {}).items():
        if name not in required:
            schema["properties"][name] = _nullable(field)


class Part(BaseModel):
    """A part of a request that clients repeat many times (a chat message, a tool): JSON's types taken strictly,
    unknown fields refused (see `Schema`), but its optional fields say `| None` themselves, which spares each part
    `Schema`'s pass over its values."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class Schema(Part):
    """A request body (or a part of one). JSON's types are taken strictly, as TGI does: `true` is not a number,
    `5.0` is not an integer, NaN and infinity are not numbers. An unknown field is refused rather than ignored,
    since an ignored field the client meant (a misspelt `temprature`) would silently answer another request. A
    null is "unset" (clients such as huggingface_hub send every parameter, most as null), so it takes the
    default, and `model_fields_set` tells what the request gave."""

    model_config = ConfigDict(json_schema_extra=_null_is_unset)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, value: Any) -> Any:
        """Nulls of known fields only: an unknown field is refused whatever its value."""
        if not isinstance(value, dict):
            return value
        known = _names(cls)
        return {k: v for k, v in value.items() if v is not None or k not in known}


@functools.cache
def _names(model: type[BaseModel]) -> frozenset[str]:
    """The names a body may use for `model`'s fields (an alias where one is set)."""
    return frozenset(info.alias or name for name, info in model.model_fields.items())


# pydantic's strings refuse a lone surrogate (json.loads accepts `\\ud800`), which neither the tokenizer nor
# protobuf could encode.
Text = Annotated[str, Field(min_length=1)]
Seed = Annotated[int, Field(ge=0, le=SEED_LIMIT - 1)]
Probability = Annotated[float, Field(gt=0.0, le=1.0, description="1.0 is off; 0 would leave no token to choose")]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def refused(*neutral: Any, why: str) -> Any:
    """A field Conveyor knows but does not implement. Clients send some of them by default, so their neutral
    values (and null) pass; any other value is refused rather than ignored, since ignoring it would answer a
    different request. `Literal` would take `true` for 1, hence the type check."""

    def check(value: Any) -> Any:
        if not any(type(value) is type(n) and value == n for n in neutral):
            raise ValueError(f"is not supported ({why})")
        return value

    return Annotated[Any, BeforeValidator(check), WithJsonSchema({"enum": list(neutral), "description": why})]


Model = TypeVar("Model", bound=BaseModel)


def parse(model: type[Model], value: Any, where: str = "") -> Model:
    """`value` (a request body as bytes, or as Python values) as `model`, or a ValidationError naming the
    problem's field: "`parameters.top_k`: ...". Bytes are parsed and checked in one pass, without building the
    body as Python objects first, which costs more per request; their JSON nests at most 200 levels deep."""
    try:
        if isinstance(value, bytes):
            return model.model_validate_json(value)
        return model.model_validate(value)
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise ValidationError(f"request body is not valid JSON: {errors[0]['ctx']['error']}") from None
        body = _loads(value) if isinstance(value, bytes) else value
        raise ValidationError(problem(errors, body, where)) from None


def _loads(raw: bytes) -> Any:
    """The body's JSON, whose keys name the fields in a message (None if Python's parser differs from pydantic's
    and refuses it)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def problem(errors: list[Any], body: Any, where: str = "") -> str:
    """One message for what is wrong. A field of several types (a string or a list, say) fails once per type:
    the error that matters is the one of the type the value has (a type mismatch is said only when every type
    mismatched), and the path is the body's own, without pydantic's names for the alternatives."""
    relevant = [e for e in errors if not e["type"].endswith(_MISMATCH)] or errors
    error = relevant[0]
    path = ".".join(str(part) for part in (*(where.split(".") if where else ()), *_body_path(error, body)))
    if error["type"] == "value_error":  # the rules' own messages
        message = str(error["ctx"]["error"])
    elif error["type"] in _TYPES:  # a value of none of the field's types
        kinds = " or ".join(dict.fromkeys(_TYPES.get(e["type"], e["msg"]) for e in relevant))
        message = f"must be {kinds}. Given: {_short(error.get('input'))}"
    else:
        message = _MESSAGES.get(error["type"], lambda e: e["msg"])(error)
        message += "" if error["type"] in _NO_INPUT else f". Given: {_short(error.get('input'))}"
    return f"`{path}`: {message}" if path else message


_MISMATCH = ("_type", "literal_error", "union_tag_invalid", "string_unicode")


def _body_path(error: Any, body: Any) -> list[Any]:
    """The error's location as keys and indices of the body: pydantic's location also names the alternative of a
    union it tried (`str`, `list[...]`, a tag), which the body does not have. A missing field is named last."""
    path, node, last = [], body, len(error["loc"]) - 1
    for i, part in enumerate(error["loc"]):
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int):
            path.append(part)
            node = node[part]
        elif error["type"] == "missing" and i == last:
            path.append(part)
    return path


_TYPES = {
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
    "string_type": "a string",
    "list_type": "a list",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
}
_NO_INPUT = {"missing", "extra_forbidden", "model_type", "model_attributes_type", "union_tag_not_found"}
_MESSAGES: dict[str, Callable[[Any], str]] = {
    "missing": lambda e: "missing field",
    "extra_forbidden": lambda e: "unknown field: Conveyor does not support it",
    "string_unicode": lambda e: "must be valid Unicode text (it contains a lone surrogate)",
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


LIMIT = "x-conveyor-limit"


def limited(name: str, minus: int = 0, **kwargs: Any) -> Any:
    """A bound that depends on the deployment: `Limits.<name>` (less `minus`) for a number, or for a list's
    length. The schema states it as `x-conveyor-limit`; `/openapi.json` writes the deployment's value in its
    place, and validation's second stage (`check_limits`) enforces it."""
    return Field(json_schema_extra={LIMIT: [name, minus]}, **kwargs)


@functools.cache
def limits_of(model: type[BaseModel]) -> dict[str, tuple[str, int]]:
    """The fields of `model` with a deployment's bound: name -> (the `Limits` field, less what)."""
    found = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra
        if isinstance(extra, dict) and LIMIT in extra:
            limit, minus = extra[LIMIT]  # type: ignore[misc]
            found[name] = (limit, minus)
    return found
