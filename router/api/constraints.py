"""Structured output as each API asks for it: TGI's `parameters.grammar`, OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_*` fields. Each shape reads into one `Constraint` (`router/structured.py`),
whose compiling is checked later, once per distinct constraint (`Validation.check_grammar`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from conveyor.router.api.base import Schema, Text
from conveyor.router.structured import build
from pydantic import Field, model_validator

from conveyor.grammar import MAX_CONSTRAINT_BYTES, Constraint

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
