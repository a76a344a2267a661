"""What the talker is fed from the thinker: the projections, its prompt, and the per-step input.

The talker sees text through ``text_projection`` (of the thinker's input embeddings) and
audio / image / video positions through ``hidden_projection`` (of the thinker's hidden state
captured at ``accept_hidden_layer``). Its prompt (transformers' ``generate``)::

    user turns        P(x) per position of every turn whose role token is ``user``
                      (hidden_projection at multimodal tokens, text_projection elsewhere)
    assistant (9)     text:  A0 A1 A2 pad pad pad pad bos A3         (A = text_projection of the
                      codec: 0  0  0  nothink think_bos think_eos speaker codec_pad codec_bos
                             summed position by position              assistant turn's embeddings)
    trailing text     A4 A5 ... then tts_eos, one per talker step; tts_pad once exhausted

At decode step t the input is ``codec_embedding(code0) + sum_k cp_embedding[k-1](code_k)`` of the
previous frame plus trailing text t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig
from mstar.zoo.qwen3_omni.modules.encoders import mrope_positions

__all__ = ["ResizeMLP", "TalkerPrompt", "make_talker_prompt", "user_positions"]


class ResizeMLP(nn.Module):
    """Two linears with a SiLU between (thinker width -> talker width)."""

    def __init__(self, in_features: int, inner: int, out_features: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_features, inner, bias=True)
        self.linear_fc2 = nn.Linear(inner, out_features, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project ``x`` ``[..., in_features]``."""
        return cast(torch.Tensor, self.linear_fc2(F.silu(self.linear_fc1(x))))


@dataclass(frozen=True, eq=False)
class TalkerPrompt:
    """The talker's prefill and what its decode steps add.

    Attributes:
        embeds: ``[n, talker_hidden]`` the prefill (user turns, then the 9 assistant positions).
        trailing: ``[m, talker_hidden]`` text added at decode steps 0..m-1 (ends with tts_eos).
        tts_pad: ``[talker_hidden]`` added once the trailing text is exhausted.
        positions3: ``[3, n]`` MRoPE coordinates of the prefill when the user turns hold
            images (None: 1-D positions).
        rope_delta: The talker sequence's MRoPE offset after the prefill.
    """

    embeds: torch.Tensor
    trailing: torch.Tensor
    tts_pad: torch.Tensor
    positions3: torch.Tensor | None = None
    rope_delta: int = 0


def user_positions(token_ids: list[int], config: Qwen3OmniConfig) -> list[int]:
    """Return the positions of ``token_ids`` inside user turns (the role after the last
    ``<|im_start|>`` is ``user``)."""
    im_start = config.token_id("im_start_token_id")
    user = config.token_id("user_token_id")
    kept: list[int] = []
    # Before the first <|im_start|> transformers reads the role at position 1; so do we.
    role = token_ids[1] if len(token_ids) > 1 else -1
    for i, token in enumerate(token_ids):
        if token == im_start:
            role = token_ids[i + 1] if i + 1 < len(token_ids) else -1
        if role == user:
            kept.append(i)
    return kept


def make_talker_prompt(
    config: Qwen3OmniConfig,
    *,
    token_ids: list[int],
    prompt_len: int,
    thinker_embed: torch.Tensor,
    thinker_hidden: torch.Tensor,
    text_projection: ResizeMLP,
    hidden_projection: ResizeMLP,
    codec_embedding: nn.Embedding,
    thinker_embedding: nn.Embedding,
    speaker: str | None = None,
    image_grids: list[tuple[int, int, int]] | None = None,
) -> TalkerPrompt:
    """Build the talker's prompt from a finished (or started) thinker sequence.

    Args:
        config: The model.
        token_ids: The thinker's sequence (prompt, then the generated text).
        prompt_len: How many of ``token_ids`` are the prompt.
        thinker_embed: ``[len, thinker_hidden]`` the thinker's input embeddings.
        thinker_hidden: ``[len, thinker_hidden]`` its hidden states at ``accept_hidden_layer``.
        text_projection: The talker's text projection.
        hidden_projection: The talker's multimodal projection.
        codec_embedding: The talker's codec embedding.
        thinker_embedding: The thinker's token embedding (for tts_pad / bos / eos).
        speaker: The voice (default: the config's).
        image_grids: The ``(t, h, w)`` grid of each image of the prompt, in order (the talker
            gives its image positions the thinker's MRoPE coordinates).

    Raises:
        ValueError: The prompt has no ``<|im_start|>assistant`` turn.
    """
    im_start = config.token_id("im_start_token_id")
    assistant = config.token_id("assistant_token_id")
    prompt = token_ids[:prompt_len]
    starts = [
        i for i in range(len(prompt) - 1) if prompt[i] == im_start and prompt[i + 1] == assistant
    ]
    if not starts:
        raise ValueError("the prompt has no '<|im_start|>assistant' turn for the talker to speak")
    start = starts[-1]
    device = thinker_embed.device
    multimodal = {
        config.token_id(n) for n in ("audio_token_id", "image_token_id", "video_token_id")
    }
    users = user_positions(prompt, config)
    parts: list[torch.Tensor] = []
    if users:
        index = torch.tensor(users, device=device)
        is_mm = torch.tensor([prompt[i] in multimodal for i in users], device=device)
        user_part = text_projection(thinker_embed.index_select(0, index))
        if bool(is_mm.any()):
            projected = hidden_projection(thinker_hidden.index_select(0, index))
            user_part = torch.where(is_mm[:, None], projected, user_part)
        parts.append(user_part)
    specials = torch.tensor(
        [config.token_id(n) for n in ("tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id")],
        device=device,
    )
    tts_bos, tts_eos, tts_pad = text_projection(thinker_embedding(specials)).unbind(0)
    text = text_projection(thinker_embed[start:])
    if text.shape[0] < 4:
        raise ValueError("the talker starts once the assistant turn has its first text token")
    text_side = torch.cat((text[:3], tts_pad.expand(4, -1), tts_bos[None], text[3:4]))
    speaker_id = config.speaker_ids[(speaker or config.speaker).lower()]
    codec_ids = torch.tensor(
        [
            config.codec_id("codec_nothink_id"),
            config.codec_id("codec_think_bos_id"),
            config.codec_id("codec_think_eos_id"),
            speaker_id,
            config.codec_id("codec_pad_id"),
            config.codec_id("codec_bos_id"),
        ],
        device=device,
    )
    codec_side = torch.cat((text.new_zeros(3, text.shape[1]), codec_embedding(codec_ids)))
    parts.append(text_side + codec_side)
    trailing = torch.cat((text[4:], tts_eos[None]))
    embeds = torch.cat(parts)
    image_id = config.token_id("image_token_id")
    if not image_grids or not any(prompt[i] == image_id for i in users):
        return TalkerPrompt(embeds, trailing, tts_pad)
    # transformers' talker ids: the user tokens, then tts_pad for the 9 assistant positions.
    talker_ids = [prompt[i] for i in users] + [config.token_id("tts_pad_token_id")] * 9
    merge = int(config.thinker_hf["vision_config"].get("spatial_merge_size", 2))
    per_second = int(config.talker_hf.get("position_id_per_seconds", 13))
    positions3, delta = mrope_positions(talker_ids, image_id, image_grids, merge, per_second)
    return TalkerPrompt(embeds, trailing, tts_pad, positions3.to(device), delta)
