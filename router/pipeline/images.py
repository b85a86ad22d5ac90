"""A chat's images, from the data URLs a client sends to the pixels and soft tokens the model takes.

The checkpoint's own processor config (`preprocessor_config.json`, or transformers 5's `processor_config.json`)
decodes and resizes each image, here in the router, on a validation worker (off the event loop): what travels to
the shards is the pixel values, beside the prompt. The chat template writes each image's placeholder
(`<start_of_image>` for Gemma 3, `<image>` for SmolVLM); the router expands it to the image's tokens as the model's
processor does (SmolVLM's: per tile, where the processor splits the image), so every image token is a prompt token
the token limits, fair shares and `usage` count.

Bounded before any work an image can make expensive: the data's bytes, the images per request, and the pixels the
image's header declares (checked before its pixels are decoded, so no decompression bomb is ever expanded); the
first three are flags (`ImageLimits`). Data URLs are read here; http(s) URLs are fetched only where
`--image-url-fetch` allows it, under its rules (image_urls.py), else refused by name.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.router.api.base import ValidationError
from conveyor.router.pipeline.chat_prompt import ChatPrompt
from conveyor.router.pipeline.image_urls import ImageUrls

# The defaults of --max-image-bytes, --max-image-pixels and --max-images-per-request (conveyor/config.py).
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an image's data, decoded from base64
MAX_IMAGE_PIXELS = 40_000_000  # width x height its header declares (a 6,000 x 6,000 photo fits)
MAX_IMAGES = 16  # per request
# The pixel values a step's message carries to a shard (float32: 9.6 MB for Gemma 3's 896 x 896), well under the
# shard channels' 64 MB message cap (conveyor/shard_channels.py): a request's images must fit, and a step admits
# requests while theirs do (router/core/step_planner.py).
MAX_STEP_PIXEL_BYTES = 48 * 1024 * 1024
_DATA_URL = re.compile(r"data:(?P<type>[a-zA-Z0-9.+-]+/[a-zA-Z0-9.+-]+)?(;[^,;]*)*?;base64,", re.ASCII)
_MARKDOWN = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")  # TGI's image in `inputs`: ![](data:image/png;base64,...)
_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})


@dataclass(frozen=True)
class ImageLimits:
    """The bounds on a request's images the deployment sets (flags), each refused by its flag's name."""

    max_images: int = MAX_IMAGES
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class ImageInput:
    """One image (or one tile of one) of a prompt, as the shards take it: its soft tokens' place and its pixels."""

    offset: int  # its first soft token in the prompt
    length: int  # its soft tokens
    pixel_values: bytes  # float32, little-endian
    shape: tuple[int, ...]  # (C, H, W)
    digest: bytes  # the pixel values' SHA-256: the prefix cache keys the image's blocks by it


@dataclass(frozen=True)
class Tile:
    """An image decoded and resized, or one tile of it where the processor splits images (SmolVLM)."""

    values: bytes
    shape: tuple[int, ...]
    digest: bytes


@dataclass(frozen=True)
class Pixels:
    """An image as the processor made it, before its place in the prompt is known: its tiles (one, unless the
    processor splits images), in the order of their tokens, and the text that stands for it in the prompt."""

    tiles: tuple[Tile, ...]
    sequence: str


