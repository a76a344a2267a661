"""Sampler: the same filtering as transformers' processors, exact draws per seed."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mstar.engines import Sampler, SamplingParams, Sequence


def _seqs(params: list[SamplingParams], history: list[list[int]]) -> list[Sequence]:
    seqs = []
    for i, (p, h) in enumerate(zip(params, history, strict=True)):
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        seqs.append(Sequence(str(i), h, p, arrival=i, generator=gen))
    return seqs


def test_greedy_rows_take_the_argmax_after_the_penalty() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.4]])
    params = [SamplingParams.greedy(), SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    got = Sampler()(logits.clone(), _seqs(params, [[1], [0]]))
    assert got.tolist() == [1, 2]  # row 2: 0.5 / 2 = 0.25 < 0.4


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature", "penalty"),
    [(5, 1.0, 1.0, 1.0), (0, 0.8, 0.7, 1.0), (10, 0.5, 1.3, 1.3), (0, 1.0, 1.0, 1.5)],
)
def test_filtering_matches_transformers(
    top_k: int, top_p: float, temperature: float, penalty: float
) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    history = [torch.randint(0, 50, (12,)).tolist() for _ in range(4)]
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty
    )
    seqs = _seqs([params] * 4, history)
    ours = logits.clone()
    if penalty != 1.0:
        ours = Sampler._apply_repetition_penalty(ours, seqs)
    ours = ours / temperature
    if top_k:
        ours = Sampler._apply_top_k(ours, [top_k] * 4)
    if top_p < 1.0:
        ours = Sampler._apply_top_p(ours, [top_p] * 4)
    ids = torch.tensor(history)
    ref = logits.clone()
    if penalty != 1.0:
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, ref)
    ref = TemperatureLogitsWarper(temperature)(ids, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(ids, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(ids, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_draws_follow_the_distribution_and_the_seed() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).clone()
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4000)]
    draws = Sampler()(logits, _seqs(params, [[0]] * 4000))
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
    again = Sampler()(logits[:10].clone(), _seqs(params[:10], [[0]] * 10))
    assert torch.equal(again, draws[:10])  # same seeds, same tokens, any batch
