"""A chat's images in the router: the prompt the processor would make (ids and pixels equal transformers'), text
written by the caller kept text, refusals by name, image tokens counted as prompt tokens, chunks that never end
inside an image, and prefix-cache keys that tell images apart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_step_planner import Sim
from transformers import AutoTokenizer
from vision import data_url, png, reference_inputs

from conveyor.router.api.base import ValidationError, parse
from conveyor.router.api.openai import ChatRequest
from conveyor.router.core.sequence import Sequence
from conveyor.router.limits import Limits
from conveyor.router.pipeline.images import MAX_STEP_PIXEL_BYTES, ImageInput
from conveyor.router.pipeline.openai_requests import OpenAIRequests
from conveyor.router.pipeline.request import Parameters, ValidRequest
from conveyor.router.pipeline.validation import Validation

TEXT = "Describe the picture"


def _requests(model: Path, max_input_tokens: int = 400) -> OpenAIRequests:
    tokenizer = AutoTokenizer.from_pretrained(model)
    limits = Limits(max_input_tokens, max_input_tokens + 100)
    return OpenAIRequests(Validation(tokenizer, limits, model_dir=str(model)))


def _body(images: list[bytes], text: str = TEXT) -> ChatRequest:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    content = [*parts, {"type": "text", "text": text}]
    return parse(ChatRequest, {"messages": [{"role": "user", "content": content}], "temperature": 0})


def test_the_prompt_and_pixels_are_the_processors(gemma3_multimodal_model: Path) -> None:
    images = [png(40, 30, seed=1), png(30, 50, seed=2)]
    valid = _requests(gemma3_multimodal_model).chat_choices(_body(images))[0].request
    reference = reference_inputs(gemma3_multimodal_model, TEXT, images)
    assert list(valid.input_ids) == reference["input_ids"][0].tolist()
    placed = valid.parameters.images
    assert [(i.offset, i.length) for i in placed] == _runs(reference["token_type_ids"][0].tolist())
    for image, pixels in zip(placed, reference["pixel_values"]):
        assert np.array_equal(np.frombuffer(image.pixel_values, "<f4").reshape(image.shape), pixels.numpy())
    assert placed[0].digest != placed[1].digest


def _runs(kinds: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for position, kind in enumerate(kinds):
        if kind and runs and sum(runs[-1]) == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        elif kind:
            runs.append((position, 1))
    return runs


def test_a_placeholder_the_caller_writes_stays_text(gemma3_multimodal_model: Path) -> None:
    """`<start_of_image>` in the caller's text is neither an image nor a control token: one image, one run."""
    valid = _requests(gemma3_multimodal_model).chat_choices(_body([png(28, 28, 3)], "<start_of_image> what?"))[0]
    tokenizer = AutoTokenizer.from_pretrained(gemma3_multimodal_model)
    assert valid.request.input_ids.count(tokenizer.convert_tokens_to_ids("<start_of_image>")) == 1
    assert len(valid.request.parameters.images) == 1


def test_image_tokens_count_against_the_input_limit(gemma3_multimodal_model: Path) -> None:
    prompt_tokens = len(_requests(gemma3_multimodal_model).chat_choices(_body([]))[0].request.input_ids)
    with pytest.raises(ValidationError, match="tokens"):  # its 4 soft tokens and their markers push it over
        _requests(gemma3_multimodal_model, prompt_tokens + 4).chat_choices(_body([png(28, 28, 4)]))


def test_a_text_model_refuses_images_and_joins_text_parts(tiny_model: Path) -> None:
    requests = _requests(tiny_model)
    with pytest.raises(ValidationError, match="takes no images"):
        requests.chat_choices(_body([png(28, 28, 5)]))
    valid = requests.chat_choices(_body([], "one two"))[0].request
    assert "one two" in valid.inputs and not valid.parameters.images


def _image_sequence(
    n: int, digest: bytes, prompt: int = 40, offset: int = 10, length: int = 8, pixel_bytes: int = 0
) -> Sequence:
    image = ImageInput(offset, length, bytes(pixel_bytes), (3, 1, 1), digest)
    ids = tuple(range(prompt))
    parameters = Parameters(max_new_tokens=2, images=(image,))
    return Sequence(id=n, request=ValidRequest(inputs="x", input_ids=ids, parameters=parameters))


