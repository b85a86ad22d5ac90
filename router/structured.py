"""Structured output: one `Constraint` from whichever field carries it.

The shapes each API uses to ask for one are declared in `router/api/constraints.py`; the gRPC front door sends
a `Constraint` message. A request may carry at most one. Whether the constraint compiles is checked later, once
per distinct constraint (`Validation.check_grammar`).
"""

from __future__ import annotations

from typing import Any

from conveyor.router.api.base import ValidationError
from conveyor.v1 import generate_pb2 as gen_pb

from conveyor.grammar import Constraint, GrammarError


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