class ImageReader:
    """An image-text checkpoint's processor, as the router uses it; a family's own layout of an image's tokens in
    its subclass (`Gemma3Images`, `Idefics3Images`)."""

    def __init__(self, processor: Any, placeholder: str, image_id: int, tokens: int) -> None:
        self.processor = processor
        self.placeholder = placeholder  # what the chat template writes for each image
        self.image_token_id = image_id
        self.tokens_per_image = tokens  # per tile: one run of the image token each
        self.limits = ImageLimits()
        self.urls = ImageUrls(False, None, 0.0, self.limits.max_image_bytes)  # fetching off unless configured

    @classmethod
    def load(
        cls, model_dir: str | None, tokenizer: Any, limits: ImageLimits | None = None, urls: ImageUrls | None = None
    ) -> ImageReader | None:
        """The reader of an image-text checkpoint (Gemma 3's or SmolVLM's, with its processor config), under the
        deployment's limits and URL fetching; None for any other."""
        if model_dir is None or not (Path(model_dir) / "config.json").exists():
            return None
        config = json.loads((Path(model_dir) / "config.json").read_text())
        folder = Path(model_dir)
        has_processor = any((folder / n).exists() for n in ("preprocessor_config.json", "processor_config.json"))
        family = {"gemma3": Gemma3Images, "idefics3": Idefics3Images}.get(config.get("model_type"))
        if family is None or "vision_config" not in config or not has_processor:
            return None
        from transformers import AutoImageProcessor

        reader = family.of(AutoImageProcessor.from_pretrained(model_dir), config, tokenizer, folder)
        reader.limits = limits or ImageLimits()
        reader.urls = urls or ImageUrls(False, None, 0.0, reader.limits.max_image_bytes)
        return reader

    def _tiles(self, image: Any) -> tuple[Any, str]:
        """The processor's pixel values for the image, [tiles, C, H, W], and the text that stands for it."""
        raise NotImplementedError

    def pixels(self, url: str, data: bytes | None = None) -> Pixels:
        """A data URL's image (or the bytes fetched for a URL), decoded and resized (and split) by the checkpoint's
        processor; ValidationError naming the limit or the fault."""
        limits = self.limits
        if data is None:
            data = decode_data_url(url, limits.max_image_bytes)
        elif len(data) > limits.max_image_bytes:
            raise ValidationError(f"an image is larger than {limits.max_image_bytes} bytes (--max-image-bytes)")
        arrays, sequence = self._tiles(open_image(data, limits.max_image_pixels))
        tiles = []
        for array in arrays:
            values = array.astype("<f4")
            raw = values.tobytes()
            tiles.append(Tile(raw, tuple(values.shape), hashlib.sha256(raw).digest()))
        return Pixels(tuple(tiles), sequence)

    def read_all(self, urls: list[str]) -> list[Pixels]:
        """A request's images (the http(s) ones fetched first, all at once, where fetching is on), within the
        images per request and MAX_STEP_PIXEL_BYTES."""
        most = self.limits.max_images
        if len(urls) > most:
            raise ValidationError(f"at most {most} images per request (--max-images-per-request). Given: {len(urls)}")
        remote = list(dict.fromkeys(url for url in urls if url.startswith(("http://", "https://"))))
        fetched = dict(zip(remote, self.urls.fetch_all(remote))) if remote else {}
        pixels = [self.pixels(url, fetched.get(url)) for url in urls]
        if (size := sum(len(t.values) for p in pixels for t in p.tiles)) > MAX_STEP_PIXEL_BYTES:
            raise ValidationError(
                f"the images' pixel values take {size} bytes, over {MAX_STEP_PIXEL_BYTES} per request (max_pixel_bytes)"
            )
        return pixels

    def markdown(self, inputs: str) -> tuple[str, list[Pixels]]:
        """TGI's images: each `![](data URL)` in a prompt's text is that image's tokens where it stands."""
        urls = [match[1] for match in _MARKDOWN.finditer(inputs)]
        if not urls:
            return inputs, []
        pixels = self.read_all(urls)
        sequences = iter(p.sequence for p in pixels)
        return _MARKDOWN.sub(lambda _: next(sequences), inputs), pixels

    def expand(self, prompt: ChatPrompt, pixels: list[Pixels]) -> ChatPrompt:
        """The rendered chat with each placeholder the template wrote (none inside the caller's text) as its
        image's tokens; ValidationError if the template wrote other than one per image."""
        text, out, at, found = prompt.text, "", 0, 0

        def fill(piece: str) -> str:
            nonlocal found
            parts = piece.split(self.placeholder)
            filled = parts[0]
            for part in parts[1:]:
                filled += (pixels[found].sequence if found < len(pixels) else "") + part
                found += 1
            return filled

        spans: list[tuple[int, int]] = []
        for start, stop in prompt.plain_spans:
            out += fill(text[at:start])
            spans.append((len(out), len(out) + stop - start))
            out += text[start:stop]
            at = stop
        out += fill(text[at:])
        if found != len(pixels):
            raise ValidationError(f"the chat template wrote {found} image placeholders for {len(pixels)} images")
        return ChatPrompt(out, tuple(spans))

    def place(self, input_ids: tuple[int, ...], pixels: list[Pixels]) -> tuple[ImageInput, ...]:
        """Each tile's image tokens in the tokenized prompt, in order; ValidationError if they do not match."""
        runs: list[list[int]] = []
        for position, token in enumerate(input_ids):
            if token == self.image_token_id:
                if runs and runs[-1][0] + runs[-1][1] == position:
                    runs[-1][1] += 1
                else:
                    runs.append([position, 1])
        tiles = [tile for p in pixels for tile in p.tiles]
        if len(runs) != len(tiles) or any(length != self.tokens_per_image for _, length in runs):
            raise ValidationError("the prompt's image tokens do not match its images (was it truncated?)")
        return tuple(ImageInput(o, n, t.values, t.shape, t.digest) for (o, n), t in zip(runs, tiles))


