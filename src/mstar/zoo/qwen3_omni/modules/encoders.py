"""Audio and vision inputs: transformers' encoders, and the thinker prompt they are scattered into.

The encoders are stateless and run as transformers wrote them (`Qwen3OmniMoeAudioEncoder`,
`Qwen3OmniMoeVisionEncoder`); what mstar adds is the prompt assembly that transformers does
inside its forward: features replace the placeholder tokens' embeddings, images get 3-D MRoPE
coordinates (text and audio positions stay 1-D), and DeepStack features ride along::

    ids        <|im_start|> user \\n <vision_start> <image>x(h*w/m^2) <vision_end> text ...
    positions  0 1 2 3 | t: s+T*13   h: s+row   w: s+col | max+1, max+2, ...   (T: frame index)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig
from mstar.zoo.qwen3_omni.modules.text import EmbedsInput

__all__ = [
    "ImageInput",
    "audio_token_count",
    "embed_prompt",
    "encode_audio",
    "encode_image",
    "mrope_positions",
]


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image as the vision encoder takes it: ``pixels`` ``[patches, C*T*P*P]``, ``grid_thw``
    ``(t, h, w)``."""

    pixels: torch.Tensor
    grid_thw: tuple[int, int, int]


def audio_token_count(num_frames: int, n_window: int = 50) -> int:
    """Return the thinker tokens of ``num_frames`` mel frames (three stride-2 convs per 2*n_window
    chunk)."""
    chunk = 2 * n_window
    tail = num_frames % chunk
    length = tail
    for _ in range(3):
        length = (length - 1) // 2 + 1
    per_chunk = chunk
    for _ in range(3):
        per_chunk = (per_chunk - 1) // 2 + 1
    return (length if tail else 0) + (num_frames // chunk) * per_chunk


@torch.no_grad()
def encode_audio(audio_tower: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """Return the audio tokens ``[tokens, thinker_hidden]`` of log-mel ``features`` ``[mel,
    frames]``."""
    lengths = torch.tensor([features.shape[1]], dtype=torch.long)
    out = audio_tower(features.to(next(audio_tower.parameters()).dtype), feature_lens=lengths)
    return out.last_hidden_state


@torch.no_grad()
def encode_image(visual: nn.Module, image: ImageInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Return an image's tokens ``[tokens, hidden]`` and DeepStack features ``[levels, tokens,
    hidden]``."""
    grid = torch.tensor([image.grid_thw], dtype=torch.long)
    out = visual(image.pixels.to(next(visual.parameters()).dtype), grid_thw=grid)
    return out.pooler_output, torch.stack(list(out.deepstack_features))


def mrope_positions(
    token_ids: Sequence[int],
    image_token_id: int,
    grids: Sequence[tuple[int, int, int]],
    merge: int,
    per_second: int,
) -> tuple[torch.Tensor, int]:
    """Return the prompt's MRoPE coordinates ``[3, len]`` and its ``rope_delta`` (images only move
    them).

    Each run of ``image_token_id`` takes the next grid: its tokens sit at ``start + (t * per_second,
    row, col)`` on (time, height, width), and the text after it resumes at the run's largest
    coordinate + 1. Every other token advances all three by one.
    """
    coords: list[torch.Tensor] = []
    next_pos = 0
    i, image = 0, 0
    while i < len(token_ids):
        if token_ids[i] != image_token_id:
            coords.append(torch.full((3, 1), next_pos, dtype=torch.long))
            next_pos += 1
            i += 1
            continue
        t, h, w = grids[image]
        gh, gw = h // merge, w // merge
        tt = (torch.arange(t) * per_second).view(-1, 1).expand(-1, gh * gw).reshape(-1)
        hh = torch.arange(gh).view(1, -1, 1).expand(t, -1, gw).reshape(-1)
        ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, -1).reshape(-1)
        block = torch.stack((tt, hh, ww)) + next_pos
        if i + block.shape[1] > len(token_ids) or any(
            tok != image_token_id for tok in token_ids[i : i + block.shape[1]]
        ):
            raise ValueError(f"image {image} needs {block.shape[1]} image tokens at position {i}")
        coords.append(block)
        next_pos = int(block.max()) + 1
        i += block.shape[1]
        image += 1
    positions = torch.cat(coords, dim=1) if coords else torch.zeros(3, 0, dtype=torch.long)
    return positions, next_pos - len(token_ids)


def embed_prompt(
    config: Qwen3OmniConfig,
    token_embedding: nn.Embedding,
    token_ids: Sequence[int],
    *,
    audio: Sequence[torch.Tensor] = (),
    images: Sequence[tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]] = (),
) -> EmbedsInput:
    """Assemble a thinker prompt: token embeddings with encoder outputs at their placeholders.

    Args:
        config: The model.
        token_embedding: The thinker's token embedding.
        token_ids: The prompt, with one placeholder per audio or image token.
        audio: Per audio, its tokens ``[n, hidden]`` (`encode_audio`), in prompt order.
        images: Per image, ``(tokens, deepstack, grid_thw)`` (`encode_image`), in prompt order.

    Raises:
        ValueError: The placeholders and the encoder outputs disagree.
    """
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=token_embedding.weight.device)
    embeds = token_embedding(ids).clone()
    audio_id, image_id = config.token_id("audio_token_id"), config.token_id("image_token_id")
    for token, parts, what in (
        (audio_id, list(audio), "audio"),
        (image_id, [img[0] for img in images], "image"),
    ):
        rows = (ids == token).nonzero().squeeze(1)
        total = sum(int(p.shape[0]) for p in parts)
        if rows.numel() != total:
            raise ValueError(
                f"the prompt has {rows.numel()} {what} placeholders but the {what} inputs "
                f"make {total} tokens"
            )
        if total:
            embeds[rows] = torch.cat(parts).to(embeds.dtype)
    if not images:
        return EmbedsInput(embeds)
    merge = int(config.thinker_hf["vision_config"].get("spatial_merge_size", 2))
    per_second = int(config.thinker_hf.get("position_id_per_seconds", 13))
    positions3, delta = mrope_positions(
        list(token_ids), image_id, [img[2] for img in images], merge, per_second
    )
    levels = images[0][1].shape[0]
    deepstack = embeds.new_zeros(levels, embeds.shape[0], embeds.shape[1])
    rows = (ids == image_id).nonzero().squeeze(1)
    deepstack[:, rows] = torch.cat([img[1] for img in images], dim=1).to(embeds.dtype)
    return EmbedsInput(embeds, positions3=positions3, rope_delta=delta, deepstack=deepstack)
