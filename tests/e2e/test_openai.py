"""OpenAI-compatible routes through the unmodified `openai` SDK, and TGI's /tokenize and top_n_tokens."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import Server, greedy_reference, one_torch_thread


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def model_id(server: Server) -> str:
    return str(server.model_dir)


def test_models_lists_the_served_model(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list()] == [model_id(server)]


def test_completion_greedy_matches_generate(client: openai.OpenAI, server: Server) -> None:
    completion = client.completions.create(model=model_id(server), prompt="def add(a, b):", max_tokens=8, temperature=0)
    tgi = httpx.post(f"{server.url}/generate", json={"inputs": "def add(a, b):", "parameters": {"max_new_tokens": 8}})
    choice = completion.choices[0]
    assert choice.text == tgi.json()["generated_text"] and choice.finish_reason == "length"
    prompt_tokens = len(httpx.post(f"{server.url}/tokenize", json={"inputs": "def add(a, b):"}).json())
    assert completion.usage.completion_tokens == 8 and completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.total_tokens == prompt_tokens + 8


def test_completion_stream_with_usage(client: openai.OpenAI, server: Server) -> None:
    chunks = list(
        client.completions.create(
            model=model_id(server),
            prompt="import os",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    plain = client.completions.create(model=model_id(server), prompt="import os", max_tokens=6, temperature=0)
    assert "".join(texts) == plain.choices[0].text


def test_completion_n_logprobs_seed_and_stop(client: openai.OpenAI, server: Server) -> None:
    completion = client.completions.create(
        model=model_id(server), prompt="x = ", max_tokens=5, n=3, seed=11, temperature=0.9, logprobs=2
    )
    assert sorted(c.index for c in completion.choices) == [0, 1, 2]
    for choice in completion.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(len(top) <= 2 for top in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    again = client.completions.create(
        model=model_id(server), prompt="x = ", max_tokens=5, n=3, seed=11, temperature=0.9, logprobs=2
    )
    assert [c.text for c in again.choices] == [c.text for c in completion.choices]
    greedy = client.completions.create(model=model_id(server), prompt="class Queue:", max_tokens=12, temperature=0)
    stop = greedy.choices[0].text[3:6]
    stopped = client.completions.create(
        model=model_id(server), prompt="class Queue:", max_tokens=12, temperature=0, stop=stop
    )
    assert stopped.choices[0].finish_reason == "stop" and stop in stopped.choices[0].text


def test_chat_completion_uses_the_chat_template(client: openai.OpenAI, server: Server) -> None:
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A queue class?"}]
    chat = client.chat.completions.create(model=model_id(server), messages=messages, max_tokens=7, temperature=0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    expected = tokenizer.decode(greedy_reference_ids(server, ids, 7))
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content == expected
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 7


def greedy_reference_ids(server: Server, ids: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode(), one_torch_thread():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def test_chat_stream_with_logprobs_and_usage(client: openai.OpenAI, server: Server) -> None:
    stream = client.chat.completions.create(
        model=model_id(server),
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        stream=True,
        logprobs=True,
        top_logprobs=3,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]  # one per token (a token may carry "" mid-character)
    assert len(content) == 4 and content[-1].choices[0].finish_reason == "length"
    for c in content:
        entry = c.choices[0].logprobs.content[0]
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.total_tokens > 4


def test_openai_errors_have_openai_shape(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as error:
        client.completions.create(model=model_id(server), prompt="x", max_tokens=10_000)
    body = error.value.body
    assert body["type"] == "invalid_request_error"
    assert body["message"].startswith("`max_tokens` must be at most ") and "(max_total_tokens)" in body["message"]
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]}, {"messages": "hi"}):
        r = httpx.post(f"{server.url}/v1/chat/completions", json=bad)
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "suffix": "y"})
    assert r.status_code == 422 and "suffix" in r.json()["error"]["message"]


def test_tokenize_matches_the_tokenizer(server: Server) -> None:
    from transformers import AutoTokenizer

    tokens = httpx.post(f"{server.url}/tokenize", json={"inputs": "héllo world"}).json()
    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    assert [t["id"] for t in tokens] == tokenizer("héllo world").input_ids
    assert all(set(t) == {"id", "text", "start", "stop"} for t in tokens)
    assert all(t["text"] == "héllo world"[t["start"] : t["stop"]] for t in tokens)  # character offsets
    starts = [t["start"] for t in tokens]
    assert tokens[-1]["stop"] == len("héllo world") and starts == sorted(starts)


def test_top_n_tokens_on_generate_and_stream(server: Server) -> None:
    body = {"inputs": "def f():", "parameters": {"max_new_tokens": 3, "top_n_tokens": 2, "details": True}}
    details = httpx.post(f"{server.url}/generate", json=body).json()["details"]
    assert len(details["top_tokens"]) == 3
    for token, top in zip(details["tokens"], details["top_tokens"]):
        assert len(top) == 2 and top[0]["id"] == token["id"]  # greedy: the chosen token is the most likely
        assert top[0]["logprob"] >= top[1]["logprob"]
    assert [t["id"] for t in details["tokens"]] == greedy_reference(server.model_dir, "def f():", 3)


HI = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOOLS = [{"type": "function", "function": {"name": "f"}}]
# (route, body, the message's start): each refusal names the field as the body spells it. `{...}` are /info's.
REFUSALS = [
    (COMPLETIONS, {"prompt": "x", "max_tokens": 10_000}, "`max_tokens` must be at most {max_new} on this server"),
    (CHAT, {"messages": HI, "max_completion_tokens": 10_000}, "`max_completion_tokens` must be at most {max_new} on"),
    (CHAT, {"messages": HI, "stop": ["a"] * 9}, "`stop` must be at most {max_stop_sequences} items on this server"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 99}, "`logprobs` must be at most {max_top_n_tokens} on this server"),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 99}, "`top_logprobs` must be at most {max_top_n_tokens}"),
    (CHAT, {"messages": HI, "temperature": 3}, "`temperature`: Input should be less than or equal to 2. Given: 3"),
    (CHAT, {"messages": HI, "top_k": -1}, "`top_k`: Input should be greater than or equal to 0. Given: -1"),
    (COMPLETIONS, {"prompt": "x", "min_p": 2}, "`min_p`: Input should be less than or equal to 1. Given: 2"),
    (CHAT, {"messages": HI, "top_q": 0.5}, "`top_q`: unknown field: Conveyor does not support it"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, "`echo`: is not supported"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "`suffix`: is not supported"),
    (COMPLETIONS, {"prompt": "x", "best_of": 2}, "`best_of`: is not supported"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"1": 100}}, "`logit_bias`: is not supported"),
    (CHAT, {"messages": HI, "functions": [{"name": "f"}]}, "`functions`: is not supported"),
    (CHAT, {"messages": HI, "function_call": "auto"}, "`function_call`: is not supported"),
    (CHAT, {"messages": []}, "`messages`: List should have at least 1 item"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "`messages.0.role`: Input should be 'system'"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, "`top_logprobs` needs `logprobs` set to true"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "`stream_options` is only allowed when"),
    (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 3}, "at most 8 choices (prompts times `n`) per request"),
    # Fields of more than one type (a string or a list, an option or an object, a schema or its text): the path
    # is the body's, and the problem is that of the type the value has.
    (COMPLETIONS, {"prompt": []}, "`prompt`: List should have at least 1 item"),
    (COMPLETIONS, {"prompt": [""]}, "`prompt.0`: String should have at least 1 character"),
    (CHAT, {"messages": HI, "stop": [""]}, "`stop.0`: String should have at least 1 character"),
    (
        CHAT,
        {"messages": HI, "tools": TOOLS, "tool_choice": {"type": "function"}},
        "`tool_choice.function`: missing field",
    ),
    (
        CHAT,
        {"messages": HI, "response_format": {"type": "json_schema"}},
        "`response_format.json_schema`: missing field",
    ),
    (COMPLETIONS, {"prompt": "x", "guided_json": 5}, "`guided_json`: "),
]


@pytest.mark.parametrize(("route", "body", "message"), REFUSALS, ids=[m.split("`")[1] for _, _, m in REFUSALS])
def test_openai_refusals_name_the_field(server: Server, route: str, body: dict, message: str) -> None:
    info = httpx.get(f"{server.url}/info").json()
    expected = message.format(**info, max_new=info["max_total_tokens"] - 1)
    r = httpx.post(f"{server.url}{route}", json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(expected), error["message"]
