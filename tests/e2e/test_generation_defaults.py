"""generation_config.json's sampling defaults: applied where a request leaves them unset, overridden where it sets
them, shown in /info; end to end against transformers' `generate()`, which reads the same file."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ORACLE_PROMPTS, Server, _load, greedy_reference, one_torch_thread, start_server

from conveyor.router.api.base import parse
from conveyor.router.api.tgi import Sampling
from conveyor.router.pipeline.generation_defaults import GenerationDefaults

DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.5}


def checker(name: str, value: object) -> object:
    """A request's rule for one sampling parameter (what `Validation.check_parameter` does)."""
    return getattr(parse(Sampling, {name: value}), name)


def write_config(folder: Path, **fields: object) -> Path:
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **fields}))
    return folder


def test_warpers_apply_only_where_the_file_samples(tmp_path: Path) -> None:
    sampling = GenerationDefaults.read(write_config(tmp_path, **DEFAULTS), checker)
    assert sampling.to_json() == DEFAULTS
    greedy_file = GenerationDefaults.read(write_config(tmp_path, temperature=0.6, repetition_penalty=1.2), checker)
    assert greedy_file.to_json() == {"repetition_penalty": 1.2}  # generate() ignores warpers without do_sample
    assert GenerationDefaults.read(tmp_path / "nowhere", checker).to_json() == {}


def test_a_request_keeps_what_it_sets(tmp_path: Path) -> None:
    defaults = GenerationDefaults.read(write_config(tmp_path, **DEFAULTS), checker)
    assert defaults.apply(Sampling()) == Sampling(**DEFAULTS)
    assert defaults.apply(Sampling(temperature=1.3)).temperature == 1.3
    assert defaults.apply(Sampling(temperature=1.0)).temperature == 1.0  # set, though to the schema's default
    assert defaults.apply(Sampling(top_k=5)).top_p == 0.9
    # Greedy asked for: no warper comes back, the penalty still applies (as in generate()).
    assert defaults.apply(Sampling(do_sample=False)) == Sampling(do_sample=False, repetition_penalty=1.5)
    assert defaults.apply(Sampling(do_sample=False, repetition_penalty=1.0)).repetition_penalty == 1.0


def test_a_refused_value_is_dropped(tmp_path: Path) -> None:
    defaults = GenerationDefaults.read(write_config(tmp_path, do_sample=True, top_k=-1, temperature=0.7), checker)
    assert defaults.to_json() == {"do_sample": True, "temperature": 0.7}
    off = GenerationDefaults.read(write_config(tmp_path, do_sample=True, top_k=0, min_p=0.05), checker)
    assert off.to_json() == {"do_sample": True, "top_k": 0, "min_p": 0.05}  # top_k 0 is "off", and kept


@pytest.fixture(scope="module")
def tuned(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """The tiny model with a chat model's sampling defaults in its generation_config.json."""
    folder = tmp_path_factory.mktemp("tuned") / "tiny"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **DEFAULTS}))
    server = start_server(folder)
    yield server, folder
    server.stop()


def generate(server: Server, prompt: str, **parameters: object) -> dict:
    body = {"inputs": prompt, "parameters": {"details": True, **parameters}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["details"]


def reference_with_file_defaults(folder: Path, prompt: str, n: int) -> list[int]:
    """generate() greedy, with the repetition penalty it reads from the model's generation_config.json."""
    model, tokenizer = _load(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    assert model.generation_config.repetition_penalty == DEFAULTS["repetition_penalty"]
    with torch.inference_mode(), one_torch_thread():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_defaults_end_to_end(tuned: tuple[Server, Path], tiny_model: Path) -> None:
    server, folder = tuned
    assert server.info()["generation_defaults"] == DEFAULTS
    prompt, n = ORACLE_PROMPTS[1]
    # Unset: the file's sampling applies (a sampled request gets a seed), ...
    assert generate(server, prompt, max_new_tokens=4)["seed"] is not None
    # greedy asked for: the file's repetition penalty still applies, exactly as generate() applies it, ...
    greedy = generate(server, prompt, max_new_tokens=n, do_sample=False)
    assert greedy["seed"] is None
    assert [t["id"] for t in greedy["tokens"]] == reference_with_file_defaults(folder, prompt, n)
    # and a request that sets the penalty overrides it.
    plain = generate(server, prompt, max_new_tokens=n, do_sample=False, repetition_penalty=1.0)
    assert [t["id"] for t in plain["tokens"]] == greedy_reference(tiny_model, prompt, n)


def test_openai_temperature_zero_is_greedy_despite_the_defaults(tuned: tuple[Server, Path]) -> None:
    server, folder = tuned
    prompt, n = ORACLE_PROMPTS[1]
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    _, tokenizer = _load(folder)
    want = tokenizer.decode(reference_with_file_defaults(folder, prompt, n), skip_special_tokens=True)
    assert response.json()["choices"][0]["text"] == want
