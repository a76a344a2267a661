"""Batched next-token selection: penalties, processors, temperature, top-k/top-p, draws.

Rows with a seed draw from their own `torch.Generator`, so a request's tokens do not
depend on what else is in the batch (or on preemption). Draws use the exponential race
(`argmax(p / E)` with `E ~ Exp(1)`), which samples exactly from `p` with one vector of
randomness per row.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.engines.sequence import Sequence

__all__ = ["Sampler"]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Return the index of each row's maximum (the first one on ties), as int64.

    On CPU this goes through numpy, whose vectorised argmax was 12x faster than
    torch's on `[16, 32000]` float32 logits (0.04 vs 0.43 ms: a twentieth of a small
    model's decode step). Both pick the first maximum and treat NaN as the maximum.
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


class Sampler:
    """Pick one token per row of a logits batch, honouring each row's `SamplingParams`."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Return `[len(seqs)]` int64 token ids sampled from `logits` `[len(seqs), vocab]`."""
        logits = logits.float()
        params = [s.params for s in seqs]
        if any(p.repetition_penalty != 1.0 for p in params):
            logits = self._apply_repetition_penalty(logits, seqs)
        for row, seq in enumerate(seqs):
            if seq.logits_processor is not None:
                logits[row] = seq.logits_processor(seq.token_ids, logits[row])
        if all(p.is_greedy for p in params):
            return argmax_rows(logits)
        greedy = argmax_rows(logits)
        device = logits.device
        temperatures = torch.tensor(
            [p.temperature if not p.is_greedy else 1.0 for p in params],
            dtype=logits.dtype,
            device=device,
        )
        logits = logits / temperatures.unsqueeze(1)
        if any(p.top_k > 0 for p in params):
            logits = self._apply_top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            logits = self._apply_top_p(logits, [p.top_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        # Exponential noise per row: a seeded row draws from its own generator; only the
        # other rows draw from the global one (a full-batch draw would be thrown away).
        noise = torch.empty_like(probs)
        if all(seq.generator is None for seq in seqs):
            noise.exponential_()
        else:
            for row, seq in enumerate(seqs):
                noise[row].exponential_(generator=seq.generator)
        sampled = argmax_rows(probs / noise)
        is_greedy = torch.tensor([p.is_greedy for p in params], device=device)
        return torch.where(is_greedy, greedy, sampled)

    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        for row, seq in enumerate(seqs):
            if seq.params.repetition_penalty != 1.0:
                unique = set(seq.token_ids)
                rows.extend([row] * len(unique))
                cols.extend(unique)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)] = True
        penalty = torch.tensor(
            [s.params.repetition_penalty for s in seqs], dtype=logits.dtype, device=logits.device
        ).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(seen, penalised, logits)

    @staticmethod
    def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
        vocab = logits.shape[-1]
        ks = [k if 0 < k < vocab else vocab for k in top_ks]
        max_k = max(ks)
        values = logits.topk(max_k, dim=-1).values
        index = torch.tensor(ks, device=logits.device).sub_(1).unsqueeze(1)
        # Ties at the k-th value are kept, as in transformers' TopKLogitsWarper.
        threshold = values.gather(1, index)
        return logits.masked_fill(logits < threshold, float("-inf"))

    @staticmethod
    def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
        sorted_logits, sorted_index = logits.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        top_p = torch.tensor(top_ps, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        # Drop the low tail whose mass is <= 1 - p; the most likely token always stays.
        remove = cumulative <= (1 - top_p)
        remove[:, -1] = False
        remove = remove.scatter(1, sorted_index, remove)
        return logits.masked_fill(remove, float("-inf"))
