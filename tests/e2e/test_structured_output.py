"""Structured output end to end, through the real launcher, router and shard processes.

The tiny test model has random weights: its free output is gibberish, so only the constraint can make an output
valid. Every output is checked by an independent oracle (`jsonschema`, Python's `re`, a hand-written parser of the
test grammar), never by llguidance alone. Sampled requests are seeded, so each run sees the same outputs.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jsonschema
import pytest
import regex
from conftest import ORACLE_PROMPTS, Server, free_port, greedy_reference, start_server, wait_for
from test_oracle import Stream, run_staggered
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from conveyor.grammar import Constraint, GrammarCache

# ---------------------------------------------------------------------------------------------------- constraints

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "city": {"type": "string", "maxLength": 6},
            },
            "required": ["zip"],
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address"],
}

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "status": {"enum": ["open", "paid", "shipped"]},
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                    "price": {"type": "number", "minimum": 0, "maximum": 100},
                },
                "required": ["sku", "qty"],
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["id", "status", "lines"],
}

# Sent as JSON text rather than an object: TGI accepts both.
FLAGS = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "code": {"type": "integer", "minimum": -10, "maximum": 10},
        "note": {"type": ["string", "null"], "maxLength": 5},
    },
    "required": ["ok", "code", "note"],
}

DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]{0,15}"

COLOURS = ["red", "green", "blue", "dark red", "light blue"]
ANSWERS = ["yes", "no", "maybe", "yes please"]  # "yes" may go on: only EOS ends it

# A context-free grammar (parentheses nest) in llguidance's Lark dialect; `parses_arithmetic` is its oracle.
ARITHMETIC = r"""
start: expr
expr: term (OP term){0,2}
term: NUMBER | "(" expr ")"
OP: "+" | "*"
NUMBER: /[0-9]{1,3}/
"""

PROMPTS = ["Output:", "def f(x):", "import json", "# answer\n"]


def json_grammar(schema: dict | str) -> dict:
    return {"type": "json", "value": schema}


def regex_grammar(pattern: str) -> dict:
    return {"type": "regex", "value": pattern}


def choice_grammar(choices: list[str]) -> dict:
    return {"type": "choice", "value": choices}


def lark_grammar(text: str) -> dict:
    return {"type": "grammar", "value": text}


# ---------------------------------------------------------------------------------------------------- oracles


def json_layout_ok(text: str, prefix: bool = False) -> bool:
    """JSON as promised: outside strings, the only whitespace is one space after each ',' and ':' (which a
    `prefix` may end before)."""
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace() and not (ch == " " and i > 0 and text[i - 1] in ",:" and not text[i + 1 : i + 2].isspace()):
            return False
        elif ch in ",:" and text[i + 1 : i + 2] != " " and not (prefix and i == len(text) - 1):
            return False
    return True


def valid_json(schema: dict) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        try:
            document = json.loads(text)
        except ValueError:
            return False
        jsonschema.validate(document, schema)  # raises with the reason
        return json_layout_ok(text)

    return check


def json_prefix_ok(text: str) -> bool:
    """Independently of llguidance: some completion of `text` parses as JSON. Tracks strings and brackets, then
    tries a few fillers for what is cut off (a partial escape, number, literal, key or value) and closes."""
    closers: list[str] = []
    in_string = escaped = False
    unicode_digits = -1  # hex digits still due after a \u escape
    for ch in text:
        if in_string:
            if unicode_digits > 0:
                if ch not in "0123456789abcdefABCDEF":
                    return False
                unicode_digits -= 1
            elif escaped:
                if ch not in '"\\/bfnrtu':
                    return False
                escaped = False
                unicode_digits = 4 if ch == "u" else -1
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not closers or closers.pop() != ch:
                return False
        elif ch == '"':
            in_string = True
    head = text
    if in_string:
        head += ("0" * unicode_digits if unicode_digits > 0 else "n" if escaped else "") + '"'
    tail = "".join(reversed(closers))
    fillers = ["", "0", ": 0", '"k": 0', "rue", "ue", "e", "alse", "lse", "se", "ull", "ll", "l"]
    for filler in fillers:
        try:
            json.loads(head + filler + tail)
            return True
        except ValueError:
            pass
    return False


def full_match(pattern: str) -> Callable[[str], bool]:
    return lambda text: re.fullmatch(pattern, text) is not None


def one_of(choices: list[str]) -> Callable[[str], bool]:
    return lambda text: text in choices


def parses_arithmetic(text: str) -> bool:
    """A recursive-descent parser of ARITHMETIC: the whole text is one `expr`."""

    def expr(i: int) -> int:
        i = term(i)
        for _ in range(2):
            if i < len(text) and text[i] in "+*":
                i = term(i + 1)
        return i

    def term(i: int) -> int:
        if text[i : i + 1] == "(":
            i = expr(i + 1)
            if text[i : i + 1] != ")":
                raise SyntaxError(i)
            return i + 1
        number = re.match(r"[0-9]{1,3}", text[i:])
        if number is None:
            raise SyntaxError(i)
        return i + number.end()

    try:
        return expr(0) == len(text)
    except SyntaxError:
        return False


# ---------------------------------------------------------------------------------------------------- helpers


@functools.cache
def eos_ids(model_dir: Path) -> frozenset[int]:
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    return frozenset(eos if isinstance(eos, list) else [eos])


@functools.cache
def grammar_cache(model_dir: Path) -> GrammarCache:
    """A matcher factory of our own, built as the shard builds its (the model's tokenizer, the logits' width)."""
    from transformers import AutoConfig, AutoTokenizer

    return GrammarCache(AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir).vocab_size)


def llguidance_grammar(grammar: dict) -> str:
    """The llguidance grammar the router builds for a TGI `grammar` parameter."""
    kind, value = grammar["type"], grammar.get("value")
    if kind == "json":
        return Constraint.json_schema(value).grammar
    if kind == "json_object":
        return Constraint("json_object").grammar
    if kind == "regex":
        return Constraint.regex(value).grammar
    if kind == "choice":
        return Constraint.choice(value).grammar
    return Constraint.grammar_text(value).grammar


def post(server: Server, body: dict, route: str = "/generate") -> dict:
    with server.client() as client:
        response = client.post(route, json=body)
    assert response.status_code == 200, (body, response.text)
    return response.json()


def request(
    prompt: str, grammar: dict | None, max_new_tokens: int, seed: int | None = None, **parameters: object
) -> dict:
    """A /generate body with details; seeded sampling at temperature 1 when `seed` is given, else greedy."""
    p: dict = {"max_new_tokens": max_new_tokens, "details": True, **parameters}
    if grammar is not None:
        p["grammar"] = grammar
    if seed is not None:
        p.update(do_sample=True, temperature=1.0, seed=seed)
    return {"inputs": prompt, "parameters": p}


def post_all(server: Server, bodies: list[dict], workers: int = 16) -> list[dict]:
    """All at once from a pool of clients, so the batcher mixes them."""
    with ThreadPoolExecutor(min(workers, len(bodies))) as pool:
        return list(pool.map(lambda body: post(server, body), bodies))


def ids(response: dict) -> list[int]:
    return [t["id"] for t in response["details"]["tokens"]]


def constrained_text(response: dict, model_dir: Path) -> str:
    """The text the constraint governs: every generated token's text but that of an EOS token that ended it (a
    grammar that may go on ends when the model samples EOS, which the mask then allows). The test model declares
    an ordinary token (" >=") as a second EOS id, so EOS text is not always special text."""
    tokens = response["details"]["tokens"]
    if tokens and tokens[-1]["id"] in eos_ids(model_dir) and response["details"]["finish_reason"] == "eos_token":
        tokens = tokens[:-1]
    return "".join(t["text"] for t in tokens)


def metrics_text(server: Server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


def sample(server: Server, name: str, **labels: str) -> float:
    """One Prometheus sample, 0 if it is not exported yet (a labelled counter appears at its first use)."""
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in metrics_text(server).splitlines():
        key, _, value = line.rpartition(" ")
        if key == wanted:
            return float(value)
    return 0.0


def all_blocks_free(server: Server) -> bool:
    info = server.info()
    return info["kv_blocks_free"] == info["kv_blocks_total"]


# ---------------------------------------------------------------------------------------------------- 1. sampling


@dataclass(frozen=True)
class Case:
    name: str
    grammar: dict
    valid: Callable[[str], bool]
    max_new_tokens: int
    count: int


SAMPLED = [
    Case("person", json_grammar(PERSON), valid_json(PERSON), 160, 18),
    Case("order", json_grammar(ORDER), valid_json(ORDER), 160, 18),
    Case("flags-as-text", json_grammar(json.dumps(FLAGS)), valid_json(FLAGS), 80, 18),
    Case("date", regex_grammar(DATE), full_match(DATE), 30, 18),
    Case("email", regex_grammar(EMAIL), full_match(EMAIL), 30, 18),
    Case("identifier", regex_grammar(IDENTIFIER), full_match(IDENTIFIER), 30, 18),
    Case("colours", choice_grammar(COLOURS), one_of(COLOURS), 20, 26),
    Case("answers", choice_grammar(ANSWERS), one_of(ANSWERS), 20, 26),
    Case("arithmetic", lark_grammar(ARITHMETIC), parses_arithmetic, 60, 54),
]


Sampled = list[tuple[Case, dict, dict]]  # (case, request body, response)


@pytest.fixture(scope="module")
def sampled(server: Server) -> Sampled:
    """54 JSON, 54 regex, 52 choice and 54 grammar requests at temperature 1 with distinct seeds, all in flight
    at once from 32 clients, so that every batch mixes kinds and requests join and leave it all the time."""
    jobs = [
        (case, request(PROMPTS[n % len(PROMPTS)], case.grammar, case.max_new_tokens, seed=1000 * k + n))
        for k, case in enumerate(SAMPLED)
        for n in range(case.count)
    ]
    responses = post_all(server, [body for _, body in jobs], workers=32)
    return [(case, body, response) for (case, body), response in zip(jobs, responses)]


def test_every_sampled_output_satisfies_its_constraint(sampled: Sampled, tiny_model: Path) -> None:
    """Every output validates, every one ends because its grammar is complete, and they differ."""
    outputs: dict[str, list[str]] = {case.name: [] for case in SAMPLED}
    for case, body, response in sampled:
        text = constrained_text(response, tiny_model)
        assert case.valid(text), (case.name, body["parameters"]["seed"], response["generated_text"])
        assert response["details"]["finish_reason"] == "eos_token", (case.name, body, response)
        outputs[case.name].append(text)
    for case in SAMPLED:
        distinct = set(outputs[case.name])
        assert len(distinct) >= (3 if case.grammar["type"] == "choice" else case.count // 2), (case.name, distinct)


def test_generated_text_leaves_out_the_special_eos_that_ended_it(sampled: Sampled) -> None:
    """A grammar that may go on ("yes" may become "yes please", a number may grow) ends when the model samples
    EOS. TGI decodes `generated_text` with special tokens skipped, so a TGI client gets exactly the match: no
    "</s>" after it (the token itself is still in details.tokens, marked special)."""
    ended_on_special = [
        (case, response)
        for case, _, response in sampled
        if response["details"]["finish_reason"] == "eos_token" and response["details"]["tokens"][-1]["special"]
    ]
    assert ended_on_special, "no sampled output ended on a special EOS: the test needs other seeds"
    for case, response in ended_on_special:
        assert case.valid(response["generated_text"]), (case.name, response["generated_text"])


# ---------------------------------------------------------------------------------------------------- 2. length


# Each needs at least 5 tokens to be complete (the byte-level pre-tokenizer never merges letters, digits and
# punctuation into one token), and gets 2 to 4.
LET = r"""
start: "let " NAME " = " expr ";"
expr: term (OP term){0,2}
term: NUMBER | "(" expr ")"
OP: "+" | "*"
NAME: /[a-z]{1,6}/
NUMBER: /[0-9]{1,3}/
"""
LIMITED = [json_grammar(PERSON), json_grammar(ORDER), regex_grammar(EMAIL), regex_grammar(DATE), lark_grammar(LET)]


def test_a_token_limit_too_small_gives_length_and_a_valid_prefix(server: Server) -> None:
    """Cut off early, an output is a prefix some continuation completes: a fresh matcher of our own accepts its
    token ids, and for JSON and regexes an independent check agrees."""
    jobs = [(g, request(PROMPTS[n % len(PROMPTS)], g, 2 + n % 3, seed=5000 + n)) for g in LIMITED for n in range(6)]
    responses = post_all(server, [body for _, body in jobs])
    for (grammar, body), response in zip(jobs, responses):
        details, text = response["details"], response["generated_text"]
        assert details["finish_reason"] == "length", (grammar, body, response)
        assert details["generated_tokens"] == body["parameters"]["max_new_tokens"]
        matcher = grammar_cache(server.model_dir).matcher(llguidance_grammar(grammar))
        assert matcher.consume_tokens(ids(response)) and not matcher.is_error(), (grammar, text, matcher.get_error())
        assert not matcher.is_stopped(), (grammar, text)  # a prefix, not a whole match ended by the limit
        if grammar["type"] == "json":
            assert json_prefix_ok(text) and json_layout_ok(text, prefix=True), (grammar, text)
        if grammar["type"] == "regex":
            assert regex.fullmatch(grammar["value"], text, partial=True) is not None, (grammar, text)
    assert len({r["generated_text"] for r in responses}) > len(LIMITED)


def test_the_json_prefix_oracle_itself() -> None:
    assert all(json_prefix_ok(t) for t in ['{"a', '{"a": [1, {"b": tr', '{"a": "x\\u00', '{"a": -', "[1, 2", '{"'])
    assert not any(json_prefix_ok(t) for t in ['{"a": }', "]", '{"a" 1', '{"a": "\\q'])
    assert parses_arithmetic("(1+22)*333") and not parses_arithmetic("1+2+3+4") and not parses_arithmetic("1234")
    assert json_layout_ok('{"a": [1, 2], "b": " x "}') and not json_layout_ok('{"a":1}')
    assert not json_layout_ok('{"a": 1,  "b": 2}') and not json_layout_ok('{ "a": 1}')
    assert json_layout_ok('{"a": 1,', prefix=True) and not json_layout_ok('{"a": 1,')


# ---------------------------------------------------------------------------------------------------- 3. mixed batch


@dataclass
class ConstrainedStream(Stream):
    """A greedy stream with a grammar, run beside plain ones."""

    grammar: dict = field(default_factory=dict)

    def body(self) -> dict:
        return request(self.prompt, self.grammar, self.max_new_tokens)


GREEDY_CONSTRAINED = [
    ("x", json_grammar(PERSON), 120),
    ("import os", regex_grammar(EMAIL), 30),
    ("def add(a, b):", lark_grammar(ARITHMETIC), 30),
    ("lambda", choice_grammar(COLOURS), 10),
    ("while True:", regex_grammar(IDENTIFIER), 30),
    ("print(", {"type": "json_object"}, 30),
]


def test_constrained_and_plain_greedy_requests_in_one_batch_stay_exact(server: Server) -> None:
    """Constrained greedy streams join and leave a batch of plain greedy streams at staggered moments: every
    plain one still gets exactly transformers' greedy tokens (its row is never masked), and every constrained one
    exactly the tokens it gets alone."""
    alone = [ids(post(server, request(p, g, n))) for p, g, n in GREEDY_CONSTRAINED]
    streams: list[Stream] = [Stream(p, n) for p, n in ORACLE_PROMPTS]
    for k, (prompt, grammar, n) in enumerate(GREEDY_CONSTRAINED):
        streams.insert(1 + 3 * k, ConstrainedStream(prompt, n, grammar=grammar))
    run_staggered(server, streams, after_tokens=2)
    constrained = [s for s in streams if isinstance(s, ConstrainedStream)]
    for s, expected in zip(constrained, alone):
        assert s.ids == expected, (s.prompt, s.grammar)
        assert s.final is not None and s.final["details"]["finish_reason"] == "eos_token", s.final
    for s in streams:
        if not isinstance(s, ConstrainedStream):
            assert s.ids == greedy_reference(server.model_dir, s.prompt, s.max_new_tokens), s.prompt


# ---------------------------------------------------------------------------------------------------- 5. client


def test_the_text_generation_client_sends_a_grammar(server: Server) -> None:
    client = Client(server.url, timeout=120)
    for seed in (1, 2):
        response = client.generate(
            "Output:",
            max_new_tokens=160,
            do_sample=True,
            temperature=1.0,
            seed=seed,
            grammar=Grammar(type=GrammarType.Json, value=PERSON),
        )
        assert valid_json(PERSON)(response.generated_text), response.generated_text
        assert response.details.finish_reason.value == "eos_token"
    text = client.generate(
        "import os", max_new_tokens=30, grammar=Grammar(type=GrammarType.Regex, value=EMAIL)
    ).generated_text
    assert re.fullmatch(EMAIL, text), text
    streamed = list(client.generate_stream("import os", max_new_tokens=30, grammar=Grammar(type="regex", value=EMAIL)))
    assert streamed[-1].generated_text == text == "".join(r.token.text for r in streamed if not r.token.special)


# ---------------------------------------------------------------------------------------------------- 6. 422


BAD_GRAMMARS = [
    ({"type": "json", "value": {"type": "nope"}}, "invalid json schema"),
    ({"type": "json", "value": "{not json"}, "not valid JSON"),
    ({"type": "regex", "value": "(ab"}, "invalid regex"),
    ({"type": "xml", "value": "<a/>"}, "`parameters.grammar`: Input tag 'xml' found using 'type' does not match"),
    ({"type": "grammar", "value": "start: (\n"}, "invalid grammar"),
    ({"type": "grammar", "value": "start: undefined_rule\n"}, "invalid grammar"),
    ({"type": "choice", "value": []}, "List should have at least 1 item"),
]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_a_bad_constraint_is_a_422_and_the_server_serves_on(server: Server, route: str) -> None:
    with server.client() as client:
        for grammar, message in BAD_GRAMMARS:
            response = client.post(route, json=request("x", grammar, 5))
            assert response.status_code == 422, (grammar, response.text)
            body = response.json()
            assert body["error_type"] == "validation" and message in body["error"], (grammar, body)
    good = post(server, request("x", regex_grammar(DATE), 30))
    assert re.fullmatch(DATE, constrained_text(good, server.model_dir)), good
    plain = post(server, request("x", None, 12))
    assert ids(plain) == greedy_reference(server.model_dir, "x", 12)


PAST_LIMITS = "a{1000000}"  # compiles, but what it forces from the start is past llguidance's limits


def test_a_constraint_past_llguidance_limits_is_a_422_not_a_one_token_answer(server: Server) -> None:
    """llguidance compiles lazily: this regex compiles, and only its first token meets the limit, where the shard
    ended the request after that token with finish reason `stop`. Validation takes that step first."""
    anchored = {"type": "object", "properties": {"a": {"type": "string", "pattern": f"^{PAST_LIMITS}$"}}}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {**anchored, "required": ["a"]}}}
    refused = [
        ("/generate", request("x", regex_grammar(PAST_LIMITS), 5)),
        ("/generate_stream", request("x", regex_grammar(PAST_LIMITS), 5)),
        ("/v1/chat/completions", {**chat, "response_format": schema}),
        ("/v1/chat/completions", {**chat, "guided_regex": PAST_LIMITS}),
    ]
    with server.client() as client:
        for route, body in refused:
            response = client.post(route, json=body)
            assert response.status_code == 422, (route, response.text)
            error = response.json()
            message = error["error"]["message"] if route.startswith("/v1/") else error["error"]
            assert error["error_type"] == "validation", (route, error)
            assert "too many expressions constructed (at the first token)" in message, (route, error)


# ---------------------------------------------------------------------------------------------------- 7. metrics


def test_metrics_count_constrained_requests_compiles_and_masks(server: Server) -> None:
    new_regex = r"metrics-[0-9]{2}"  # used by no other test: compiled for the first time here
    kinds = {
        "json_schema": json_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
        "json_object": {"type": "json_object"},
        "regex": regex_grammar(new_regex),
        "choice": choice_grammar(["on", "off"]),
        "grammar": lark_grammar('start: "a" | "b"'),
    }
    counts = {kind: sample(server, "conveyor_constrained_requests_total", kind=kind) for kind in kinds}
    masks = sample(server, "conveyor_grammar_mask_duration_seconds_count")

    post(server, request("x", None, 4))  # unconstrained: no mask is computed for it
    assert sample(server, "conveyor_grammar_mask_duration_seconds_count") == masks

    compiles = sample(server, "conveyor_grammar_compile_duration_seconds_count")
    post(server, request("x", kinds["regex"], 12))
    assert sample(server, "conveyor_grammar_compile_duration_seconds_count") == compiles + 1
    post(server, request("y", kinds["regex"], 12))  # the same constraint again: compiled already
    assert sample(server, "conveyor_grammar_compile_duration_seconds_count") == compiles + 1
    assert sample(server, "conveyor_grammar_mask_duration_seconds_count") > masks

    for grammar in kinds.values():
        post(server, request("x", grammar, 12))
    for kind in kinds:
        expected = counts[kind] + (3 if kind == "regex" else 1)
        assert sample(server, "conveyor_constrained_requests_total", kind=kind) == expected, kind


# ------------------------------------------------------------------------------------------ 4. 2 shards, preemption

POOL = 128  # tokens: 8 blocks of 16, the whole KV pool of the 2-shard deployment


@pytest.fixture(scope="module")
def sharded_tiny_pool(tiny_model: Path) -> Iterator[Server]:
    """2 tensor-parallel ranks (gloo on CPU) with a KV pool of 8 blocks: a few constrained requests of ~60
    tokens outgrow it together, so the scheduler preempts and later resumes them (recomputing their KV and
    replaying their tokens into a fresh matcher)."""
    server = start_server(
        tiny_model,
        "--num-shard",
        "2",
        "--master-port",
        str(free_port()),
        "--max-total-tokens",
        str(POOL),
        "--max-batch-total-tokens",
        str(POOL),
    )
    try:
        info = server.info()
        assert info["num_shard"] == 2 and info["kv_blocks_total"] * info["block_size"] == POOL
        yield server
    finally:
        assert server.stop() == 0


def test_constrained_outputs_survive_preemption_and_tensor_parallelism(
    server: Server, sharded_tiny_pool: Server
) -> None:
    """The same seeded requests: in a batch on the session deployment (1 shard, room for all), in a batch on the
    2-shard tiny pool (preempted and resumed), and alone there. Same outputs everywhere, and all valid."""
    cases = [(PERSON, 8), (ORDER, 2)]
    bodies = [
        request(PROMPTS[n % len(PROMPTS)], json_grammar(schema), POOL - 8, seed=7000 + n)
        for schema, count in cases
        for n in range(count)
    ]
    schemas = [schema for schema, count in cases for _ in range(count)]
    batched = post_all(server, bodies)
    preempted_before = sharded_tiny_pool.metric("conveyor_preemptions_total")
    preempted = post_all(sharded_tiny_pool, bodies)
    assert sharded_tiny_pool.metric("conveyor_preemptions_total") > preempted_before
    alone = [post(sharded_tiny_pool, bodies[n]) for n in (0, len(bodies) - 1)]
    for schema, body, one, other in zip(schemas, bodies, batched, preempted):
        assert valid_json(schema)(constrained_text(other, server.model_dir)), (body, other["generated_text"])
        assert other["details"]["finish_reason"] == "eos_token", (body, other)
        assert ids(other) == ids(one), (body, one["generated_text"], other["generated_text"])
    assert [ids(r) for r in alone] == [ids(preempted[0]), ids(preempted[-1])]
    assert len({r["generated_text"] for r in preempted}) == len(bodies)
    wait_for(lambda: all_blocks_free(sharded_tiny_pool), 30, "every block to be free again")
