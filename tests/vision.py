"""Images for the image-text tests, and transformers' own answer for a chat with them (the oracle's reference)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

from conftest import one_torch_thread

_MODELS: dict[Path, tuple] = {}


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of seeded noise: every seed a different picture."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _load(model_dir: Path):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if model_dir not in _MODELS:  # Gemma3ForConditionalGeneration, Idefics3ForConditionalGeneration (SmolVLM)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        _MODELS[model_dir] = (model, AutoProcessor.from_pretrained(model_dir))
    return _MODELS[model_dir]


def reference_inputs(model_dir: Path, text: str, images: list[bytes], before: str = "") -> dict:
    """The processor's inputs for a user message of `before` (if any), `images`, then `text`, as transformers
    prepares a chat."""
    from PIL import Image

    _, processor = _load(model_dir)
    content = [{"type": "text", "text": before}] if before else []
    content += [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(data)) for data in images]
    return processor(text=prompt, images=pictures or None, add_special_tokens=False, return_tensors="pt")


def image_reference(
    model_dir: Path, text: str, images: list[bytes], max_new_tokens: int, chat: bool = True, before: str = ""
) -> list[int]:
    """Greedy tokens of transformers' `generate()` for that chat alone, float32; not `chat`: for `text` as the
    prompt itself, a placeholder where each image stands (TGI's prompts), with the tokenizer's BOS."""
    import torch
    from PIL import Image

    model, processor = _load(model_dir)
    if chat:
        inputs = reference_inputs(model_dir, text, images, before)
    else:
        pictures = [Image.open(io.BytesIO(data)) for data in images]
        inputs = processor(text=text, images=pictures, return_tensors="pt")
    with torch.inference_mode(), one_torch_thread():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def text_reference(model_dir: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedy tokens of the image-text model's `generate()` for a text prompt (the tokenizer's BOS), no image."""
    import torch

    model, processor = _load(model_dir)
    ids = processor.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode(), one_torch_thread():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def chat(server, images: list[bytes], text: str, max_tokens: int, urls: list[str] | None = None):
    """An OpenAI chat with `images` (or image `urls`) then `text` in one user message, greedy, with logprobs."""
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls or [data_url(i) for i in images]]
    body = {
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "ignore_eos": False,
    }
    with server.client() as client:
        return client.post("/v1/chat/completions", json=body)


def check_chat(server, model: Path, images: list[bytes], text: str, max_tokens: int) -> dict:
    """One chat's answer equals transformers' tokens; its usage counts the image's tokens."""
    from transformers import AutoTokenizer

    response = chat(server, images, text, max_tokens)
    assert response.status_code == 200, response.text
    answer = response.json()
    expected = image_reference(model, text, images, max_tokens)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # The route answers text: the reference's text, token for token (the logprobs' entries), and as many tokens.
    assert answer["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert len(answer["choices"][0]["logprobs"]["content"]) == len(expected)
    usage = answer["usage"]
    assert usage["completion_tokens"] == len(expected)
    assert usage["prompt_tokens"] == reference_inputs(model, text, images)["input_ids"].shape[1]
    return answer
