"""`AdaptiveCopier`: exact copies by either method; the faster method wins, the other is probed."""

from __future__ import annotations

import pytest
import torch

from mstar.transport.memcopy import AdaptiveCopier


@pytest.mark.parametrize(
    "src",
    [
        torch.randn(1 << 19),  # 2 MiB: timed and chosen
        torch.randn(512, 1024, dtype=torch.float64)[:, ::2],  # large but strided
        torch.randn(100, dtype=torch.bfloat16),  # small
        torch.randn(3, dtype=torch.complex64).conj(),
    ],
    ids=["large", "strided", "small", "conj"],
)
def test_copies_are_exact_whatever_the_method(src: torch.Tensor) -> None:
    copier = AdaptiveCopier()
    for _ in range(4):  # both methods get a turn on large tensors
        dst = torch.empty_like(src, memory_format=torch.contiguous_format)
        copier.copy(dst, src)
        assert torch.equal(dst, src.resolve_conj())


def test_both_methods_are_measured_then_the_faster_is_used_and_the_other_probed() -> None:
    copier = AdaptiveCopier(probe_every=4)
    first = copier.choose()
    copier.record(first, 1 << 30, 0.1)
    second = copier.choose()
    assert {first, second} == set(AdaptiveCopier.METHODS)
    copier.gbps["torch"] = 0.0
    copier.record("torch", 1 << 30, 0.1)  # 10.7 GB/s
    copier.gbps["memmove"] = 0.0
    copier.record("memmove", 1 << 30, 0.05)  # 21.5 GB/s
    picks = [copier.choose() for _ in range(8)]
    assert picks.count("torch") == 2 and picks.count("memmove") == 6
    # The machine gets busy: torch slows down in the average and loses its turn.
    for _ in range(10):
        copier.record("memmove", 1 << 30, 1.0)
    assert copier.gbps["torch"] > copier.gbps["memmove"]
    assert [copier.choose() for _ in range(3)].count("torch") >= 2


def test_invalid_settings_raise() -> None:
    with pytest.raises(ValueError):
        AdaptiveCopier(probe_every=1)
    with pytest.raises(ValueError):
        AdaptiveCopier(smoothing=0)
