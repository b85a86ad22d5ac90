"""SmolVLM's (Idefics3's) images in the shard's engine: each tile's connector output in place of its `<image>`
tokens in Conveyor's Llama model, attended causally, in chunks beside a text-only request; greedy tokens equal to
transformers' `Idefics3ForConditionalGeneration.generate()` with the same pixels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_image_prefill import BLOCKS, NEW_TOKENS, TEXT, _generate, _runs
from vision import image_reference, png, reference_inputs

from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.step.engine import Engine
from conveyor.v1 import shard_pb2 as pb


def _image_token(model: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).image_token_id


def _request(model: Path, request_id: int, inputs: dict, chunk: int | None = None) -> pb.Request:
    """The Prefill request for the processor's inputs: each tile's `<image>` run an image of the proto."""
    ids = inputs["input_ids"][0]
    request = pb.Request(
        id=request_id,
        input_ids=ids.tolist(),
        blocks=range(request_id * BLOCKS, (request_id + 1) * BLOCKS),
        parameters=pb.SamplingParameters(),
        stopping_parameters=pb.StoppingParameters(max_new_tokens=NEW_TOKENS, ignore_eos_token=True),
        chunk_len=chunk,
    )
    runs = _runs(torch.nonzero(ids == _image_token(model)).flatten().tolist())
    tiles = inputs["pixel_values"][0] if "pixel_values" in inputs else []
    assert len(runs) == len(tiles)
    for (offset, length), pixels in zip(runs, tiles):
        request.images.add(offset=offset, length=length, pixel_values=pixels.numpy().tobytes(), shape=pixels.shape)
    return request


@pytest.fixture(scope="module")
def engine(smolvlm_model: Path) -> Engine:
    engine = Engine(smolvlm_model, "float32", torch.device("cpu"), ProcessGroup(0, 1))
    engine.cache = engine.allocate(4 * BLOCKS)
    assert not engine.vision.bidirectional
    return engine


def test_tiles_in_chunks_beside_text_equal_transformers(engine: Engine, smolvlm_model: Path) -> None:
    """An image split into 2 x 2 tiles and its global tile, read in two chunks (the second from the third tile
    on), and a text-only request in the same steps: each one's greedy tokens are transformers' own."""
    model, images = smolvlm_model, [png(40, 30, seed=1)]
    with_images = reference_inputs(model, TEXT, images)
    assert with_images["pixel_values"].shape[1] == 5  # the tiles and the whole image
    third = _runs(torch.nonzero(with_images["input_ids"][0] == _image_token(model)).flatten().tolist())[2][0]
    text_only = reference_inputs(model, TEXT, [])
    joining = pb.Batch(id=1, requests=[_request(model, 0, with_images, chunk=third), _request(model, 1, text_only)])
    batch = engine.batch(joining)
    generations, batch, _ = engine.step(batch)
    batch.update([pb.RequestUpdate(request_id=0, chunk_len=len(with_images["input_ids"][0]) - third)])
    tokens = _generate(engine, batch, {g.request_id: list(g.tokens.ids) for g in generations})
    assert tokens[0] == image_reference(model, TEXT, images, NEW_TOKENS)
    assert tokens[1] == image_reference(model, TEXT, [], NEW_TOKENS)


def test_another_image_gives_other_tokens(engine: Engine, smolvlm_model: Path) -> None:
    """The image really reaches the model: two images, two answers, each transformers'."""
    answers = []
    for seed in (3, 4):
        image = [png(28, 28, seed)]
        inputs = reference_inputs(smolvlm_model, TEXT, image)
        batch = engine.batch(pb.Batch(id=2 + seed, requests=[_request(smolvlm_model, 0, inputs)]))
        tokens = _generate(engine, batch)[0]
        assert tokens == image_reference(smolvlm_model, TEXT, image, NEW_TOKENS)
        answers.append(tokens)
    assert answers[0] != answers[1]


def test_image_tokens_attend_causally(engine: Engine, smolvlm_model: Path) -> None:
    """The first token's log-probability is transformers' own to 1e-4: the greedy tokens alone would not tell an
    image's tokens seeing each other both ways (Gemma 3's rule, off by about 1e-2 here) from Idefics3's causal
    attention."""
    from vision import _load

    inputs = reference_inputs(smolvlm_model, TEXT, [png(40, 30, seed=7)])
    generations, _, _ = engine.step(engine.batch(pb.Batch(id=30, requests=[_request(smolvlm_model, 0, inputs)])))
    model, _ = _load(smolvlm_model)
    with torch.inference_mode():
        logits = model(**inputs).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)[generations[0].tokens.ids[0]].item()
    assert generations[0].tokens.logprobs[0] == pytest.approx(expected, abs=1e-4)
