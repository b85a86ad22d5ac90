"""SmolVLM's (Idefics3's) images in, text out, through the real launcher, router and shards: OpenAI chat requests
with images the processor splits into tiles yield exactly the greedy tokens transformers'
`Idefics3ForConditionalGeneration.generate()` yields with its processor, alone and beside a text-only generation in
the same batch, on 1 and 2 shards (the vision encoder whole on each rank, the Llama text model split); the prefix
cache shares an image's blocks only with the same image; TGI's markdown images are the processor's `<image>`.

One deployment per shard count for the module (test_images.py holds Gemma 3's, and the refusals both share), and
one with int8 weights (`--quantize int8`, the language model's layers), whose image prompt's log-probabilities stay
within test_quantize.py's int8 bound of float32's.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ORACLE_PROMPTS, Deployments, Server, StreamWatcher, free_port, start_server, wait_for
from test_quantize import LOGPROB_BOUND
from vision import check_chat, data_url, image_reference, png, text_reference

from conveyor.shard.kernels import library as kernels

NEW_TOKENS = 8
TEXT = "Describe the picture above in a few words, then say what colour it mostly is."


@pytest.fixture(scope="module")
def deployments(smolvlm_model: Path) -> Iterator[Deployments]:
    def start(*flags: str) -> Server:
        return start_server(smolvlm_model, "--max-total-tokens", "512", "--master-port", str(free_port()), *flags)

    starts = {
        "1-shard": start,
        "2-shards": lambda: start("--num-shard", "2"),
        "int8": lambda: start("--quantize", "int8"),
    }
    # int8 is started by its own test, once the C++ kernels it needs are known to be built.
    deployments = Deployments(starts, wanted=["1-shard", "2-shards"])
    yield deployments
    codes = deployments.stop()
    assert codes == [0] * len(codes)


@pytest.fixture(scope="module")
def served(deployments: Deployments) -> Server:
    return deployments.get("1-shard")


@pytest.mark.parametrize("deployment", ["1-shard", "2-shards"])
def test_an_image_in_tiles_gives_transformers_tokens(
    deployments: Deployments, smolvlm_model: Path, deployment: str
) -> None:
    """A 40 x 30 image: 2 x 2 tiles and the whole image, 5 tiles of 4 `<image>` tokens each."""
    check_chat(deployments.get(deployment), smolvlm_model, [png(40, 30, seed=11)], TEXT, NEW_TOKENS)


@pytest.mark.parametrize("deployment", ["1-shard", "2-shards"])
def test_images_staggered_with_text_in_one_batch(
    deployments: Deployments, smolvlm_model: Path, deployment: str
) -> None:
    """A text-only generation is under way when image chats (one image, two images of other tile grids) join its
    batch: each one's tokens are its own reference's."""
    server = deployments.get(deployment)
    prompt, new_tokens = ORACLE_PROMPTS[0][0], 24
    text = StreamWatcher(server, {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens}}).start()
    wait_for(lambda: text.received(2), 120, "the text generation's first tokens")
    image_sets = [[png(28, 28, seed=21)], [png(60, 20, seed=22), png(20, 60, seed=23)]]
    with ThreadPoolExecutor(len(image_sets)) as pool:
        list(pool.map(lambda images: check_chat(server, smolvlm_model, images, TEXT, NEW_TOKENS), image_sets))
    text.last()
    assert text.token_ids() == text_reference(smolvlm_model, prompt, new_tokens)


def test_the_prefix_cache_shares_an_image_only_with_itself(served: Server, smolvlm_model: Path) -> None:
    """The same image and text again reuse the cached blocks; another image with the same text reuses none of
    those that hold the image's tiles (the first block already does), and still gets its own reference's tokens."""
    answers = [check_chat(served, smolvlm_model, [png(28, 28, seed=s)], TEXT, NEW_TOKENS) for s in (31, 31, 32)]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[1] >= 16 and cached[2] == 0, cached


def test_tgis_markdown_images_in_inputs(served: Server, smolvlm_model: Path) -> None:
    """TGI's `![](data URL)` in `inputs` is the image, where it stands in the prompt, as the processor expands
    `<image>` there."""
    images = [png(60, 20, seed=71)]
    body = {"inputs": f"![]({data_url(images[0])}){TEXT}", "parameters": {"max_new_tokens": NEW_TOKENS}}
    body["parameters"]["details"] = True
    with served.client() as client:
        response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    expected = image_reference(smolvlm_model, "<image>" + TEXT, images, NEW_TOKENS, chat=False)
    assert [t["id"] for t in response.json()["details"]["tokens"]] == expected


def _prompt_logprobs(server: Server, image: bytes) -> list[float]:
    """The log-probabilities of an image prompt's tokens (TGI's markdown image, then the text), each after the
    image's embeddings where it follows them."""
    parameters = {"max_new_tokens": 1, "decoder_input_details": True, "details": True}
    body = {"inputs": f"![]({data_url(image)}){TEXT}", "parameters": parameters}
    with server.client() as client:
        response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return [t["logprob"] for t in response.json()["details"]["prefill"][1:]]


def test_int8_weights_serve_an_image_within_the_int8_bound(deployments: Deployments) -> None:
    """The language model's layers in int8 (the vision encoder in float32): the image prompt's log-probabilities
    stay within test_quantize.py's int8 bound of the float32 deployment's, on average."""
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here")
    quantized, full = deployments.get("int8"), deployments.get("1-shard")
    assert quantized.info()["quantize"] == "int8"
    image = png(60, 20, seed=91)
    a, b = _prompt_logprobs(full, image), _prompt_logprobs(quantized, image)
    assert len(a) == len(b) > 20
    mean = sum(abs(x - y) for x, y in zip(a, b)) / len(a)
    print(f"int8, an image prompt: mean |logprob difference| {mean:.4f} nats over {len(a)} tokens")
    assert 0 < mean <= LOGPROB_BOUND["int8"], mean
