"""Images in, text out, through the real launcher, router and shards: OpenAI chat requests with an image (a base64
data URL) on the random-weight Gemma 3 image-text model yield exactly the greedy tokens transformers'
`Gemma3ForConditionalGeneration.generate()` yields with its processor, alone, beside each other and beside a
text-only request in the same batch, on 1 and 2 shards (the vision tower whole on each rank); the prefix cache
shares an image's blocks only with the same image; and a bad image is a 4xx naming the fault, after which the
server serves on. The 1-shard deployment fetches http(s) image URLs from a loopback server the module starts
(--image-url-fetch, allowed to 127.0.0.1 only), the 2-shard one does not (the default); image chats stream, are
cancelled by a hang-up and follow a JSON schema.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import jsonschema
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
MAX_IMAGE_BYTES = 100_000  # --max-image-bytes of the 1-shard deployment (the test images are a few kB)
URL_TIMEOUT = 2.0  # its --image-url-timeout


class ImageHost(ThreadingHTTPServer):
    """A loopback HTTP server of images and faults: /cat.png, a redirect to it and one to a host off the list, a
    text answer, a body over --max-image-bytes, and /hang, which answers nothing until the module ends."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ImageHandler)
        self.image = png(28, 28, seed=81)
        self.release = threading.Event()  # ends /hang's wait
        self.hanging = threading.Event()  # set once /hang was asked

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ImageHandler(BaseHTTPRequestHandler):
    server: ImageHost

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        host = self.server
        port = host.server_address[1]
        answers = {
            "/cat.png": (200, {"Content-Type": "image/png"}, host.image),
            "/moved": (302, {"Location": "/cat.png"}, b""),
            "/elsewhere": (302, {"Location": f"http://localhost:{port}/cat.png"}, b""),
            "/text": (200, {"Content-Type": "text/plain"}, b"not a picture"),
            "/big.png": (200, {"Content-Type": "image/png"}, host.image + b"\0" * MAX_IMAGE_BYTES),
        }
        if self.path == "/hang":
            host.hanging.set()
            host.release.wait(120)
            return
        status, headers, body = answers.get(self.path, (404, {}, b""))
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[ImageHost]:
    host = ImageHost()
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield host
    host.release.set()
    host.shutdown()
    host.server_close()


@pytest.fixture(scope="module")
def deployments(gemma3_multimodal_model: Path) -> Iterator[Deployments]:
    def start(*flags: str) -> Server:
        return start_server(
            gemma3_multimodal_model, "--max-total-tokens", "512", "--master-port", str(free_port()), *flags
        )

    fetching = (
        "--image-url-fetch",
        "--image-url-allowed-hosts",
        "127.0.0.1",
        "--image-url-timeout",
        str(URL_TIMEOUT),
        "--max-image-bytes",
        str(MAX_IMAGE_BYTES),
    )
    deployments = Deployments({"1-shard": lambda: start(*fetching), "2-shards": lambda: start("--num-shard", "2")})
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
    "20,000 x 20,000 pixels": ([data_url(_png_header(20_000, 20_000))], "--max-image-pixels"),
    "not an image": ([f"data:text/plain;base64,{base64.b64encode(b'hello').decode()}"], "not an image"),
    "not base64": (["data:image/png;base64,%%%"], "not valid base64"),
    "50 images": ([data_url(png(28, 28, seed=42))] * 50, "--max-images-per-request"),
    "over --max-image-bytes": ([data_url(png(28, 28, seed=44) + b"\0" * MAX_IMAGE_BYTES)], "--max-image-bytes"),
    "http URL of a host not allowed": (["https://example.com/cat.png"], "--image-url-allowed-hosts"),
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


def _served_on(server: Server, expected: str) -> None:
    """The next image chat is served, with the tokens it had before."""
    response = _chat(server, [png(28, 28, seed=81)])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == expected


@pytest.fixture(scope="module")
def cat_answer(served: Server, gemma3_multimodal_model: Path, image_host: ImageHost) -> str:
    """The chat's answer for the image host's PNG, sent as a data URL (checked against transformers')."""
    answer = _check(served, gemma3_multimodal_model, [image_host.image])
    return answer["choices"][0]["message"]["content"]


def test_an_image_url_is_refused_by_name_where_fetching_is_off(deployments: Deployments, image_host: ImageHost) -> None:
    response = _chat(deployments.get("2-shards"), [], urls=[f"{image_host.base}/cat.png"])
    assert response.status_code == 422, response.text
    assert "--image-url-fetch" in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("path", ["/cat.png", "/moved"])
