"""The toy vocabulary of the small BAGEL configs as a tokenizer the server can use.

Ids 0-255 are UTF-8 bytes, the four specials sit at the top of the vocabulary, and the ids
in between have no text (a random model draws them: they read as ``[id]``). A chat renders as
BAGEL lays out text items, one ``<|im_start|>content<|im_end|>`` per message (upstream's
inferencer has no roles).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from mstar.zoo.bagel.config import SpecialTokens

__all__ = ["ByteTokenizer"]

_SPECIAL_NAMES = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
_SPECIAL = re.compile("(" + "|".join(map(re.escape, _SPECIAL_NAMES)) + ")")


class ByteTokenizer:
    """Bytes as ids, and BAGEL's four special tokens (the subset of a Hugging Face tokenizer mstar uses)."""

    def __init__(self, tokens: SpecialTokens) -> None:
        ids = (tokens.bos, tokens.eos, tokens.start_of_image, tokens.end_of_image)
        self._specials = dict(zip(_SPECIAL_NAMES, ids, strict=True))
        self._names = {i: n for n, i in self._specials.items()}
        self.bos, self.eos = tokens.bos, tokens.eos

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Return the ids of ``text`` (special tokens written out become their ids)."""
        out: list[int] = []
        for i, piece in enumerate(_SPECIAL.split(text)):
            if i % 2:
                out.append(self._specials[piece])
            else:
                out.extend(piece.encode("utf-8"))
        return out

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        """Tokenize as a Hugging Face tokenizer does (``input_ids`` only)."""
        return {"input_ids": self.encode(text)}

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Return the text of ids (incomplete UTF-8 as the replacement character)."""
        data = bytearray()
        parts: list[str] = []
        for token in token_ids:
            if token < 256:
                data.append(token)
                continue
            parts.append(data.decode("utf-8", errors="replace"))
            data.clear()
            if token in self._names:
                parts.append("" if skip_special_tokens else self._names[token])
            else:
                parts.append(f"[{token}]")
        parts.append(data.decode("utf-8", errors="replace"))
        return "".join(parts)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        """Return a token's piece: ``<0xAB>`` for a byte."""
        if token_id < 256:
            return f"<0x{token_id:02X}>"
        return self._names.get(token_id, f"[{token_id}]")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]:
        """Render each message's text as a BAGEL text item."""
        text = "".join(f"<|im_start|>{_text(m.get('content'))}<|im_end|>" for m in messages)
        return self.encode(text) if tokenize else text


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")
