"""A request's images as the shard holds them: where each one's soft tokens sit in the prompt, its pixel values,
and, once a chunk has read it, its embeddings (kept until the request leaves, so a recomputed prompt needs no
second run of the vision tower).

A chunk reads an image's tokens whole: the router never ends a chunk inside them (a cached prefix may end there,
its KV computed with the whole image), because Gemma 3's image tokens attend to each other both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.v1 import shard_pb2 as pb


class ImageError(ValueError):
    """The router sent an image the shard cannot place: refused as a bad request."""


@dataclass
class PromptImage:
    offset: int  # its first soft token's position in the prompt
    length: int  # its soft tokens
    pixels: torch.Tensor  # [C, H, W] float32, as the checkpoint's processor made them
    embeddings: torch.Tensor | None = None  # [length, hidden], from the vision encoder at its first chunk

    @classmethod
    def from_pb(cls, image: pb.Image, prompt_len: int) -> PromptImage:
        shape = tuple(image.shape)
        if len(shape) != 3 or len(image.pixel_values) != 4 * shape[0] * shape[1] * shape[2]:
            raise ImageError(f"an image's pixel values ({len(image.pixel_values)} bytes) do not fill shape {shape}")
        if image.length == 0 or image.offset + image.length > prompt_len:
            raise ImageError(f"an image's tokens [{image.offset}, +{image.length}) lie outside the prompt")
        pixels = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).view(shape)
        return cls(image.offset, image.length, pixels)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ChunkImage:
    """The part of an image a chunk reads: its positions [first, end) and the image they belong to."""

    image: PromptImage
    first: int
    end: int


def chunk_images(images: list[PromptImage], start: int, end: int) -> list[ChunkImage]:
    """The images whose tokens a chunk [start, end) reads; ImageError if the chunk ends inside one."""
    found = []
    for image in images:
        if image.end <= start or image.offset >= end:
            continue
        if end < image.end:
            raise ImageError(f"a prompt chunk ends at {end}, inside an image's tokens [{image.offset}, {image.end})")
        found.append(ChunkImage(image, max(start, image.offset), image.end))
    return found
