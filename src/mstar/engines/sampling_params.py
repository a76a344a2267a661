"""Per-request sampling parameters, validated on construction (and on decoding: they cross
links between processes as themselves, a tagged msgspec Struct)."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import msgspec

from mstar.errors import InvalidSamplingParamsError

__all__ = ["MAX_LOGPROBS", "SEED_RANGE", "SamplingParams"]

SEED_RANGE = (-(2**63), 2**64)
"""Seeds a `torch.Generator` takes: 64-bit integers, signed or not (half-open range)."""

MAX_LOGPROBS = 20
"""The most alternatives per token a request may ask for (OpenAI's limit)."""


def _check_real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise InvalidSamplingParamsError(f"{name} must be a finite number, got {value!r}")


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise InvalidSamplingParamsError(f"{name} must be an integer, got {value!r}")


class SamplingParams(
    msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True, tag=True
):
    """How to pick each next token of one request.

    Processing order matches transformers' `generate`: repetition penalty (then presence
    and frequency penalties), then the request's logits processor, then temperature,
    top-k and top-p, then sampling.

    Attributes:
        temperature: 0 selects greedy decoding; otherwise logits are divided by it.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: keep the smallest set of tokens whose probability mass reaches p; 1 disables.
        repetition_penalty: >1 discourages tokens already in the sequence (prompt included),
            as in transformers (positive logits divided, negative multiplied); 1 disables.
        max_tokens: tokens to generate in this walk before stopping (`length`).
        stop_token_ids: tokens that end the walk (`stop`); the stop token is emitted.
        seed: seeds a per-request `torch.Generator`, so the draws do not depend on batching.
        presence_penalty: subtracted from the logit of every token generated at least once
            (OpenAI's semantics, in [-2, 2]); 0 disables.
        frequency_penalty: subtracted from a token's logit once per time it was generated
            (in [-2, 2]); 0 disables.
        prompt_len: the sequence's first `prompt_len` tokens are the prompt; presence and
            frequency penalties count the tokens after them (None: those of this walk).
        logprobs: report each sampled token's log-probability and this many most likely
            alternatives (0: the sampled token's only); None reports nothing.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_len: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            _check_real(name, getattr(self, name))
        for name in ("top_k", "max_tokens"):
            _check_int(name, getattr(self, name))
        if not self.temperature >= 0.0:
            raise InvalidSamplingParamsError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise InvalidSamplingParamsError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0.0:
            raise InvalidSamplingParamsError(
                f"repetition_penalty must be > 0 (1 disables), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidSamplingParamsError(
                    f"{name} must be in [-2, 2], got {getattr(self, name)}"
                )
        if self.max_tokens < 1:
            raise InvalidSamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
                raise InvalidSamplingParamsError(f"seed must fit in 64 bits, got {self.seed}")
        if self.prompt_len is not None:
            _check_int("prompt_len", self.prompt_len)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidSamplingParamsError(
                    f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
                )
        if any(
            isinstance(t, bool) or not isinstance(t, Integral) or t < 0 for t in self.stop_token_ids
        ):
            raise InvalidSamplingParamsError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}"
            )
        # Accept any iterable of ids from callers but store a tuple (hashable, immutable).
        msgspec.structs.force_setattr(
            self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids)
        )

    @classmethod
    def greedy(cls, max_tokens: int = 16, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """Make parameters for greedy decoding."""
        return cls(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_token_ids)

    def replace(self, **changes: Any) -> SamplingParams:
        """Return a copy with ``changes`` (validated again)."""
        return msgspec.structs.replace(self, **changes)

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether presence or frequency penalties apply."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
