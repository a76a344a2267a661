"""BAGEL's tokenizers: a checkpoint's Qwen2 tokenizer, or the toy vocabulary of random checkpoints.

A published checkpoint ships Qwen2's tokenizer as ``vocab.json`` + ``merges.txt`` +
``tokenizer_config.json`` (byte-level BPE; the special tokens in ``added_tokens_decoder``),
sometimes also ``tokenizer.json``. `load_tokenizer` builds transformers' `Qwen2Tokenizer` (from
transformers 5 on, the `tokenizers` library's byte-level BPE with Qwen2's pre-tokenizer regex)
from them by name: `AutoTokenizer` reads the class from ``tokenizer_config.json``, and where
that names none (BAGEL's own code never needed it: it imports its tokenizer class directly)
it falls back to converting a slow tokenizer and fails asking for sentencepiece or tiktoken.

The toy vocabulary (`ByteTokenizer`, a directory without tokenizer files): ids 0-255 are
UTF-8 bytes, the four specials sit at the top of the vocabulary, and the ids in between have
no text (a random model draws them: they read as ``[id]``). A chat renders as BAGEL lays out
text items, one ``<|im_start|>content<|im_end|>`` per message (upstream's inferencer has no
roles).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mstar.errors import CheckpointError
from mstar.zoo.bagel.config import SpecialTokens

__all__ = ["TOKEN_NAMES", "ByteTokenizer", "has_tokenizer", "load_tokenizer", "special_tokens_of"]

# BAGEL's four tokens, in `SpecialTokens` order (bos, eos, start and end of an image).
TOKEN_NAMES = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
_SPECIAL = re.compile("(" + "|".join(map(re.escape, TOKEN_NAMES)) + ")")
_BPE_FILES = ("vocab.json", "merges.txt")


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a checkpoint directory ships a tokenizer (``tokenizer.json``, or ``vocab.json`` /
    ``merges.txt``)."""
    directory = Path(directory)
    return any((directory / name).is_file() for name in ("tokenizer.json", *_BPE_FILES))


def load_tokenizer(directory: str | Path) -> Any:
    """Return the directory's Qwen2 tokenizer (transformers' `Qwen2Tokenizer`, named, not guessed).

    Its chat template is ``tokenizer_config.json``'s ``chat_template`` (or ``chat_template.jinja``),
    else ``chat_template.json``'s, rendered by transformers' ``apply_chat_template`` (jinja2).

    Raises:
        CheckpointError: Half of the BPE files, or files transformers cannot read.
    """
    from transformers import Qwen2Tokenizer

    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        missing = [name for name in _BPE_FILES if not (directory / name).is_file()]
        if missing:
            raise CheckpointError(
                f"BAGEL checkpoint {str(directory)!r} has "
                f"{' and '.join(n for n in _BPE_FILES if n not in missing)} "
                f"but no {missing[0]} (Qwen2's tokenizer needs vocab.json and merges.txt, or "
                "tokenizer.json)"
            )
    try:
        tokenizer = Qwen2Tokenizer.from_pretrained(str(directory))
    except Exception as exc:  # transformers raises many types for unreadable files
        raise CheckpointError(
            f"BAGEL checkpoint {str(directory)!r}: cannot read its Qwen2 tokenizer: {exc}"
        ) from None
    template_file = directory / "chat_template.json"
    if tokenizer.chat_template is None and template_file.is_file():
        try:
            template = json.loads(template_file.read_text())["chat_template"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{template_file}: no readable chat_template ({exc!r})") from None
        if not isinstance(template, str):
            raise CheckpointError(
                f"{template_file}: chat_template must be a string (a jinja2 template)"
            )
        tokenizer.chat_template = template
    return tokenizer


def special_tokens_of(tokenizer: Any) -> SpecialTokens:
    """Return the ids of BAGEL's four tokens in a Hugging Face tokenizer.

    As upstream's ``add_special_tokens``, a token the tokenizer lacks is added to it (so it
    takes the next free id); Qwen2's tokenizer has all four.
    """
    vocab = tokenizer.get_vocab()
    missing = [name for name in TOKEN_NAMES if name not in vocab]
    if missing:
        tokenizer.add_tokens(missing)
    bos, eos, soi, eoi = (int(tokenizer.convert_tokens_to_ids(name)) for name in TOKEN_NAMES)
    return SpecialTokens(bos=bos, eos=eos, start_of_image=soi, end_of_image=eoi)


class ByteTokenizer:
    """Bytes as ids, and BAGEL's four special tokens (the subset of a Hugging Face tokenizer mstar
    uses)."""

    def __init__(self, tokens: SpecialTokens) -> None:
        ids = (tokens.bos, tokens.eos, tokens.start_of_image, tokens.end_of_image)
        self._specials = dict(zip(TOKEN_NAMES, ids, strict=True))
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
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render each message's text as a BAGEL text item."""
        text = "".join(f"<|im_start|>{_text(m.get('content'))}<|im_end|>" for m in messages)
        return self.encode(text) if tokenize else text


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")
