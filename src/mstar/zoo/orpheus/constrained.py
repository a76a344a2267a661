"""Audio tokens by frame position: constrained decoding, and validation without it.

Generated audio is a run of frames of 7 tokens; the ``i``-th audio token (counting from 0
after the prompt) sits at frame position ``p = i % 7`` and must be one of the ``K`` ids
``[T + 10 + p*K, T + 10 + (p+1)*K)``. End of speech may close the run (unless the request
ignores it: ``ignore_eos`` runs every request to its ``max_tokens``).

* `AudioLogitsProcessor` masks a request's logits each step so that only those ids can be
  sampled, plus end of speech at frame boundaries (``p == 0``), so that random weights
  still produce well-formed audio.
* `audio_code` checks one token without constraints and fails the request with
  `AudioTokenError` when a model emits an id out of range or for the wrong position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from mstar.errors import AudioTokenError
from mstar.zoo.orpheus.config import FRAME_SIZE, TokenLayout

if TYPE_CHECKING:
    import torch

__all__ = ["AudioLogitsProcessor", "audio_code", "audio_codes"]


class AudioLogitsProcessor:
    """Allow only the audio ids of the current frame position, and end of speech between frames.

    A `mstar.engines.LogitsProcessor`: one instance per request, called each step as
    ``processor(token_ids, logits)`` with all of the request's tokens so far (prompt first)
    and its logits row. Every token after the prompt is an audio token (this processor saw
    to it), so the frame position is ``(len(token_ids) - prompt_len) % 7``.

    Args:
        layout: The id layout.
        prompt_len: How many of the request's tokens are the prompt.
        allow_end: Whether end of speech may close the run (False: every request runs to its
            ``max_tokens``, as ``ignore_eos`` asks).
    """

    __slots__ = ("_audio_ranges", "_eos", "layout", "prompt_len")
    narrows_vocab: ClassVar[Literal[True]] = True  # `NarrowingLogitsProcessor`

    def __init__(self, layout: TokenLayout, prompt_len: int, *, allow_end: bool = True) -> None:
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
        self.layout = layout
        self.prompt_len = prompt_len
        self._eos = layout.end_of_speech if allow_end else None
        self._audio_ranges = [layout.audio_range(p) for p in range(FRAME_SIZE)]

    def position(self, num_tokens: int) -> int:
        """Return the frame position of the next token of a request holding ``num_tokens``."""
        generated = num_tokens - self.prompt_len
        if generated < 0:
            raise ValueError(
                f"the request holds {num_tokens} tokens, fewer than its prompt ({self.prompt_len})"
            )
        return generated % FRAME_SIZE

    def vocab_ranges(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """Return the id ranges this processor leaves finite for the next token (sorted)."""
        position = self.position(len(token_ids))
        ranges = [self._audio_ranges[position]]
        if position == 0 and self._eos is not None:
            ranges.append((self._eos, self._eos + 1))
        return sorted(ranges)

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Set every forbidden logit to ``-inf`` in place and return ``logits``."""
        position = self.position(len(token_ids))
        start, end = self._audio_ranges[position]
        eos = self._eos if position == 0 else None
        eos_logit = logits[eos].clone() if eos is not None else None
        # Two slice fills instead of a vocab-sized mask: no allocation on the hot path.
        logits[:start] = float("-inf")
        logits[end:] = float("-inf")
        if eos is not None and eos_logit is not None:
            logits[eos] = eos_logit
        return logits


def audio_code(layout: TokenLayout, token_id: int, index: int) -> int:
    """Return the code of the ``index``-th audio token of a stream (its position is ``index % 7``).

    Raises:
        AudioTokenError: ``token_id`` is not an audio id for position ``index % 7``.
    """
    position = index % FRAME_SIZE
    start = layout.audio_start + position * layout.codebook_size
    code = token_id - start
    if 0 <= code < layout.codebook_size:
        return code
    where = f"audio token {index} (frame {index // FRAME_SIZE}, position {position})"
    expected = f"expected an id in [{start}, {start + layout.codebook_size})"
    split = layout.split_audio_id(token_id)
    if split is not None:
        other = split[0]
        raise AudioTokenError(
            f"{where} is {token_id}, an audio id for position {other}: {expected}; "
            "enable constrained decoding for weights that do not keep the frame layout"
        )
    if token_id == layout.end_of_speech:
        raise AudioTokenError(f"{where} is end of speech where audio was expected")
    kind = "a text id" if 0 <= token_id < layout.tokeniser_length else "not an audio id"
    raise AudioTokenError(
        f"{where} is {token_id}, {kind}: {expected}; enable constrained decoding for weights "
        "that emit arbitrary ids"
    )


def audio_codes(layout: TokenLayout, token_ids: list[int], start_index: int = 0) -> list[int]:
    """Return the codes of consecutive audio tokens, the first being audio token ``start_index``.

    Raises:
        AudioTokenError: A token is not valid at its position.
    """
    return [audio_code(layout, t, start_index + i) for i, t in enumerate(token_ids)]