def test_an_allowed_image_url_is_the_same_image_as_its_data_url(
    served: Server, image_host: ImageHost, cat_answer: str, path: str
) -> None:
    """Fetched, directly or through a redirect to the same allowed host, the image gives the data URL's tokens."""
    response = _chat(served, [], urls=[image_host.base + path])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == cat_answer


URL_FAULTS = {
    "a host off the list": ("http://localhost:{port}/cat.png", "not in --image-url-allowed-hosts"),
    "a redirect off the list": ("{base}/elsewhere", "not in --image-url-allowed-hosts"),
    "a text answer": ("{base}/text", "text/plain, not an image"),
    "a body over the limit": ("{base}/big.png", "--max-image-bytes"),
    "no answer": ("{base}/hang", "--image-url-timeout"),
    "a missing image": ("{base}/nothing.png", "HTTP 404"),
}


@pytest.mark.parametrize("fault", URL_FAULTS)
def test_an_image_url_fault_is_refused_by_name(
    served: Server, image_host: ImageHost, cat_answer: str, fault: str
) -> None:
    template, named = URL_FAULTS[fault]
    url = template.format(base=image_host.base, port=image_host.server_address[1])
    response = _chat(served, [], urls=[url])
    assert response.status_code == 422, response.text
    assert named in response.json()["error"]["message"], response.text
    if fault == "no answer":
        assert image_host.hanging.is_set()  # it was asked, and the router gave up on it
    _served_on(served, cat_answer)


def test_an_image_chat_streams_its_answer(served: Server, cat_answer: str) -> None:
    """The stream's deltas, joined, are the whole answer's content."""
    body = {
        "messages": [{"role": "user", "content": _parts(png(28, 28, seed=81))}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": False,
        "stream": True,
    }
    watcher = StreamWatcher(served, body, "/v1/chat/completions").start()
    watcher.last()
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in watcher.events if e != "[DONE]" and e["choices"]]
    assert watcher.events[-1] == "[DONE]" and "".join(deltas) == cat_answer


def test_a_hang_up_cancels_an_image_chat(served: Server, cat_answer: str) -> None:
    """A client that disconnects mid-stream ends its request (the shards paused meanwhile, so it cannot finish
    first): nothing is left in flight, and the next request is served."""
    body = {
        "messages": [{"role": "user", "content": _parts(png(28, 28, seed=82))}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    cancelled = _outcome(served, "cancelled")
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:  # the opening chunk and two tokens'
                break
        with served.shards_paused():
            response.close()
            wait_for(lambda: _outcome(served, "cancelled") == cancelled + 1, 60, "the image chat to be cancelled")
    idle = ("conveyor_batch_current_size", "conveyor_queue_size")
    wait_for(lambda: all(served.metric(name) == 0 for name in idle), 60, "no request in flight")
    _served_on(served, cat_answer)


SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
    "required": ["colour", "bright"],
    "additionalProperties": False,
}


def test_an_image_chat_follows_a_json_schema(served: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": _parts(png(28, 28, seed=83))}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "picture", "schema": SCHEMA}},
    }
    with served.client() as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def _parts(image: bytes) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": TEXT}]


def _outcome(server: Server, outcome: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    prefix = f'conveyor_requests_total{{outcome="{outcome}"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def test_the_responses_api_and_tgi_markdown_fetch_image_urls(
    served: Server, image_host: ImageHost, gemma3_multimodal_model: Path, cat_answer: str
) -> None:
    """An `input_image` URL is fetched as the chat route's is; so is TGI's `![](URL)` in `inputs`."""
    url = f"{image_host.base}/cat.png"
    content = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": TEXT}]
    body = {"input": [{"role": "user", "content": content}], "max_output_tokens": NEW_TOKENS, "temperature": 0}
    with served.client() as client:
        response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["output_text"] == cat_answer
    parameters = {"max_new_tokens": NEW_TOKENS, "details": True}
    with served.client() as client:
        fetched = client.post("/generate", json={"inputs": f"![]({url}){TEXT}", "parameters": parameters})
        sent = client.post(
            "/generate", json={"inputs": f"![]({data_url(image_host.image)}){TEXT}", "parameters": parameters}
        )
    assert fetched.status_code == 200 and sent.status_code == 200, (fetched.text, sent.text)
    assert [t["id"] for t in fetched.json()["details"]["tokens"]] == [t["id"] for t in sent.json()["details"]["tokens"]]
