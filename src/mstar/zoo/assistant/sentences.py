"""`SentenceChunkPolicy`: stream an LLM's tokens to a voice a sentence (or clause) at a time.

A chunk policy written beside its model, against the open `ChunkPolicy` protocol: the
runtime knows nothing of sentences. It looks at the buffered token ids themselves. A chunk
ends at the first sentence boundary (a token ending in ``.``, ``!``, ``?`` or holding a line
break, followed by a token that starts a word, so ``3.14`` and ``e.g`` do not end one); a
chunk that reaches ``max_tokens`` without one ends at its last clause boundary (``,``, ``;``,
``:``, a dash), else at its last word start, else after ``max_tokens``. The look-ahead token
is needed to tell, so a sentence fires when the token after it arrives; the final chunk (the
producer ended) takes the rest. Chunks never overlap and carry no left context.

The token classes come from the tokenizer's own pieces (`SentenceChunkPolicy.for_tokenizer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["SentenceChunkPolicy"]

_SENTENCE_END = (".", "!", "?")
_CLAUSE_END = (",", ";", ":", "\u2014", "\u2013")
# Closing quotes and brackets may follow the punctuation that ends a sentence or clause.
_CLOSERS = "\"')]}\u201d\u2019"


@dataclass(frozen=True, slots=True)
class SentenceChunkPolicy:
    """Fire on sentence boundaries of a token stream, with at most ``max_tokens`` per chunk.

    Args:
        sentence_ends: Token ids whose text ends a sentence (or holds a line break).
        clause_ends: Token ids whose text ends a clause.
        word_starts: Token ids whose text starts with whitespace (a boundary may precede them).
        max_tokens: Most new tokens per chunk.
        min_tokens: Fewest tokens before a boundary fires (shorter pieces join the next).
        first_clause: The first chunk also ends at a clause boundary.
    """

    sentence_ends: frozenset[int] = field(repr=False)
    clause_ends: frozenset[int] = field(repr=False)
    word_starts: frozenset[int] = field(repr=False)
    max_tokens: int = 48
    min_tokens: int = 4
    first_clause: bool = True
    continue_after_done: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SentenceChunkPolicy max_tokens must be >= 1, got {self.max_tokens}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                "SentenceChunkPolicy min_tokens must be in [1, "
                f"max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, *, max_tokens: int = 48, min_tokens: int = 4, first_clause: bool = True
    ) -> SentenceChunkPolicy:
        """Build the token classes from every piece of a Hugging Face tokenizer's vocabulary."""
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        sentence, clause, word = set(), set(), set()
        for token_id, piece in enumerate(pieces):
            if piece[:1].isspace():
                word.add(token_id)
            core = piece.rstrip().rstrip(_CLOSERS)
            if "\n" in piece or core.endswith(_SENTENCE_END):
                sentence.add(token_id)
            elif core.endswith(_CLAUSE_END):
                clause.add(token_id)
        return cls(
            frozenset(sentence),
            frozenset(clause),
            frozenset(word),
            max_tokens,
            min_tokens,
            first_clause,
        )

    def next_window(
        self, items: Sequence[Any], num_delivered: int, num_chunks: int
    ) -> tuple[int, int] | None:
        """End the chunk at the first sentence boundary, or at ``max_tokens`` (see the module
        doc)."""
        start, num_items = num_delivered, len(items)
        last = min(
            num_items - 1, start + self.max_tokens
        )  # a boundary before `end` needs items[end]
        clause_fires = num_chunks == 0 and self.first_clause
        clause_cut = word_cut = None
        for end in range(start + 1, last + 1):
            if int(items[end]) not in self.word_starts:
                continue
            before = int(items[end - 1])
            is_clause = before in self.clause_ends
            if (
                before in self.sentence_ends or (is_clause and clause_fires)
            ) and end - start >= self.min_tokens:
                return (start, end)
            if is_clause:
                clause_cut = end
            word_cut = end
        if num_items - start <= self.max_tokens:
            return None
        return (start, clause_cut or word_cut or start + self.max_tokens)

    def final_start(self, num_items: int, num_delivered: int) -> int:
        """The final chunk holds what was not delivered."""
        return num_delivered

    def retained_from(self, num_delivered: int) -> int:
        """No chunk looks back."""
        return num_delivered

    def __str__(self) -> str:
        return (
            f"SentenceChunkPolicy(max_tokens={self.max_tokens}, min_tokens={self.min_tokens}, "
            f"first_clause={self.first_clause})"
        )
