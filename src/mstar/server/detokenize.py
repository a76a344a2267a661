"""Turn a stream of token ids into a stream of text deltas, and cut it at stop strings.

Byte-level tokenizers split multi-byte characters across tokens, and many tokenizers render
a token differently after a space than at the start of a text. So each step decodes a small
window of recent tokens twice, with and without the new ones, and emits only what the new
tokens add, holding it back while it ends in an incomplete UTF-8 character (U+FFFD):

    ids:  ... | prefix_offset ......... read_offset | new ids
               decode(prefix..read) = "ab"
               decode(prefix..end)  = "abc"   -> emit "c", move both offsets forward
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "TokenTexts"]

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Emit the text of a growing token sequence as complete-character deltas.

    Args:
        decode: Decodes a list of token ids to text (e.g. a model's `detokenize`).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the new complete text they finish (possibly empty)."""
        self.token_ids.extend(int(t) for t in token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Return the text still held back at the end of the stream (even if incomplete)."""
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopStringMatcher:
    """Cut a text stream at the first of some stop strings (the stop string is not emitted).

    Text that might be the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.is_stopped = False

    def feed(self, text: str) -> str:
        """Take the next text; return what can be emitted now."""
        if self.is_stopped or not self.stops:
            return "" if self.is_stopped else text
        return self._emit(self._held + text, is_final=False)

    def flush(self) -> str:
        """Return the held-back text at the end of the stream."""
        held, self._held = self._held, ""
        if self.is_stopped or not held:
            return ""
        return self._emit(held, is_final=True)

    def _emit(self, buffer: str, *, is_final: bool) -> str:
        # A stop found at `cut` wins only if no stop can still begin before it: a longer stop
        # may be partly received at an earlier position ("aba" vs "b" in "ab...").
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        pending = -1 if is_final else self._earliest_partial(buffer)
        if cut >= 0 and (pending < 0 or cut <= pending):
            self.is_stopped = True
            self._held = ""
            return buffer[:cut]
        if pending >= 0:
            self._held = buffer[pending:]
            return buffer[:pending]
        self._held = ""
        return buffer

    def _earliest_partial(self, text: str) -> int:
        """Return where the earliest proper prefix of a stop that runs to the end begins, or -1."""
        longest = max(len(s) for s in self.stops)
        for start in range(max(0, len(text) - longest + 1), len(text)):
            tail = text[start:]
            if any(len(tail) < len(s) and s.startswith(tail) for s in self.stops):
                return start
        return -1


def _byte_level_alphabet() -> dict[str, int]:
    """Return GPT-2's byte-level alphabet, character to byte (printable bytes stand for
    themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte fallback pieces


class TokenTexts:
    """Each token's own text and bytes, as OpenAI's log-probabilities show them (cached per id).

    A token that is part of a multi-byte character has no text of its own: its text is then
    what decoding it alone gives (U+FFFD), and its bytes the ones it stands for, read from
    the tokenizer's piece (byte-level BPE pieces and SentencePiece's ``<0xAB>`` pieces).

    Args:
        tokenizer: A Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """Return the text and the UTF-8 bytes of one token."""
        cached = self._cache.get(token_id)
        if cached is None:
            text = str(self._tokenizer.decode([token_id]))
            data = text.encode("utf-8", errors="replace")
            if _INCOMPLETE in text:
                data = self._piece_bytes(token_id) or data
            cached = self._cache[token_id] = (text, list(data))
        return cached

    def _piece_bytes(self, token_id: int) -> bytes | None:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if (match := _BYTE_PIECE.match(piece)) is not None:
            return bytes([int(match[1], 16)])
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return None