class Gemma3Images(ImageReader):
    """Gemma 3: one image, one tile; the template's `<start_of_image>` becomes the image's soft tokens between
    `<start_of_image>` and `<end_of_image>`, blank lines around, as Gemma 3's processor writes them."""

    sequence: str  # the same for every image

    @classmethod
    def of(cls, processor: Any, config: dict, tokenizer: Any, folder: Path) -> Gemma3Images:
        ids = [config.get(f"{n}_token_index") for n in ("boi", "image", "eoi")]
        boi, image, eoi = tokenizer.convert_ids_to_tokens(ids)
        reader = cls(processor, boi, ids[1], int(config.get("mm_tokens_per_image", 256)))
        reader.sequence = f"\n\n{boi}{image * reader.tokens_per_image}{eoi}\n\n"
        return reader

    def _tiles(self, image: Any) -> tuple[Any, str]:
        arrays = self.processor(images=[image], return_tensors="np")["pixel_values"]
        if len(arrays) != 1:
            raise ValidationError("the image processor made crops of an image (pan and scan): not supported yet")
        return arrays, self.sequence


class Idefics3Images(ImageReader):
    """SmolVLM (Idefics3): where the processor config splits images (`do_image_splitting`), an image is resized
    (`size`) and cut into `max_image_size` tiles, rows x columns, then the whole image at a tile's size; every tile
    is `image_seq_len` `<image>` tokens after `<fake_token_around_image>` and its `<row_i_col_j>` (the whole image:
    `<global-img>`), as Idefics3's processor writes them for the template's `<image>`. Each tile travels to the
    shards as an image of its own."""

    FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"

    @classmethod
    def of(cls, processor: Any, config: dict, tokenizer: Any, folder: Path) -> Idefics3Images:
        image_id = int(config.get("image_token_id", 128257))
        vision = config["vision_config"]
        # The processor's own count (its config), else the model's: a tile's patches after the pixel shuffle.
        tokens = (vision.get("image_size", 224) // vision.get("patch_size", 32)) ** 2 // config.get(
            "scale_factor", 2
        ) ** 2
        if (folder / "processor_config.json").exists():
            tokens = int(json.loads((folder / "processor_config.json").read_text()).get("image_seq_len", tokens))
        return cls(processor, tokenizer.convert_ids_to_tokens(image_id), image_id, tokens)

    def _tiles(self, image: Any) -> tuple[Any, str]:
        out = self.processor(images=[image], return_row_col_info=True, return_tensors="np")
        if "pixel_attention_mask" in out and not out["pixel_attention_mask"].all():
            raise ValidationError("the image processor padded a tile of an image: not supported")
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        tile = self.FAKE + "{}" + self.placeholder * self.tokens_per_image
        whole = tile.format(self.GLOBAL) + self.FAKE
        grid = "".join(
            "".join(tile.format(f"<row_{r + 1}_col_{c + 1}>") for c in range(cols)) + "\n" for r in range(rows)
        )
        return out["pixel_values"][0], f"{grid}\n{whole}" if rows or cols else whole


def decode_data_url(url: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """A base64 data URL's bytes, within `max_bytes`."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ValidationError("an image must be a base64 data URL (data:image/png;base64,...)")
    if match["type"] and not match["type"].startswith("image/"):
        raise ValidationError(f"an image's data URL holds {match['type']}, not an image")
    encoded = url[match.end() :]
    if len(encoded) > (max_bytes + 2) // 3 * 4:
        raise ValidationError(f"an image is larger than {max_bytes} bytes (--max-image-bytes)")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError("an image's data URL is not valid base64") from None
    if len(data) > max_bytes:
        raise ValidationError(f"an image is larger than {max_bytes} bytes (--max-image-bytes)")
    return data


def open_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS):
    """The image, its header checked against `max_pixels` before its pixels are decoded, in RGB."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in _FORMATS:
            raise ValidationError(f"image format {image.format} is not one of {sorted(_FORMATS)}")
        width, height = image.size
        if width * height > max_pixels:
            raise ValidationError(
                f"an image of {width} x {height} pixels is over {max_pixels} pixels (--max-image-pixels)"
            )
        image.load()
        return image.convert("RGB")
    except ValidationError:
        raise
    except Image.DecompressionBombError:
        raise ValidationError(f"an image is over {max_pixels} pixels (--max-image-pixels)") from None
    except UnidentifiedImageError:
        raise ValidationError("an image could not be decoded: not an image format this server reads") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ValidationError(f"an image could not be decoded: {exc}") from None
