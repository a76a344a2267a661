"""`ScreenedArgmax`: a bfloat16 screen that always keeps the float32 argmax."""

from __future__ import annotations

import pytest
import torch

from mstar.engines import native
from mstar.engines.greedy_head import ScreenedArgmax, can_screen

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        not can_screen(torch.zeros(1, 1)), reason="needs a CPU with bfloat16 products"
    ),
]


@pytest.fixture(autouse=True, params=["native", "numpy"])
def decision_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the decision in the native kernel and in numpy (kernels off)."""
    if request.param == "numpy":
        monkeypatch.setattr(native, "ENABLED", False)
    return str(request.param)


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), weight.double()).argmax(dim=1)


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_tokens_equal_the_float32_argmax(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(5000, 64, generator=gen) * 0.05
    head = ScreenedArgmax(weight)
    for scale in (0.1, 1.0, 30.0):
        x = torch.randn(rows, 64, generator=gen) * scale
        tokens = head(x)
        assert tokens is not None and tokens.dtype == torch.int64
        assert tokens.tolist() == _reference(x, weight).tolist()


def test_near_ties_are_decided_in_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3000, 32, generator=gen)
    # Rows 7 and 11 differ below bfloat16's resolution: the screen cannot tell them apart.
    weight[11] = weight[7] + 1e-4 * torch.randn(32, generator=gen)
    head = ScreenedArgmax(weight)
    x = torch.cat([weight[7:8], weight[11:12], weight[7:8] + weight[11:12]]) * 10
    tokens = head(x)
    assert tokens is not None
    assert tokens.tolist() == _reference(x, weight).tolist()
    assert set(tokens.tolist()) <= {7, 11}


def test_exact_ties_pick_the_first_id() -> None:
    weight = torch.randn(100, 16, generator=torch.Generator().manual_seed(1))
    weight[40] = weight[3]
    x = weight[3:4].clone()
    tokens = ScreenedArgmax(weight)(x)
    assert tokens is not None and tokens.tolist() == [3]


def test_non_finite_rows_are_left_undecided() -> None:
    head = ScreenedArgmax(torch.randn(100, 16))
    x = torch.randn(2, 16)
    x[1, 0] = float("nan")
    assert head(x) is None
    x[1, 0] = float("inf")
    assert head(x) is None


def test_flat_rows_with_too_many_candidates_are_left_undecided() -> None:
    head = ScreenedArgmax(torch.ones(600, 16))  # every logit equal: 600 candidates a row
    assert head(torch.randn(3, 16)) is None


def test_only_float32_heads_on_a_cpu_are_screened() -> None:
    assert can_screen(torch.zeros(4, 4))
    assert not can_screen(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not can_screen(torch.zeros(4, 4, dtype=torch.float64))
