"""Every weight layout of the fused projections computes the same product as `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar.zoo import llama


@pytest.fixture
def forced_layout(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    layout: str = request.param
    if layout == llama.PACKED and not llama._can_pack(torch.zeros(1, 1)):
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(llama, "_choose_layout", lambda weight: layout)
    return layout


@pytest.mark.parametrize("forced_layout", [llama.OUT_IN, llama.IN_OUT, llama.PACKED], indirect=True)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_match_separate_linears(forced_layout: str, bias: bool) -> None:
    torch.manual_seed(0)
    linears = [nn.Linear(48, out, bias=bias) for out in (32, 16, 16)]
    expected_weights = [lin.weight.detach().clone() for lin in linears]
    expected_biases = [lin.bias.detach().clone() if bias else None for lin in linears]
    fused = llama._Fused.of(linears)
    assert fused.layout == forced_layout
    for rows in (1, 5, 16):
        x = torch.randn(rows, 48)
        expected = torch.cat(
            [F.linear(x, w, b) for w, b in zip(expected_weights, expected_biases, strict=True)], dim=-1
        )
        torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)
    if forced_layout == llama.PACKED:
        # No second copy: the modules give their weights up to the packed matrix.
        assert all(lin.weight is None for lin in linears)
    else:
        # Dense layouts keep the checkpoint names as views of the fused storage.
        for lin, weight in zip(linears, expected_weights, strict=True):
            torch.testing.assert_close(lin.weight, weight)


@pytest.mark.parametrize("forced_layout", [llama.OUT_IN, llama.IN_OUT, llama.PACKED], indirect=True)
def test_shared_head_leaves_the_embedding_intact(forced_layout: str) -> None:
    embedding = torch.randn(100, 24)
    before = embedding.clone()
    head = llama._Fused.shared(embedding)
    x = torch.randn(3, 24)
    torch.testing.assert_close(head(x), x @ before.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(embedding, before)


def test_layout_choice_is_cached_per_shape() -> None:
    weight = torch.randn(40, 24)
    first = llama._choose_layout(weight)
    assert first in (llama.OUT_IN, llama.IN_OUT, llama.PACKED)
    assert llama._LAYOUT_CHOICES[(24, 40, torch.float32)] == first
    assert llama._choose_layout(torch.randn(40, 24)) == first
