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


class _Window:
    """A processor that allows ids [start, end) only and says so (`vocab_ranges`)."""

    narrows_vocab = True

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def vocab_ranges(self, token_ids: list[int]) -> list[tuple[int, int]]:
        return [(self.start, self.end)]

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[: self.start] = float("-inf")
        logits[self.end :] = float("-inf")
        return logits


class _Silent(_Window):
    """The same mask, without declaring its ranges: the sampler must use the whole vocabulary."""

    narrows_vocab = False  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("top_k", "top_p", "penalty"), [(0, 1.0, 1.0), (0, 0.8, 1.3), (7, 0.9, 1.0)]
)
def test_candidate_ranges_draw_exactly_what_the_whole_vocabulary_draws(
    top_k: int, top_p: float, penalty: float
) -> None:
    torch.manual_seed(1)
    logits = torch.randn(24, 1000) * 2
    history = [torch.randint(0, 1000, (20,)).tolist() for _ in range(24)]
    windows = [(100 * (i % 5), 100 * (i % 5) + 60 + i) for i in range(24)]
    params = [
        SamplingParams(
            temperature=0.7, top_k=top_k, top_p=top_p, repetition_penalty=penalty, seed=i
        )
        for i in range(24)
    ]

    def draw(processor: type[_Window]) -> torch.Tensor:
        seqs = _seqs(params, history)
        for seq, (start, end) in zip(seqs, windows, strict=True):
            seq.logits_processor = processor(start, end)
        return Sampler()(logits.clone(), seqs)

    fast, full = draw(_Window), draw(_Silent)
    assert torch.equal(fast, full)
    assert all(start <= t < end for t, (start, end) in zip(fast.tolist(), windows, strict=True))


def test_candidate_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((4000, 50), -5.0)
    logits[:, 20:24] = probs.log()
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4000)]
    seqs = _seqs(params, [[0]] * 4000)
    for seq in seqs:
        seq.logits_processor = _Window(20, 24)
    draws = Sampler()(logits, seqs)
    freq = torch.bincount(draws - 20, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
