"""Qwen3-Omni's batched draws equal transformers' processing done the plain way, bit for bit.

The reference below is the textbook chain (a full sort for top-p, one ``torch.multinomial``
per row); `draw`'s shortcuts must give the same tokens and leave every generator in the
same state, including on ties, suppressed ids and rows with fewer finite scores than k.
"""

from __future__ import annotations

import pytest
import torch

from mstar.zoo.qwen3_omni.modules.sampling import DrawParams, draw


def _reference(
    logits: torch.Tensor,
    params: DrawParams,
    generators: list[torch.Generator],
    history: list[list[int]],
    suppress: torch.Tensor | None,
) -> torch.Tensor:
    scores = logits.float().clone()
    if params.repetition_penalty != 1.0:
        for row, tokens in enumerate(history):
            if tokens:
                index = torch.tensor(sorted(set(tokens)))
                score = scores[row].index_select(0, index)
                scores[row, index] = torch.where(
                    score < 0, score * params.repetition_penalty, score / params.repetition_penalty
                )
    if suppress is not None:
        scores = scores.masked_fill(suppress, float("-inf"))
    scores = scores / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1])).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - params.top_p
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.cat(
        [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    )


@pytest.mark.parametrize(
    "params",
    [
        DrawParams(1.0, 50, 0.8),  # the code predictor's
        DrawParams(0.9, 50, 1.0, 1.05),  # the talker's
        DrawParams(0.7, 0, 0.9),
        DrawParams(1.0, 5, 0.5),
    ],
)
def test_draws_equal_the_plain_chain(params: DrawParams) -> None:
    for trial in range(60):
        rows, vocab = (1, 3, 16)[trial % 3], (2048, 3072, 37)[trial % 3]
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial))
        logits = logits * (1 + trial % 5)
        if trial % 4 == 0:
            logits = logits.round()  # ties at and inside the top k
        suppress = None
        if trial % 2:
            suppress = torch.rand(vocab, generator=torch.Generator().manual_seed(-trial)) < 0.3
        if trial % 10 == 9:
            suppress = torch.ones(vocab, dtype=torch.bool)
            suppress[:3] = False  # fewer finite scores than k
        history = [[(7 * trial + 3 * r + j) % vocab for j in range(5)] for r in range(rows)]
        ours = [torch.Generator().manual_seed(100 * trial + r) for r in range(rows)]
        theirs = [torch.Generator().manual_seed(100 * trial + r) for r in range(rows)]
        got = draw(logits, params, ours, history=history, suppress=suppress)
        want = _reference(logits, params, theirs, history, suppress)
        assert torch.equal(got, want), (trial, got, want)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.get_state(), b.get_state())


def test_greedy_is_the_argmax() -> None:
    logits = torch.randn(4, 50)
    assert torch.equal(draw(logits, DrawParams(temperature=0.0), [None] * 4), logits.argmax(-1))
