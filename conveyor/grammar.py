"""Constraints on what a request may generate (structured output), and the grammars that enforce them.

The engine is llguidance, for its compile time: it compiles a nested JSON schema and a large one far sooner than
xgrammar and outlines-core, and a new schema is compiled while its request waits. Per step (mask and advance) it
is level with xgrammar and slower than outlines-core (whose masks are looked up in what it compiled), and it needs
no other package. `make bench-grammar` (benchmarks/grammar.py) measures all three, compile and step. The router
and the shards share this module: the router compiles each distinct constraint once to refuse a bad one with a
422, the shards compile it again (once) to build the matchers that mask each step's logits.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

# JSON as Python writes it (", " and ": " separators, no other whitespace): a model may not pad its output with
# whitespace for ever, and the output is the same text whatever the model prefers.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # distinct grammars kept compiled, least recently used dropped first
MAX_CONSTRAINT_BYTES = 256 * 1024


class GrammarError(ValueError):
    """The constraint cannot be compiled: a bad schema, regex or grammar. The router answers 422."""


@dataclass(frozen=True)
class Constraint:
    """One request's constraint. `value` is text for every kind, so that equal constraints compare equal and
    share one compiled grammar: a schema as JSON, a regex or a Lark grammar as given, the choices as a JSON list.
    A model that reasons first gets the constraint on what follows its reasoning block (`after_reasoning`)."""

    kind: str
    value: str = ""
    reasoning_open: str = ""  # the tag that may open a reasoning block first ("" with a close: the prompt opened it)
    reasoning_close: str = ""  # the tag that ends it ("": the constraint applies from the first token)

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be a JSON object")
        return cls("json_schema", _sized(json.dumps(schema, ensure_ascii=False)))

    @classmethod
    def regex(cls, pattern: Any) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("a regex must be a non-empty string")
        return cls("regex", _sized(pattern))

    @classmethod
    def choice(cls, choices: Any) -> Constraint:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choices must be a non-empty list of non-empty strings")
        return cls("choice", _sized(json.dumps(choices, ensure_ascii=False)))

    @classmethod
    def grammar_text(cls, lark: Any) -> Constraint:
        # The schemas' rule (`\S`, as JSON Schema's regexes read it): Python's str.strip() also drops control
        # characters such as \x1e, which a schema-valid grammar may hold (then the grammar's parser judges it).
        if not isinstance(lark, str) or not re.search(r"\S", lark, re.ASCII):
            raise GrammarError("a grammar must be a non-empty string (Lark syntax)")
        return cls("grammar", _sized(lark))

    def after_reasoning(self, open_tag: str, close_tag: str) -> Constraint:
        """This constraint on the text after a reasoning block that ends with `close_tag`: a block the model may
        open with `open_tag`, or (no `open_tag`) the one its prompt opened, which it must close first."""
        return replace(self, reasoning_open=open_tag, reasoning_close=close_tag)

    @cached_property
    def grammar(self) -> str:
        """The llguidance grammar that enforces it; what the router sends each shard."""
        answer = self._grammar()
        return _after_reasoning(answer, self.reasoning_open, self.reasoning_close) if self.reasoning_close else answer

    def _grammar(self) -> str:
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(closed(json.loads(self.value)), overrides=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            # JSON string literals are Lark string literals, escapes included; llguidance's lexer also wants DEL
            # escaped, which JSON leaves as it is.
            literals = " | ".join(
                json.dumps(c, ensure_ascii=False).replace("\x7f", "\\u007f") for c in json.loads(self.value)
            )
            return LLMatcher.grammar_from_lark(f"start: {literals}")
        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(self.value)
        raise GrammarError(f"unknown constraint kind `{self.kind}`")


def _after_reasoning(answer: str, open_tag: str, close_tag: str) -> str:
    """`answer` (an llguidance grammar: JSON with its `grammars`, or Lark text) after a reasoning block: free text
    that ends at the first `close_tag`, then at most two newlines, as Qwen3 and DeepSeek-R1 write them. The block
    is optional when the model may open it (`open_tag`), required when the prompt opened it (no `open_tag`)."""
    try:
        top = json.loads(answer)
    except ValueError:
        top = None
    grammars = top["grammars"] if isinstance(top, dict) else [{"lark_grammar": answer}]
    block = f"{json.dumps(open_tag)} thought" if open_tag else "thought"
    lark = "\n".join(
        [
            f"start: reasoning{'?' if open_tag else ''} @answer",
            f"reasoning: {block}",
            "thought: thought_text /\\n{0,2}/",
            f"thought_text[suffix={json.dumps(close_tag)}]: /(?s:.*)/",
        ]
    )
    main = {"name": "reasoning", "lark_grammar": lark}
    return json.dumps({"grammars": [main, {**grammars[0], "name": "answer"}, *grammars[1:]]})


# Keywords whose value is a schema, a list of schemas, or a map from names to schemas.
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its `properties` and says nothing
    about others. JSON Schema allows extra properties by default, so a model could add keys for ever; TGI
    (outlines) and vLLM (xgrammar) generate only the listed ones unless the schema asks for more, and so does
    Conveyor. Walks the schema's structure, so a property that happens to be named "properties" is left alone."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    return out


def _sized(text: str) -> str:
    if len(text.encode()) > MAX_CONSTRAINT_BYTES:
        raise GrammarError(f"a constraint may not be longer than {MAX_CONSTRAINT_BYTES} bytes")
    return text


class GrammarCache:
    """Compiled grammars for one tokenizer, one per distinct grammar text. A request gets a copy of the compiled
    matcher, which is much cheaper than compiling again. Safe to share between threads (the router's validation
    workers); the tokenizer's llguidance view (slow to build for a large vocabulary: `make bench-grammar` times it)
    is built at first use, not at startup."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, eos_token_ids: frozenset[int] | None = None) -> None:
        """`vocab_size`: the width of the logits, if it differs from the tokenizer's (None: the tokenizer's)."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids) if eos_token_ids else None
        self._tokenizer = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
            )
        return self._tokenizer

    def compile(self, grammar: str) -> float:
        """Compiles `grammar` unless it is cached, its first step included (`_first_step_error`); returns the
        seconds spent (0 for a cache hit)."""
        return self._template(grammar)[1]

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher (llguidance `LLMatcher`) at the start of `grammar`."""
        return self._template(grammar)[0].deep_copy()

    def _template(self, grammar: str) -> tuple[Any, float]:
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar], 0.0
            tokenizer = self._llg_tokenizer()
        from llguidance import LLMatcher

        start = time.perf_counter()
        template = LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(_first_line(template.get_error()))
        if (error := _first_step_error(template, tokenizer.eos_tokens)) is not None:
            raise GrammarError(f"{_first_line(error)} (at the first token)")
        seconds = time.perf_counter() - start
        with self._lock:
            self._compiled[grammar] = template
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template, seconds


