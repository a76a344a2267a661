"""Token draws of the talker and its code predictor, in transformers' processing order.

Both loops sample inside the talker node (its steps are forward firings, not engine token
walks), so they follow `generate`'s order exactly: repetition penalty over the generated
tokens, suppressed ids, then temperature, top-k, top-p, and one multinomial draw per row from
the request's own generator. With the same seed, one request draws what transformers draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DrawParams", "draw"]


@dataclass(frozen=True, slots=True)
class DrawParams:
    """How one loop picks tokens (``temperature`` 0: greedy)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax."""
        return self.temperature == 0.0


def _penalise(logits: torch.Tensor, history: list[list[int]], penalty: float) -> torch.Tensor:
    logits = logits.clone()
    for row, tokens in enumerate(history):
        if not tokens:
            continue
        index = torch.tensor(sorted(set(tokens)), device=logits.device)
        score = logits[row].index_select(0, index)
        logits[row, index] = torch.where(score < 0, score * penalty, score / penalty)
    return logits


def draw(
    logits: torch.Tensor,
    params: DrawParams,
    generators: list[torch.Generator | None],
    *,
    history: list[list[int]] | None = None,
    suppress: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return one token per row of ``logits`` ``[rows, vocab]`` (float32 processing).

    Args:
        logits: The rows' logits.
        params: The loop's settings.
        generators: One per row (None: torch's default generator).
        history: Per row, the tokens the repetition penalty applies to.
        suppress: ``[vocab]`` bool, ids never drawn.
    """
    scores = logits.float()
    if history is not None and params.repetition_penalty != 1.0:
        scores = _penalise(scores, history, params.repetition_penalty)
    if suppress is not None:
        scores = scores.masked_fill(suppress, float("-inf"))
    if params.is_greedy:
        return scores.argmax(dim=-1)
    scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - params.top_p
        drop[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    rows = [torch.multinomial(probs[i], 1, generator=gen) for i, gen in enumerate(generators)]
    return torch.cat(rows)
