"""The shard's pooling against sentence-transformers on a random-weight Qwen3 embedding checkpoint built offline,
and the rerank score against a transformers reference computed the way Qwen3-Reranker's model card does.

The hidden states come from transformers here (the engine's own forward is held to transformers by the oracle
tests), so these pin the pooling, the normalization and the reading of the checkpoint's modules. Tolerance: float32,
atol 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sentence_transformers_files import write_pooling_files

from conveyor import demo_model
from conveyor.pooling import read_pooling
from conveyor.shard.step.pooling import pool, pool_rows, yes_no_score

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