def _first_step_error(template: Any, eos_token_ids: list[int]) -> str | None:
    """llguidance's error at the grammar's first step, if any. It compiles lazily: what a grammar forces from its
    start (`a{1000000}`: a million a's) is worked out at the first mask and token only, and a limit of its own met
    there (lexer states, Earley items, a row's size) puts the matcher in an error state; the shard then ends the
    request after one token, with finish reason `stop`. So a copy takes that step at compile time: the first
    mask, then the first token it allows other than EOS. Cheap for real constraints next to the compile itself
    (schemas, regexes and grammars, on small and large tokenizers; `make bench-grammar` times the compile with this
    step in it). A limit met only after a choice (`x|a{1000000}`, once the model picks `a`) is still met on the
    shard, which ends the request with EOS (shard/sampling/masks.py)."""
    matcher = template.deep_copy()
    allowed = int.from_bytes(matcher.compute_bitmask(), "little")  # bit t of the little-endian words: token t
    for eos in eos_token_ids:
        allowed &= ~(1 << eos)
    if allowed and not matcher.is_error():
        matcher.consume_token((allowed & -allowed).bit_length() - 1)  # the lowest token id it allows
    return matcher.get_error() if matcher.is_error() else None


def _first_line(error: str) -> str:
    """llguidance's errors may carry a dump of its state after the first line; the first says what is wrong."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return " ".join(lines[:4]) if lines and "regex parse error" in lines[0] else (lines[0] if lines else error)
