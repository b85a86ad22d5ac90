"""Structured output: each API's way of asking for it, read into one `Constraint`.

TGI sends `parameters.grammar` ({"type": "json" | "regex", "value": ...}); OpenAI `response_format`; vLLM
`structured_outputs` or its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; the gRPC
front door a `Constraint` message. A request may carry at most one. Whether the constraint compiles is checked
later, once per distinct constraint (`Validation.check_grammar`).
"""

from __future__ import annotations

from typing import Any

from conveyor.router.validation import ValidationError
from conveyor.v1 import generate_pb2 as gen_pb

from conveyor.grammar import Constraint, GrammarError

TGI_GRAMMAR_TYPES = ("json", "regex", "json_object", "choice", "grammar")
VLLM_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _build(kind: str, value: Any, where: str) -> Constraint:
    """The one place each kind's value is checked; `where` names the field in the error."""
    try:
        if kind in ("json", "json_schema"):
            return Constraint.json_schema(value)
        if kind == "json_object":
            if value not in (None, True):
                raise GrammarError("`json_object` takes no value but true")
            return Constraint("json_object")
        if kind == "regex":
            return Constraint.regex(value)
        if kind == "choice":
            return Constraint.choice(value)
        if kind == "grammar":
            return Constraint.grammar_text(value)
    except GrammarError as exc:
        raise ValidationError(f"`{where}`: {exc}") from None
    raise ValidationError(f"`{where}`: unknown kind `{kind}`")


def tgi_grammar(value: object) -> Constraint:
    """TGI's `parameters.grammar`; Conveyor adds the types json_object, choice and grammar (Lark)."""
    if isinstance(value, Constraint):  # already read by an OpenAI route
        return value
    if not isinstance(value, dict) or set(value) - {"type", "value"} or "type" not in value:
        raise ValidationError('`grammar` must be {"type": ..., "value": ...}')
    kind = value["type"]
    if kind not in TGI_GRAMMAR_TYPES:
        raise ValidationError(f"`grammar.type` must be one of {', '.join(TGI_GRAMMAR_TYPES)}. Given: {kind!r}")
    return _build(kind, value.get("value"), "grammar.value")


def response_format(value: object) -> Constraint | None:
    """OpenAI's `response_format`: text (no constraint), json_object, or json_schema."""
    if not isinstance(value, dict) or "type" not in value:
        raise ValidationError("`response_format` must be an object with a `type`")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise ValidationError(f'`response_format.type` must be "text", "json_object" or "json_schema". Given: {kind!r}')
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise ValidationError("`response_format.json_schema` must be an object with a `name` and a `schema`")
    return _build("json_schema", spec.get("schema", {"type": "object"}), "response_format.json_schema.schema")


def structured_outputs(value: object) -> Constraint | None:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    if not isinstance(value, dict):
        raise ValidationError("`structured_outputs` must be a JSON object")
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise ValidationError(f"unknown field `structured_outputs.{unknown[0]}`")
    given = [k for k in STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise ValidationError(f"`structured_outputs` takes one constraint. Given: {', '.join(given)}")
    return _build(given[0], value[given[0]], f"structured_outputs.{given[0]}") if given else None


def openai_constraint(body: dict) -> Constraint | None:
    """The constraint of an OpenAI-style body, from whichever of its fields carries one (at most one may)."""
    found: list[tuple[str, Constraint]] = []
    if body.get("response_format") is not None:
        if (c := response_format(body["response_format"])) is not None:
            found.append(("response_format", c))
    if body.get("structured_outputs") is not None:
        if (c := structured_outputs(body["structured_outputs"])) is not None:
            found.append(("structured_outputs", c))
    for field in VLLM_FIELDS:
        if body.get(field) is not None:
            found.append((field, _build(field.removeprefix("guided_"), body[field], field)))
    if len(found) > 1:
        raise ValidationError(f"at most one constraint per request. Given: {', '.join(f for f, _ in found)}")
    return found[0][1] if found else None


def from_pb(constraint: gen_pb.Constraint) -> Constraint | None:
    """The gRPC front door's `Parameters.constraint`."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return _build("choice", list(constraint.choice.choices), "constraint.choice")
    if kind == "json_object":
        return _build("json_object", True, "constraint.json_object") if constraint.json_object else None
    return _build(kind, getattr(constraint, kind), f"constraint.{kind}")
