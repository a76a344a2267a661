"""Request fields several zoo models read the same way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["DEFAULT_VOICE", "initial_noise", "speech_text", "speech_voice"]

DEFAULT_VOICE = "default"
"""The voice name every speaking model reads as its own default voice (as does no voice at all)."""


def initial_noise(
    data: Mapping[str, Any], shape: tuple[int, ...], seed: int | None
) -> torch.Tensor:
    """Return a request's initial noise of ``shape``: given (``noise``), seeded (``seed``, the
    request's `GenerationParams.seed`) or fresh.

    Raises:
        ValueError: ``noise`` is not a finite array of ``shape``.
    """
    if "noise" in data:
        noise = torch.as_tensor(np.asarray(data["noise"], dtype=np.float32))
        if tuple(noise.shape) != shape or not bool(torch.isfinite(noise).all()):
            raise ValueError(
                f"noise must be a finite array of shape {list(shape)}, got {list(noise.shape)}"
            )
        return noise
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return torch.randn(shape, generator=generator)


def speech_text(data: Mapping[str, Any]) -> str:
    """Return what a ``speech`` request speaks: ``text``, else the last user turn of ``messages``.

    A turn's content is a string or a list of parts, whose ``text`` parts are joined.

    Raises:
        ValueError: Neither gives a non-empty text, or ``messages`` is malformed.
    """
    if "text" in data:
        text = data["text"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text must be a non-empty string")
        return text
    messages = data.get("messages")
    if messages is None:
        raise ValueError("a speech request needs text (or messages: the last user turn is spoken)")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise ValueError("messages must be a list of {role, content} objects")
    turns = [m for m in messages if m.get("role") == "user"]
    if not turns:
        raise ValueError("messages has no user turn to speak")
    content = turns[-1].get("content")
    if isinstance(content, list):
        content = "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    if not isinstance(content, str) or not content.strip():
        raise ValueError("the last user turn of messages has no text to speak")
    return content


def speech_voice(data: Mapping[str, Any], default: str) -> str:
    """Return a request's voice (``voice``, or ``speaker``): omitted or `DEFAULT_VOICE` is
    ``default``.

    Raises:
        ValueError: The voice is not a string.
    """
    voice = data.get("voice") or data.get("speaker")
    if voice is None or voice == DEFAULT_VOICE:
        return default
    if not isinstance(voice, str):
        raise ValueError(f"voice must be a string, got {voice!r}")
    return voice