def test_chunks_never_end_inside_an_image() -> None:
    """A budget that would end a chunk inside the image stops it before the image, or (with nothing before it)
    takes the whole image in."""
    sim = Sim(max_batch_prefill_tokens=14)  # 10 tokens, then the image's 8 would be cut at 4
    sequence = _image_sequence(0, b"a" * 32)
    sim.submit(sequence)
    chunks = []
    while sequence.is_prefilling or not sequence.generated_ids:
        sim.step()
        chunks.append(sim.tokens_of(sequence))
    ends = [sum(chunks[: i + 1]) for i in range(len(chunks))]
    assert chunks[0] == 10 and not any(10 < end < 18 for end in ends), chunks
    sim = Sim(max_batch_prefill_tokens=4)  # from the image's start: the whole image, over the budget
    sequence = _image_sequence(1, b"a" * 32, offset=0)
    sim.submit(sequence)
    sim.step()
    assert sim.tokens_of(sequence) == 8


def test_the_prefix_cache_keys_image_blocks_by_the_image() -> None:
    """The same tokens with the same image hit; with another image, no block holding it does."""
    sim = Sim()
    first, again, other = (_image_sequence(n, d) for n, d in enumerate((b"a" * 32, b"a" * 32, b"b" * 32)))
    sim.submit(first)
    sim.run()
    sim.submit(again, other)
    sim.step()
    assert sim.work_of(again).cache_len == 32 and sim.work_of(other).cache_len == 0


def test_a_step_carries_a_bounded_weight_of_pixels() -> None:
    """Two requests whose images' pixels together pass MAX_STEP_PIXEL_BYTES join in two steps, not one."""
    sim = Sim()
    half = MAX_STEP_PIXEL_BYTES // 2 + 1
    first, second = (_image_sequence(n, bytes([n]) * 32, pixel_bytes=half) for n in range(2))
    sim.submit(first, second)
    assert sim.step().admitted == [first]
    assert sim.step().admitted == [second]


def test_smolvlm_prompt_and_tiles_are_the_processors(smolvlm_model: Path) -> None:
    """SmolVLM's processor splits each image into tiles (2 x 2, 1 x 2, and a small one upscaled to 2 x 2), each
    behind its `<row_i_col_j>`, then the whole image: the router's prompt ids and each tile's pixels equal the
    processor's, every tile an image of its own to the shards, in order."""
    images = [png(40, 30, seed=1), png(60, 20, seed=2), png(10, 10, seed=3)]
    valid = _requests(smolvlm_model).chat_choices(_body(images))[0].request
    reference = reference_inputs(smolvlm_model, TEXT, images)
    assert list(valid.input_ids) == reference["input_ids"][0].tolist()
    placed = valid.parameters.images
    tiles = [t for t in reference["pixel_values"][0] if t.any()]  # the processor pads the batch with empty tiles
    assert len(placed) == len(tiles) == 5 + 3 + 5
    for image, pixels in zip(placed, tiles):
        assert np.array_equal(np.frombuffer(image.pixel_values, "<f4").reshape(image.shape), pixels.numpy())
    image_token = AutoTokenizer.from_pretrained(smolvlm_model).convert_tokens_to_ids("<image>")
    ids = reference["input_ids"][0].tolist()
    assert [(i.offset, i.length) for i in placed] == _runs([int(t == image_token) for t in ids])
    assert len({i.digest for i in placed}) == len(placed)


def test_smolvlm_markdown_images_are_the_processors(smolvlm_model: Path) -> None:
    """TGI's `![](data URL)` in `inputs` is the processor's expansion of `<image>` where it stands."""
    import io

    from PIL import Image
    from transformers import AutoProcessor

    images = [png(60, 20, seed=4)]
    tokenizer = AutoTokenizer.from_pretrained(smolvlm_model)
    validation = Validation(tokenizer, Limits(400, 500), model_dir=str(smolvlm_model))
    text, pixels = validation.images.markdown(f"Look: ![]({data_url(images[0])}) and say.")
    processor = AutoProcessor.from_pretrained(smolvlm_model)
    reference = processor(text="Look: <image> and say.", images=[Image.open(io.BytesIO(images[0]))])
    assert tokenizer(text)["input_ids"] == reference["input_ids"][0]
    assert len(pixels[0].tiles) == 3


# SmolVLM's own chat template (SmolVLM-Instruct's): every message's content is read as a list of parts.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_string_content_reaches_a_template_of_parts(smolvlm_model: Path) -> None:
    """A message whose content is a string is one text part to an image-text model's template: SmolVLM's own
    writes nothing of a string."""
    tokenizer = AutoTokenizer.from_pretrained(smolvlm_model)
    tokenizer.chat_template = SMOLVLM_TEMPLATE
    requests = OpenAIRequests(Validation(tokenizer, Limits(400, 500), model_dir=str(smolvlm_model)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    valid = requests.chat_choices(parse(ChatRequest, {"messages": messages}))[0].request
    assert (
        valid.inputs
        == "<|im_start|>System: Be brief.<end_of_utterance>\nUser: Hello there<end_of_utterance>\nAssistant:"
    )
