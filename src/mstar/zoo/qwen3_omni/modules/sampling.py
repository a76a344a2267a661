"""Token draws of the talker and its code predictor, in transformers' processing order.

Both loops sample inside the talker node (its steps are forward firings, not engine token
walks), so they follow `generate`'s order exactly: repetition penalty over the generated
tokens, suppressed ids, then temperature, top-k, top-p, and one multinomial draw per row from
the request's own generator. With the same seed, one request draws what transformers draws.

Two shortcuts keep every bit of that while batching the rows (the code predictor draws 15
times per frame, so these draws are most of a frame's time on a CPU):

- top-p after top-k: the ascending sort of a row whose finite scores are exactly its top-k
  values (distinct) is those values reversed after the ``-inf`` ones, so the sort is built
  from `torch.topk`'s (sorted) output instead of sorting the whole vocabulary;
- the draw: ``torch.multinomial(p, 1, generator=g)`` on a CPU is ``argmax(p / q)`` with
  ``q = empty_like(p).exponential_(generator=g)`` (the exponential race), so each row fills
  its own ``q`` from its generator and one division and one argmax serve the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig

__all__ = [
    "CODE_PREDICTOR_SAMPLING",
    "TALKER_GREEDY",
    "TALKER_SAMPLING",
    "DrawParams",
    "draw",
    "talker_suppress_mask",
]


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


TALKER_SAMPLING = DrawParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
"""transformers' ``generate`` defaults for the talker."""

TALKER_GREEDY = DrawParams(temperature=0.0, repetition_penalty=1.05)
"""transformers' talker with ``talker_do_sample=False`` (the repetition penalty still applies)."""

CODE_PREDICTOR_SAMPLING = DrawParams(temperature=1.0, top_k=50, top_p=0.8)
"""The code predictor's draws when the talker samples."""


def _penalise(logits: torch.Tensor, history: list[list[int]], penalty: float) -> torch.Tensor:
    logits = logits.clone()
    for row, tokens in enumerate(history):
        if not tokens:
            continue
        index = torch.tensor(sorted(set(tokens)), device=logits.device)
        score = logits[row].index_select(0, index)
        logits[row, index] = torch.where(score < 0, score * penalty, score / penalty)
    return logits


def _top_p(
    scores: torch.Tensor, top_p: float, top: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """Drop the least likely tokens outside the ``top_p`` mass (transformers'
    `TopPLogitsWarper`)."""
    rows, vocab = scores.shape
    if top is not None:
        values, indices = top  # descending
        k = values.shape[-1]
        finite = values.isfinite().all() and bool((values[:, 1:] != values[:, :-1]).all())
        if finite and bool(((scores != float("-inf")).sum(-1) == k).all()):
            ordered = scores.new_full((rows, vocab), float("-inf"))
            ordered[:, vocab - k :] = values.flip(-1)
            drop = ordered.softmax(dim=-1).cumsum(dim=-1)[:, vocab - k :] <= 1 - top_p
            drop[:, -1] = False  # always keep the most likely token
            mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, indices, drop.flip(-1))
            return scores.masked_fill(mask, float("-inf"))
    ordered, order = torch.sort(scores, descending=False, dim=-1)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[..., -1:] = False  # always keep the most likely token
    return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def _multinomial(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Return one draw per row, each ``torch.multinomial(probs[i], 1, generator=generators[i])``."""
    if probs.device.type != "cpu":
        return torch.cat(
            [torch.multinomial(probs[i], 1, generator=gen) for i, gen in enumerate(generators)]
        )
    race = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        race[i].exponential_(generator=gen)
    return (probs / race).argmax(dim=-1)


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
    if params.temperature != 1.0:  # x / 1.0 is x
        scores = scores / params.temperature
    top: tuple[torch.Tensor, torch.Tensor] | None = None
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        # an unsorted top-k sorted afterwards: the same values, faster than a sorted top-k
        # (the indices of tied values may differ; `_top_p` uses them only without ties)
        values, indices = torch.topk(scores, k, dim=-1, sorted=False)
        values, order = values.sort(dim=-1, descending=True)
        indices = indices.gather(-1, order)
        top = (values, indices)
        scores = scores.masked_fill(scores < values[..., -1:], float("-inf"))
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p, top)
    return _multinomial(scores.softmax(dim=-1), generators)


def talker_suppress_mask(
    config: Qwen3OmniConfig, device: torch.device | None = None
) -> torch.Tensor:
    """Return the codec ids the talker never draws: the top 1,024 but EOS (transformers'
    ``generate``)."""
    vocab = config.talker_text.vocab_size
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[max(0, vocab - 1024) :] = True
    mask[config.codec_id("codec_eos_token_id")] = False
    return mask
