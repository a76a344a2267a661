"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from mstar.errors import InvalidSamplingParamsError

__all__ = ["SamplingParams"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token of one request.

    Processing order matches transformers' `generate`: repetition penalty, then the
    request's logits processor, then temperature, top-k and top-p, then sampling.

    Attributes:
        temperature: 0 selects greedy decoding; otherwise logits are divided by it.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: keep the smallest set of tokens whose probability mass reaches p; 1 disables.
        repetition_penalty: >1 discourages tokens already in the sequence (prompt included),
            as in transformers (positive logits divided, negative multiplied); 1 disables.
        max_tokens: tokens to generate in this walk before stopping (`length`).
        stop_token_ids: tokens that end the walk (`stop`); the stop token is emitted.
        seed: seeds a per-request `torch.Generator`, so the draws do not depend on batching.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
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
        if self.max_tokens < 1:
            raise InvalidSamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingParamsError(
                f"stop_token_ids must be non-negative, got {self.stop_token_ids}"
            )
        # Accept any iterable of ids from callers but store a tuple (hashable, immutable).
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def greedy(cls, max_tokens: int = 16, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """Make parameters for greedy decoding."""
        return cls(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax."""
        return self.temperature == 0.0
