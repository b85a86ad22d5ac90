"""Gemma 3's images in the shard's engine: the vision tower's embeddings in place of the image's soft tokens, the
image's tokens attending to each other both ways, in chunks beside a text-only request; greedy tokens equal to
transformers' `generate()` with the same pixels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vision import image_reference, png, reference_inputs

from conveyor.shard.batch.request_state import BadRequest
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.step.engine import Engine
from conveyor.v1 import shard_pb2 as pb

BLOCKS = 8  # per request: 128 tokens
NEW_TOKENS = 6
# Long enough that the windowed layer (16 tokens) slides over the image's tokens.
TEXT = "Describe the picture above in a few words, then say what colour it mostly is."


def _request(request_id: int, inputs: dict, chunk: int | None = None) -> pb.Request:
    ids = inputs["input_ids"][0].tolist()
    request = pb.Request(
        id=request_id,
        input_ids=ids,
        blocks=range(request_id * BLOCKS, (request_id + 1) * BLOCKS),
        parameters=pb.SamplingParameters(),
        stopping_parameters=pb.StoppingParameters(max_new_tokens=NEW_TOKENS, ignore_eos_token=True),
        chunk_len=chunk,
    )
    soft = inputs["token_type_ids"][0] if "token_type_ids" in inputs else torch.zeros(len(ids))
    positions = torch.nonzero(soft == 1).flatten().tolist()
    runs = _runs(positions)
    for (offset, length), pixels in zip(runs, inputs.get("pixel_values", [])):
        request.images.add(offset=offset, length=length, pixel_values=pixels.numpy().tobytes(), shape=pixels.shape)
    return request


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


@pytest.fixture(scope="module")
def engine(gemma3_multimodal_model: Path) -> Engine:
    engine = Engine(gemma3_multimodal_model, "float32", torch.device("cpu"), ProcessGroup(0, 1))
    engine.cache = engine.allocate(4 * BLOCKS)
    return engine


def _generate(engine: Engine, batch, tokens: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    """Steps until every request finished, dropping the finished ones from the batch as the router does."""
    tokens = {} if tokens is None else tokens
    while batch is not None:
        generations, batch, _ = engine.step(batch)
        for g in generations:
            tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
        if batch is not None:
            done = {g.request_id for g in generations if g.HasField("finished")}
            batch = batch.filter([r.id for r in batch.requests if r.id not in done]) if done else batch
    return tokens


def test_images_in_chunks_beside_text_equal_transformers(engine: Engine, gemma3_multimodal_model: Path) -> None:
    """Two images (read in two chunks, the first ending where the second image starts) and a text-only request
    in the same steps: each one's greedy tokens are transformers' own."""
    model = gemma3_multimodal_model
    images = [png(40, 30, seed=1), png(30, 50, seed=2)]
    with_images = reference_inputs(model, TEXT, images)
    second = _runs(torch.nonzero(with_images["token_type_ids"][0] == 1).flatten().tolist())[1][0]
    text_only = reference_inputs(model, TEXT, [])
    joining = pb.Batch(id=1, requests=[_request(0, with_images, chunk=second), _request(1, text_only)])
    batch = engine.batch(joining)
    generations, batch, _ = engine.step(batch)
    batch.update([pb.RequestUpdate(request_id=0, chunk_len=len(with_images["input_ids"][0]) - second)])
    tokens = _generate(engine, batch, {g.request_id: list(g.tokens.ids) for g in generations})
    assert tokens[0] == image_reference(model, TEXT, images, NEW_TOKENS)
    assert tokens[1] == image_reference(model, TEXT, [], NEW_TOKENS)


def test_another_image_gives_other_tokens(engine: Engine, gemma3_multimodal_model: Path) -> None:
    """The image really reaches the model: two images, two answers (each transformers')."""
    answers = []
    for seed in (3, 4):
        inputs = reference_inputs(gemma3_multimodal_model, TEXT, [png(28, 28, seed)])
        tokens = _generate(engine, engine.batch(pb.Batch(id=2 + seed, requests=[_request(0, inputs)])))[0]
        assert tokens == image_reference(gemma3_multimodal_model, TEXT, [png(28, 28, seed)], NEW_TOKENS)
        answers.append(tokens)
    assert answers[0] != answers[1]


def test_a_chunk_ending_inside_an_image_is_refused(engine: Engine, gemma3_multimodal_model: Path) -> None:
    inputs = reference_inputs(gemma3_multimodal_model, TEXT, [png(28, 28, 5)])
    start = _runs(torch.nonzero(inputs["token_type_ids"][0] == 1).flatten().tolist())[0][0]
    with pytest.raises(BadRequest, match="inside an image"):
        engine.step(engine.batch(pb.Batch(id=9, requests=[_request(0, inputs, chunk=start + 1)])))


def test_a_cached_prefix_ending_inside_an_image(engine: Engine, gemma3_multimodal_model: Path) -> None:
    """The prefix cache may end inside an image (its KV was computed with the whole image): the next request reads
    the rest of the image's tokens, still seeing each other both ways, and gets transformers' tokens."""
    model, images = gemma3_multimodal_model, [png(28, 28, seed=6)]
    block = engine.block_size
    for words in range(1, 12):  # text before the image until the image's tokens straddle the first block's end
        before = " ".join(["look"] * words)
        inputs = reference_inputs(model, TEXT, images, before)
        offset, length = _runs(torch.nonzero(inputs["token_type_ids"][0] == 1).flatten().tolist())[0]
        if offset < block < offset + length:
            break
    else:
        pytest.fail("no prefix puts the image across a block boundary")
    _generate(engine, engine.batch(pb.Batch(id=20, requests=[_request(0, inputs)])))  # writes blocks 0..
    again = _request(1, inputs)
    again.blocks[0] = 0  # the first request's first block, as a prefix-cache hit shares it
    again.cache_len = block
    tokens = _generate(engine, engine.batch(pb.Batch(id=21, requests=[again])))[1]
    assert tokens == image_reference(model, TEXT, images, NEW_TOKENS, before=before)
