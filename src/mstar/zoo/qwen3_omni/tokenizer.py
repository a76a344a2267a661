"""Prompts for Qwen3-Omni: the chat layout with audio and image placeholders, and a small tokenizer.

The published checkpoint ships Qwen's tokenizer (loaded with transformers); the random-weight
configs get `CharTokenizer`, which keeps the same layout in their small vocabularies: ASCII
characters are their own ids, the specials sit at the config's ids (``<|im_start|>``, the role
tokens after it, the media placeholders) and other ids read as ``<id>``. Both render a chat as
Qwen's template does::

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n<|audio_start|><|audio_pad|>*n<|audio_end|>
    text<|im_end|>\\n<|im_start|>assistant\\n
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig

__all__ = ["AUDIO_PART", "IMAGE_PART", "CharTokenizer", "render_chat"]

AUDIO_PART = "<|AUDIO|>"
"""Where one audio input goes in a rendered chat (expanded to its placeholder tokens)."""

IMAGE_PART = "<|IMAGE|>"
"""Where one image input goes in a rendered chat."""


def render_chat(
    messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
) -> str:
    """Render messages in Qwen's chat layout; content parts of type audio / image become markers.

    Raises:
        ValueError: A message is malformed.
    """
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}] needs a role")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            pieces = []
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text":
                    pieces.append(str(part.get("text", "")))
                elif kind in ("audio", "input_audio"):
                    pieces.append(AUDIO_PART)
                elif kind in ("image", "image_url"):
                    pieces.append(IMAGE_PART)
                else:
                    raise ValueError(f"messages[{i}] has a content part of unknown type {kind!r}")
            text = "".join(pieces)
        else:
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


class CharTokenizer:
    """A character tokenizer for the small configs (see the module docstring).

    Callable like a Hugging Face tokenizer (``tokenizer(text)["input_ids"]``), with
    ``apply_chat_template`` and ``decode``.
    """

    def __init__(self, config: Qwen3OmniConfig) -> None:
        self.vocab_size = config.thinker_text.vocab_size
        top = config.token_id("im_start_token_id")
        self.specials: dict[str, int] = {
            "<|im_start|>": top,
            "<|im_end|>": config.token_id("im_end_token_id"),
            "<|audio_pad|>": config.token_id("audio_token_id"),
            "<|image_pad|>": config.token_id("image_token_id"),
            "<|audio_start|>": config.token_id("audio_start_token_id"),
            "<|vision_start|>": config.token_id("vision_start_token_id"),
            # Not named by the config: the next free ids of the special block.
            "<|audio_end|>": top + 10,
            "<|vision_end|>": top + 11,
        }
        self.roles = {
            "system": config.token_id("system_token_id"),
            "user": config.token_id("user_token_id"),
            "assistant": config.token_id("assistant_token_id"),
        }
        self._names = {v: k for k, v in self.specials.items()} | {
            v: k for k, v in self.roles.items()
        }
        pattern = "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True))
        self._split = re.compile(f"({pattern})")
        self.eos_token_id = self.specials["<|im_end|>"]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> Any:
        """Render (and with ``tokenize``, encode) a chat."""
        text = render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text) if tokenize else text

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        """Return ``{"input_ids": ...}`` of ``text``."""
        return {"input_ids": self.encode(text)}

    def encode(self, text: str) -> list[int]:
        """Encode ``text``: specials by name, the role after ``<|im_start|>`` as its token, ASCII as
        itself."""
        ids: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            if piece in self.specials:
                ids.append(self.specials[piece])
                continue
            if ids and ids[-1] == self.specials["<|im_start|>"]:
                for role, token in self.roles.items():
                    if piece.startswith(role):
                        ids.append(token)
                        piece = piece[len(role) :]
                        break
            ids.extend(ord(c) if ord(c) < 128 else ord("?") for c in piece)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Return the text of ``token_ids``."""
        out = []
        for token in token_ids:
            token = int(token)
            if token in self._names:
                if not skip_special_tokens:
                    out.append(self._names[token])
            elif 32 <= token < 127 or token in (9, 10):
                out.append(chr(token))
            else:
                out.append(f"<{token}>")
        return "".join(out)
