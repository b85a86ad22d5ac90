"""Structured output as each API asks for it: TGI's `parameters.grammar`, OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_*` fields. Each shape reads into one `Constraint` (`build`, the one place each kind's
value is checked), whose compiling is checked later, once per distinct constraint (`Validation.check_grammar`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from conveyor.grammar import MAX_CONSTRAINT_BYTES, Constraint, GrammarError
from conveyor.router.api.base import Schema, Text, ValidationError


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


SIZE = f"At most {MAX_CONSTRAINT_BYTES // 1024} KiB."
SchemaOrText = Annotated[
    dict[str, Any] | str,
    Field(
        description="A JSON Schema, or its JSON text (which must be a JSON object). Objects get only the "
        "properties they list unless `additionalProperties` says otherwise; the output is JSON with Python's "
        "separators (`, ` and `: `). " + SIZE
    ),
]
Regex = Annotated[Text, Field(description="A regex (Rust `regex` syntax) the whole output matches")]
Choices = Annotated[list[Text], Field(min_length=1, description="The output is exactly one of these strings")]
Lark = Annotated[
    str,
    Field(pattern=r"\S", description="A Lark grammar (llguidance's dialect), rule `start`"),
]


# --- TGI: parameters.grammar ---------------------------------------------------------------------------------


class _Grammar(Schema):
    def constraint(self) -> Constraint:
        return build(self.type, getattr(self, "value", True), "parameters.grammar.value")  # type: ignore[attr-defined]


class JsonGrammar(_Grammar):
    type: Literal["json"]
    value: SchemaOrText


class RegexGrammar(_Grammar):
    type: Literal["regex"]
    value: Regex


class JsonObjectGrammar(_Grammar):
    type: Literal["json_object"]
    value: Literal[True] | None = None


class ChoiceGrammar(_Grammar):
    type: Literal["choice"]
    value: Choices


class LarkGrammar(_Grammar):
    type: Literal["grammar"]
    value: Lark


TgiGrammar = Annotated[
    JsonGrammar | RegexGrammar | JsonObjectGrammar | ChoiceGrammar | LarkGrammar,
    Field(
        discriminator="type",
        description="Structured output: the text matches a JSON schema, any JSON object, a regex, one of a few "
        "strings, or a Lark grammar (Conveyor adds json_object, choice and grammar to TGI's json and regex)",
    ),
]


# --- OpenAI: response_format ---------------------------------------------------------------------------------


class JsonSchemaSpec(Schema):
    name: str | None = None
    description: str | None = None
    schema_: Annotated[
        SchemaOrText, Field(alias="schema", description="The schema (default: any JSON object). " + SIZE)
    ] = None  # type: ignore[assignment]
    strict: bool | None = Field(None, description="Always enforced, strict or not")


class TextFormat(Schema):
    type: Literal["text"]

    def constraint(self) -> Constraint | None:
        return None


class JsonObjectFormat(Schema):
    type: Literal["json_object"]

    def constraint(self) -> Constraint | None:
        return Constraint("json_object")


class JsonSchemaFormat(Schema):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec

    def constraint(self) -> Constraint | None:
        schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {"type": "object"}
        return build("json_schema", schema, "response_format.json_schema.schema")


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat,
    Field(
        discriminator="type",
        description="OpenAI's structured output: text (none), any JSON object, or JSON matching a schema",
    ),
]


# --- vLLM: structured_outputs and guided_* -------------------------------------------------------------------

_UNSET = {"json": None, "regex": None, "choice": None, "grammar": None, "json_object": False}


class StructuredOutputs(Schema):
    """vLLM's structured output: one of json (a schema), regex, choice, grammar (Lark) or json_object (true);
    json_object false is none."""

    json_: Annotated[SchemaOrText | None, Field(alias="json")] = None
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Lark | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = self.given()
        if len(given) > 1:
            raise ValueError(f"takes one constraint. Given: {', '.join(given)}")
        return self

    def _values(self) -> dict[str, Any]:
        """Each kind's value under its name in the body (`json`, not the attribute's `json_`)."""
        return {info.alias or name: getattr(self, name) for name, info in type(self).model_fields.items()}

    def given(self) -> list[str]:
        values = self._values()
        return [kind for kind, unset in _UNSET.items() if values[kind] not in (None, unset)]

    def constraint(self) -> Constraint | None:
        given = self.given()
        if not given:
            return None
        return build(given[0], self._values()[given[0]], f"structured_outputs.{given[0]}")


class ConstraintFields(Schema):
    """The structured-output fields of both OpenAI routes; at most one may carry a constraint."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Annotated[SchemaOrText | None, Field(description="vLLM's older name for a JSON schema")] = None
    guided_regex: Annotated[Regex | None, Field(description="vLLM's older name for a regex")] = None
    guided_choice: Annotated[Choices | None, Field(description="vLLM's older name for a choice")] = None
    guided_grammar: Annotated[Lark | None, Field(description="vLLM's older name for a Lark grammar")] = None

    def constraint_fields(self) -> list[str]:
        """The fields that carry a constraint (without building it)."""
        names = [
            f"guided_{k}" for k in ("json", "regex", "choice", "grammar") if getattr(self, f"guided_{k}") is not None
        ]
        if self.structured_outputs is not None and self.structured_outputs.given():
            names.insert(0, "structured_outputs")
        if self.response_format is not None and self.response_format.type != "text":
            names.insert(0, "response_format")
        return names

    def constraint(self) -> Constraint | None:
        """The request's constraint (`OpenAIRequest` allows at most one)."""
        names = self.constraint_fields()
        if not names:
            return None
        if names[0] in ("response_format", "structured_outputs"):
            return getattr(self, names[0]).constraint()
        return build(names[0].removeprefix("guided_"), getattr(self, names[0]), names[0])
