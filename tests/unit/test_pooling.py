"""The shard's pooling against sentence-transformers on a random-weight Qwen3 embedding checkpoint built offline,
and the rerank score against a transformers reference computed the way Qwen3-Reranker's model card does; then the
engine's own prompt-only rows, read in chunks in a step beside a generating request.

The hidden states come from transformers here (the engine's own forward is held to transformers by the oracle
tests), so these pin the pooling, the normalization and the reading of the checkpoint's modules. Tolerance: float32,
atol 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import greedy_reference

from benchmarks.embedding_model import write_pooling_files
from conveyor import demo_model
from conveyor.pooling import read_pooling
from conveyor.shard.batch.request_state import BadRequest
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.step.engine import Engine
from conveyor.shard.step.pooling import pool, pool_rows, yes_no_score
from conveyor.v1 import shard_pb2 as pb

TEXTS = ["The quick brown fox jumps over the lazy dog", "hello", "Embeddings from a decoder, pooled"]
ATOL = 1e-5


def _embedding_checkpoint(base: Path, mode_flag: str, normalize: bool) -> Path:
    path = demo_model.ensure(base, "tiny", seed=3, arch="qwen3")
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    modes = ("pooling_mode_lasttoken", "pooling_mode_mean_tokens", "pooling_mode_cls_token")
    return write_pooling_files(path, {f: f == mode_flag for f in modes}, normalize, hidden)


@pytest.mark.parametrize("mode_flag", ["pooling_mode_lasttoken", "pooling_mode_mean_tokens", "pooling_mode_cls_token"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_equals_sentence_transformers(tmp_path: Path, mode_flag: str, normalize: bool) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from transformers import AutoModel, AutoTokenizer

    path = _embedding_checkpoint(tmp_path / "embed", mode_flag, normalize)
    encoder = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    reference = encoder.encode(TEXTS, convert_to_numpy=True, batch_size=1)
    batched = encoder.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))  # padded: its mask must hold
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    spec = read_pooling(path)
    states, lengths = [], []
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            states.append(model(input_ids=ids).last_hidden_state[0])
            lengths.append(ids.shape[1])
    flat = torch.cat(states)
    for mine, alone, together in zip(pool_rows(flat, lengths, spec), reference, batched):
        torch.testing.assert_close(mine, torch.from_numpy(alone), atol=ATOL, rtol=0)
        torch.testing.assert_close(mine, torch.from_numpy(together), atol=ATOL, rtol=0)
    assert torch.equal(pool(states[1], spec), pool_rows(flat, lengths, spec)[1])


def test_yes_no_score_is_the_model_cards_softmax() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 3.0])
    yes, no = 3, 1
    expected = torch.log_softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1].exp()
    assert yes_no_score(logits, yes, no) == pytest.approx(float(expected), abs=1e-7)
    assert yes_no_score(logits, yes, no, raw=True) == pytest.approx(1.0)
    assert torch.sigmoid(torch.tensor(1.0)) == pytest.approx(yes_no_score(logits, yes, no))


# --- the engine: prompt-only rows in a step beside generation ----------------------------------------------------

CPU = torch.device("cpu")
BLOCKS = 8  # per request: 128 tokens


def _request(
    request_id: int, ids: list[int], pooling: pb.Pooling | None = None, chunk: int | None = None
) -> pb.Request:
    blocks = range(request_id * BLOCKS, (request_id + 1) * BLOCKS)
    request = pb.Request(
        id=request_id,
        input_ids=ids,
        blocks=blocks,
        parameters=pb.SamplingParameters(),
        stopping_parameters=pb.StoppingParameters(max_new_tokens=6),
        chunk_len=chunk,
    )
    if pooling is not None:
        request.pooling.CopyFrom(pooling)
    return request


def _engine(path: Path) -> Engine:
    engine = Engine(path, "float32", CPU, ProcessGroup(0, 1))
    engine.cache = engine.allocate(4 * BLOCKS)
    return engine


@pytest.mark.parametrize("mode_flag", ["pooling_mode_lasttoken", "pooling_mode_mean_tokens", "pooling_mode_cls_token"])
def test_the_engine_pools_prompts_read_in_chunks_beside_generation(tmp_path: Path, mode_flag: str) -> None:
    """A step mixes a generating request, a prompt-only request read in two chunks and one read whole: each vector
    is sentence-transformers', the generation's greedy tokens are transformers' own, and the prompt-only requests
    finish at the step that reads the end of their prompt, with no token."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from transformers import AutoTokenizer

    path = _embedding_checkpoint(tmp_path / "embed", mode_flag, normalize=True)
    reference = sentence_transformers.SentenceTransformer(str(path), device="cpu").encode(TEXTS[:2], batch_size=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    long_ids, short_ids = (tokenizer(text).input_ids for text in TEXTS[:2])
    spec = read_pooling(path)
    embed = pb.Pooling(embed=pb.Pooling.Embed(mode=spec.mode, normalize=spec.normalize))
    engine = _engine(path)
    prompt = "def add(a, b):"
    joining = pb.Batch(
        id=1,
        requests=[
            _request(0, tokenizer(prompt).input_ids),
            _request(1, long_ids, embed, chunk=4),
            _request(2, short_ids, embed),
        ],
    )
    generations, batch, _ = engine.step(engine.batch(joining))
    first = {g.request_id: g for g in generations}
    assert set(first) == {0, 2} and first[2].HasField("finished") and not first[2].tokens.ids
    batch = batch.filter([0, 1])
    batch.update([pb.RequestUpdate(request_id=1, chunk_len=len(long_ids) - 4)])
    generations, batch, _ = engine.step(batch)
    second = {g.request_id: g for g in generations}
    assert second[1].HasField("finished") and not second[1].tokens.ids
    for vector, expected in ((second[1].embedding, reference[0]), (first[2].embedding, reference[1])):
        torch.testing.assert_close(torch.tensor(list(vector)), torch.from_numpy(expected), atol=ATOL, rtol=0)
    tokens = [first[0].tokens.ids[0], second[0].tokens.ids[0]]
    batch = batch.filter([0])
    while batch is not None:
        generations, batch, _ = engine.step(batch)
        tokens += generations[0].tokens.ids
    assert tokens == greedy_reference(path, prompt, 6)


def test_the_engine_scores_with_the_yes_and_no_logits(tmp_path: Path) -> None:
    """A score row answers the yes-minus-no logit of its prompt's last position, as transformers computes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_model.ensure(tmp_path / "rerank", "tiny", seed=3, arch="qwen3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(TEXTS[0]).input_ids
    yes, no = 500, 700
    engine = _engine(path)
    score = pb.Pooling(score=pb.Pooling.Score(yes_token_id=yes, no_token_id=no))
    joining = pb.Batch(id=1, requests=[_request(0, ids, score), _request(1, tokenizer(TEXTS[1]).input_ids)])
    generations, batch, _ = engine.step(engine.batch(joining))
    (answer,) = [g for g in generations if g.request_id == 0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert answer.score == pytest.approx(float(logits[yes] - logits[no]), abs=ATOL)
    assert torch.sigmoid(torch.tensor(answer.score)) == pytest.approx(yes_no_score(logits, yes, no), abs=1e-6)


def test_a_pooling_over_every_position_refuses_a_cached_prefix(tmp_path: Path) -> None:
    path = demo_model.ensure(tmp_path / "rerank", "tiny", seed=3, arch="qwen3")
    engine = _engine(path)
    request = _request(0, list(range(10, 40)), pb.Pooling(embed=pb.Pooling.Embed(mode="mean")))
    request.cache_len = 16
    with pytest.raises(BadRequest, match="cache_len 0"):
        engine.batch(pb.Batch(id=1, requests=[request]))
    request.pooling.embed.mode = "max"
    request.cache_len = 0
    with pytest.raises(BadRequest, match="pooling mode 'max'"):
        engine.batch(pb.Batch(id=1, requests=[request]))


def test_a_bare_checkpoint_embeds_as_sentence_transformers_does(tmp_path: Path) -> None:
    """Qwen3-Embedding's layout: the base model alone (no `model.` prefix, no LM head), last-token pooling,
    normalized. The engine loads it and its vectors are sentence-transformers'."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from transformers import AutoModel, AutoTokenizer

    source = demo_model.ensure(tmp_path / "source", "tiny", seed=3, arch="qwen3")
    bare = tmp_path / "bare"
    AutoModel.from_pretrained(source).save_pretrained(bare, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.save_pretrained(bare)
    hidden = json.loads((bare / "config.json").read_text())["hidden_size"]
    write_pooling_files(bare, {"pooling_mode_lasttoken": True}, normalize=True, dimension=hidden)
    reference = sentence_transformers.SentenceTransformer(str(bare), device="cpu").encode(TEXTS, batch_size=1)
    engine = _engine(bare)
    embed = pb.Pooling(embed=pb.Pooling.Embed(mode="last", normalize=True))
    requests = [_request(i, tokenizer(text).input_ids, embed) for i, text in enumerate(TEXTS)]
    generations, batch, _ = engine.step(engine.batch(pb.Batch(id=1, requests=requests)))
    assert batch is None  # every request finished at its prefill
    for generation, expected in zip(sorted(generations, key=lambda g: g.request_id), reference):
        torch.testing.assert_close(
            torch.tensor(list(generation.embedding)), torch.from_numpy(expected), atol=ATOL, rtol=0
        )
