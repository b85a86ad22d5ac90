"""Images in, text out, through the real launcher, router and shards: OpenAI chat requests with an image (a base64
data URL) on the random-weight Gemma 3 image-text model yield exactly the greedy tokens transformers'
`Gemma3ForConditionalGeneration.generate()` yields with its processor, alone, beside each other and beside a
text-only request in the same batch, on 1 and 2 shards (the vision tower whole on each rank); the prefix cache
shares an image's blocks only with the same image; and a bad image is a 4xx naming the fault, after which the
server serves on.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import (
    ORACLE_PROMPTS,
    Deployments,
    Server,
    StreamWatcher,
    free_port,
    greedy_reference,
    start_server,
    wait_for,
)
from transformers import AutoTokenizer
from vision import chat, check_chat, data_url, image_reference, png

NEW_TOKENS = 8
TEXT = "Describe the picture above in a few words, then say what colour it mostly is."


@pytest.fixture(scope="module")
def deployments(gemma3_multimodal_model: Path) -> Iterator[Deployments]:
    def start(*flags: str) -> Server:
        return start_server(
            gemma3_multimodal_model, "--max-total-tokens", "512", "--master-port", str(free_port()), *flags
        )

    deployments = Deployments({"1-shard": start, "2-shards": lambda: start("--num-shard", "2")})
    yield deployments
    codes = deployments.stop()
    assert codes == [0] * len(codes)


@pytest.fixture(scope="module")
def served(deployments: Deployments) -> Server:
    return deployments.get("1-shard")


def _chat(server: Server, images: list[bytes], text: str = TEXT, urls: list[str] | None = None):
    return chat(server, images, text, NEW_TOKENS, urls)


def _check(server: Server, model: Path, images: list[bytes]) -> dict:
    return check_chat(server, model, images, TEXT, NEW_TOKENS)


@pytest.mark.parametrize("deployment", ["1-shard", "2-shards"])
def test_an_image_chat_gives_transformers_tokens(
    deployments: Deployments, gemma3_multimodal_model: Path, deployment: str
) -> None:
    _check(deployments.get(deployment), gemma3_multimodal_model, [png(40, 30, seed=11)])


def test_images_staggered_with_text_in_one_batch(served: Server, gemma3_multimodal_model: Path) -> None:
    """A text-only generation is under way when image chats (one image, two images) join its batch: each one's
    tokens are its own reference's."""
    prompt, new_tokens = ORACLE_PROMPTS[0][0], 24
    text = StreamWatcher(served, {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens}}).start()
    wait_for(lambda: text.received(2), 120, "the text generation's first tokens")
    image_sets = [[png(28, 28, seed=21)], [png(50, 20, seed=22), png(20, 50, seed=23)]]
    with ThreadPoolExecutor(len(image_sets)) as pool:
        list(pool.map(lambda images: _check(served, gemma3_multimodal_model, images), image_sets))
    text.last()
    assert text.token_ids() == greedy_reference(gemma3_multimodal_model, prompt, new_tokens)


def test_the_prefix_cache_shares_an_image_only_with_itself(served: Server, gemma3_multimodal_model: Path) -> None:
    """The same image and text again reuse the cached blocks; another image with the same text reuses none of
    those that hold the image (the first block already does), and still gets its own reference's tokens."""
    model = gemma3_multimodal_model
    first = _check(served, model, [png(28, 28, seed=31)])
    again = _check(served, model, [png(28, 28, seed=31)])
    other = _check(served, model, [png(28, 28, seed=32)])
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in (first, again, other)]
    assert cached[1] >= 16 and cached[2] == 0, cached


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares its size and holds one compressed row: enough for a decoder to read how big it says it
    is, which a server must check before decoding the pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = zlib.compress(b"\x00" * (1 + 3 * width))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", row) + chunk(b"IEND", b"")


BAD_IMAGES = {
    "truncated PNG": ([data_url(png(28, 28, seed=41)[:60])], "could not be decoded"),
    "20,000 x 20,000 pixels": ([data_url(_png_header(20_000, 20_000))], "max_image_pixels"),
    "not an image": ([f"data:text/plain;base64,{base64.b64encode(b'hello').decode()}"], "not an image"),
    "not base64": (["data:image/png;base64,%%%"], "not valid base64"),
    "50 images": ([data_url(png(28, 28, seed=42))] * 50, "max_images"),
    "http URL": (["https://example.com/cat.png"], "not fetched"),
}


@pytest.mark.parametrize("case", BAD_IMAGES)
def test_a_bad_image_is_refused_by_name(served: Server, gemma3_multimodal_model: Path, case: str) -> None:
    urls, named = BAD_IMAGES[case]
    response = _chat(served, [], urls=urls)
    assert response.status_code == 422, response.text
    body = response.json()
    assert named in str(body["error"]) and body["error_type"] == "validation", body
    _check(served, gemma3_multimodal_model, [png(28, 28, seed=43)])  # served on


def test_the_responses_api_takes_input_images(served: Server, gemma3_multimodal_model: Path) -> None:
    """An `input_image` part (a data URL) is the same image to the model as the chat route's."""
    images = [png(28, 28, seed=51)]
    content = [{"type": "input_image", "image_url": data_url(images[0])}, {"type": "input_text", "text": TEXT}]
    body = {"input": [{"role": "user", "content": content}], "max_output_tokens": NEW_TOKENS, "temperature": 0}
    with served.client() as client:
        response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    expected = image_reference(gemma3_multimodal_model, TEXT, images, NEW_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(gemma3_multimodal_model)
    assert response.json()["output_text"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_anthropics_messages_api_takes_image_blocks(served: Server, gemma3_multimodal_model: Path) -> None:
    """A base64 `image` block is the same image to the model as the chat route's."""
    images = [png(28, 28, seed=61)]
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(images[0]).decode()}
    content = [{"type": "image", "source": source}, {"type": "text", "text": TEXT}]
    body = {"max_tokens": NEW_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": content}]}
    with served.client() as client:
        response = client.post("/v1/messages", json=body, headers={"x-api-key": "any"})
    assert response.status_code == 200, response.text
    expected = image_reference(gemma3_multimodal_model, TEXT, images, NEW_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(gemma3_multimodal_model)
    text = "".join(block["text"] for block in response.json()["content"] if block["type"] == "text")
    assert text == tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_tgis_markdown_images_in_inputs(served: Server, gemma3_multimodal_model: Path) -> None:
    """TGI's `![](data URL)` in `inputs` is the image, where it stands in the prompt."""
    images = [png(28, 28, seed=71)]
    body = {"inputs": f"![]({data_url(images[0])}){TEXT}", "parameters": {"max_new_tokens": NEW_TOKENS}}
    body["parameters"]["details"] = True
    with served.client() as client:
        response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    tokenizer = AutoTokenizer.from_pretrained(gemma3_multimodal_model)
    prompt = tokenizer.convert_ids_to_tokens(1021) + TEXT  # the placeholder, as the processor takes it
    expected = image_reference(gemma3_multimodal_model, prompt, images, NEW_TOKENS, chat=False)
    assert [t["id"] for t in response.json()["details"]["tokens"]] == expected
