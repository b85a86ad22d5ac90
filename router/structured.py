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


def build(kind: str, value: Any, where: str) -> Constraint:
    """The one place each kind's value is checked, whichever field carries it; `where` names the field in the
    error. What llguidance cannot take even before compiling is refused here (a 422) rather than raising later
    (a 500): a lone surrogate (json.loads accepts `\\ud800`; Rust strings cannot hold it), a schema given as JSON
    text nested deeper than Python's parser recurses, and a boolean schema (`true`, `false`), to which
    llguidance's JSON options do not apply."""
    try:
        constraint = _constraint(kind, value)
        if constraint.kind == "json_schema" and not constraint.value.startswith("{"):
            raise GrammarError("a JSON schema must be a JSON object")
        constraint.grammar  # noqa: B018 - builds (and caches) the grammar text, which checks the value
    except UnicodeEncodeError:
        raise ValidationError(f"`{where}` must be valid Unicode text (it contains a lone surrogate)") from None
    except RecursionError:
        raise ValidationError(f"`{where}` is nested too deeply") from None
    except GrammarError as exc:
        raise ValidationError(f"`{where}`: {exc}") from None
    except ValueError as exc:  # llguidance refusing the value (an integer beyond 64 bits in a schema, say)
        label = "json schema" if kind in ("json", "json_schema") else kind.replace("_", " ")
        raise ValidationError(f"`{where}`: invalid {label}: {exc}") from None
    return constraint


def _constraint(kind: str, value: Any) -> Constraint:
    if kind in ("json", "json_schema"):
        return Constraint.json_schema(value)
    if kind == "json_object":
        if value is not None and value is not True:  # `in (None, True)` would take 1 for true
            raise GrammarError("`json_object` takes no value but true")
        return Constraint("json_object")
    if kind == "regex":
        return Constraint.regex(value)
    if kind == "choice":
        return Constraint.choice(value)
    if kind == "grammar":
        return Constraint.grammar_text(value)
    raise GrammarError(f"unknown kind `{kind}`")


def tgi_grammar(value: object) -> Constraint:
    """TGI's `parameters.grammar`; Conveyor adds the types json_object, choice and grammar (Lark)."""
    if isinstance(value, Constraint):  # already read by an OpenAI route
        return value
    if not isinstance(value, dict) or set(value) - {"type", "value"} or "type" not in value:
        raise ValidationError('`grammar` must be {"type": ..., "value": ...}')
    kind = value["type"]
    if kind not in TGI_GRAMMAR_TYPES:
        raise ValidationError(f"`grammar.type` must be one of {', '.join(TGI_GRAMMAR_TYPES)}. Given: {kind!r}")
    return build(kind, value.get("value"), "grammar.value")


def response_format(value: object) -> Constraint | None:
    """OpenAI's `response_format`: text (no constraint), json_object, or json_schema. Unknown fields are refused,
    not ignored: TGI's `{"type": "json_object", "value": schema}`, say, would otherwise lose its schema."""
    if not isinstance(value, dict) or "type" not in value:
        raise ValidationError("`response_format` must be an object with a `type`")
    kind = value["type"]
    if kind not in ("text", "json_object", "json_schema"):
        raise ValidationError(f'`response_format.type` must be "text", "json_object" or "json_schema". Given: {kind!r}')
    _known(value, {"type", "json_schema"} if kind == "json_schema" else {"type"}, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise ValidationError("`response_format.json_schema` must be an object with a `name` and a `schema`")
    _known(spec, {"name", "description", "schema", "strict"}, "response_format.json_schema")
    if not isinstance(spec.get("description", ""), str):
        raise ValidationError("`response_format.json_schema.description` must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValidationError("`response_format.json_schema.strict` must be a boolean")
    return build("json_schema", spec.get("schema", {"type": "object"}), "response_format.json_schema.schema")


def _known(value: dict, fields: set[str], where: str) -> None:
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValidationError(f"unknown field `{where}.{unknown[0]}`")


def structured_outputs(value: object) -> Constraint | None:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object. A null (or, for
    `json_object`, false) value is no constraint; any other value is that kind's, checked (0 is not "unset")."""
    if not isinstance(value, dict):
        raise ValidationError("`structured_outputs` must be a JSON object")
    _known(value, set(STRUCTURED_OUTPUTS_KEYS), "structured_outputs")
    given = [
        k
        for k in STRUCTURED_OUTPUTS_KEYS
        if value.get(k) is not None and not (k == "json_object" and value[k] is False)
    ]
    if len(given) > 1:
        raise ValidationError(f"`structured_outputs` takes one constraint. Given: {', '.join(given)}")
    return build(given[0], value[given[0]], f"structured_outputs.{given[0]}") if given else None


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
            found.append((field, build(field.removeprefix("guided_"), body[field], field)))
    if len(found) > 1:
        raise ValidationError(f"at most one constraint per request. Given: {', '.join(f for f, _ in found)}")
    return found[0][1] if found else None


def from_pb(constraint: gen_pb.Constraint) -> Constraint | None:
    """The gRPC front door's `Parameters.constraint`."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return build("choice", list(constraint.choice.choices), "constraint.choice")
    if kind == "json_object":
        return build("json_object", True, "constraint.json_object") if constraint.json_object else None
    return build(kind, getattr(constraint, kind), f"constraint.{kind}")
