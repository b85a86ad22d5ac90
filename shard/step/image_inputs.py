"""The images a step's prompt chunks read, as the forward takes them: each chunk's image spans, their embeddings
from the vision encoder (run once per image, at the first chunk that reads it), and the flat positions they fill.

Only prefill rows carry images; a step with none passes nothing, and text-only rows keep the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conveyor.shard.batch.prompt_images import ChunkImage, ImageError, PromptImage, chunk_images
from conveyor.shard.batch.request_state import BadRequest, RequestState
from conveyor.shard.layers.attention import Blocks

# Per row, the image spans its chunk reads: (first position, end position, their embeddings [end - first, hidden]).
RowImages = list[tuple[int, int, torch.Tensor]]


def row_images(
    vision: torch.nn.Module | None, rows: list[RequestState], new_tokens: list[list[int]], dtype: torch.dtype
) -> list[RowImages] | None:
    """Each row's image spans at this step, embeddings computed where still missing; None when no row reads an
    image. BadRequest for an image this model cannot take or a chunk that ends inside one."""
    chunks: list[list[ChunkImage]] = []
    for state, tokens in zip(rows, new_tokens):
        start = state.num_computed_tokens
        try:
            chunks.append(chunk_images(state.images, start, start + len(tokens)) if state.images else [])
        except ImageError as exc:
            raise BadRequest(f"request {state.id}: {exc}") from None
    if not any(chunks):
        return None
    if vision is None:
        raise BadRequest("this model takes no images")
    _encode(vision, [c.image for row in chunks for c in row if c.image.embeddings is None], dtype)
    return [
        [(c.first, c.end, c.image.embeddings[c.first - c.image.offset : c.end - c.image.offset]) for c in row]
        for row in chunks
    ]


def _encode(vision: torch.nn.Module, images: list[PromptImage], dtype: torch.dtype) -> None:
    """The vision encoder over the images, those of one shape in one batch."""
    device = next(vision.parameters()).device
    by_shape: dict[tuple[int, ...], list[PromptImage]] = {}
    for image in images:
        by_shape.setdefault(tuple(image.pixels.shape), []).append(image)
    for same in by_shape.values():
        pixels = torch.stack([image.pixels for image in same]).to(device=device, dtype=dtype)
        for image, embeddings in zip(same, vision(pixels)):
            if embeddings.shape[0] != image.length:
                raise BadRequest(f"an image makes {embeddings.shape[0]} soft tokens, not the {image.length} sent")
            image.embeddings = embeddings


def flat_inputs(
    images: Sequence[RowImages], starts: list[int], query_lens: list[int], device: torch.device
) -> tuple[Blocks, tuple[torch.Tensor, torch.Tensor]]:
    """The attention's image blocks per row (positions) and the (flat index, embeddings) the model puts in place."""
    index: list[int] = []
    values: list[torch.Tensor] = []
    flat = 0
    for row, start, count in zip(images, starts, query_lens):
        for first, end, embeddings in row:
            index.extend(range(flat + first - start, flat + end - start))
            values.append(embeddings)
        flat += count
    blocks = [[(first, end) for first, end, _ in row] for row in images]
    flat_index = torch.tensor(index, dtype=torch.long, device=device)
    return blocks, (flat_index, torch.cat(values).to(device))
