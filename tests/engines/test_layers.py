"""Every weight layout of the fused linears computes the same product as `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines import layers
from mstar.engines.layers import (
    DECODE_ROWS,
    IN_OUT,
    OUT_IN,
    PACKED,
    TILED,
    FusableLinear,
    FusedLinear,
    GatedMLP,
    apply_rotary,
    can_pack,
    choose_layout,
)
from mstar.engines.native import cpu_kernels

LAYOUTS = [OUT_IN, IN_OUT, PACKED, TILED]


@pytest.fixture
def forced_layout(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    layout: str = request.param
    if layout == PACKED and not can_pack(torch.zeros(1, 1)):
        pytest.skip("this torch build has no oneDNN")
    if layout == TILED and layers._tiles(torch.zeros(16, 2)) is None:
        pytest.skip("the native kernels are not built here")
    monkeypatch.setattr(layers, "choose_layout", lambda weight, rows=DECODE_ROWS: layout)
    return layout


@pytest.mark.parametrize("forced_layout", LAYOUTS, indirect=True)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_match_separate_linears(forced_layout: str, bias: bool) -> None:
    torch.manual_seed(0)
    linears = [nn.Linear(48, out, bias=bias) for out in (32, 16, 16)]
    expected_weights = [lin.weight.detach().clone() for lin in linears]
    expected_biases = [lin.bias.detach().clone() if bias else None for lin in linears]
    fused = FusedLinear.of(linears)
    assert fused.layout == forced_layout
    for shape in ((1, 48), (5, 48), (16, 48), (2, 7, 48), (48,)):
        x = torch.randn(shape)
        expected = torch.cat(
            [F.linear(x, w, b) for w, b in zip(expected_weights, expected_biases, strict=True)],
            dim=-1,
        )
        torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)
    if forced_layout in (PACKED, TILED):
        # No second copy: the modules give their weights up to the packed matrix.
        assert all(lin.weight is None for lin in linears)
    else:
        # Dense layouts keep the checkpoint names as views of the fused storage.
        for lin, weight in zip(linears, expected_weights, strict=True):
            torch.testing.assert_close(lin.weight, weight)


@pytest.mark.parametrize("forced_layout", LAYOUTS, indirect=True)
def test_shared_head_leaves_the_embedding_intact(forced_layout: str) -> None:
    embedding = torch.randn(96, 24)  # tiles take 16 outputs at a time
    before = embedding.clone()
    head = FusedLinear.shared(embedding)
    x = torch.randn(3, 24)
    torch.testing.assert_close(head(x), x @ before.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(embedding, before)


@pytest.mark.parametrize("forced_layout", LAYOUTS, indirect=True)
def test_fusable_linear_loads_like_a_linear_and_runs_fused(forced_layout: str) -> None:
    torch.manual_seed(1)
    plain = nn.Linear(24, 48)
    lin = FusableLinear(24, 48)
    lin.load_state_dict(plain.state_dict())
    lin.fuse_for_inference((64,))
    lin.fuse_for_inference((64,))  # a second call keeps the first fusion
    assert lin.fused is not None and lin.fused.layout == forced_layout
    x = torch.randn(2, 3, 5, 24)[:, :, 1:]  # a strided, 4-D batch
    with torch.no_grad():
        torch.testing.assert_close(lin(x), plain(x), rtol=1e-5, atol=1e-5)


def test_layout_choice_is_cached_per_shape_and_rows() -> None:
    weight = torch.randn(40, 24)
    first = choose_layout(weight)
    assert first in LAYOUTS
    assert layers._LAYOUT_CHOICES[(24, 40, torch.float32, DECODE_ROWS)] == first
    assert choose_layout(torch.randn(40, 24)) == first
    wide = choose_layout(weight, (64,))
    assert layers._LAYOUT_CHOICES[(24, 40, torch.float32, (64,))] == wide


def test_layouts_far_slower_than_the_fastest_are_not_timed_further(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each product costs its layout's seconds on a clock the test keeps: the fastest layout is
    chosen, timed in full at every row count, and one over `_HOPELESS` times slower gets its
    warm-up and one timed product, then no more."""
    costs = {OUT_IN: 10.0, IN_OUT: 9.0, PACKED: 1.5, TILED: 1.0}
    clock = [0.0]
    calls: dict[str, int] = dict.fromkeys(costs, 0)

    def product(self: FusedLinear, x: torch.Tensor) -> torch.Tensor:
        calls[self.layout] += 1
        clock[0] += costs[self.layout]
        return x

    monkeypatch.setattr(FusedLinear, "__call__", product)
    monkeypatch.setattr(layers.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(layers, "_evict_caches", lambda: None)
    monkeypatch.setattr(layers, "_LAYOUT_CHOICES", {})
    weight = torch.randn(32, 24)
    tiled = layers._tiles(weight) is not None
    if not tiled and not can_pack(weight):
        pytest.skip("neither the native kernels nor oneDNN's packing here")
    assert choose_layout(weight, (1, 16)) == (TILED if tiled else PACKED)
    if tiled:
        assert calls[TILED] == 2 * 6  # a warm-up and five timed products at each row count
    assert calls[OUT_IN] == calls[IN_OUT] == 2  # a warm-up and one timed product


def test_apply_rotary_turns_half_split_pairs() -> None:
    x = torch.randn(3, 8)
    angles = torch.rand(3, 4)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    got = apply_rotary(x, cos, sin)
    x0, x1 = x[:, :4], x[:, 4:]
    expected = torch.cat(
        [x0 * angles.cos() - x1 * angles.sin(), x1 * angles.cos() + x0 * angles.sin()], dim=-1
    )
    torch.testing.assert_close(got, expected)


def test_route_experts_runs_each_row_through_its_own_weights() -> None:
    from mstar.engines.layers import route_experts

    torch.manual_seed(0)
    experts = [torch.nn.Linear(8, 5), torch.nn.Linear(8, 5), torch.nn.Linear(8, 5)]
    x = torch.randn(7, 8)
    ids = torch.tensor([0, 2, 2, 1, 0, 2, 1])
    with torch.no_grad():
        out = route_experts(x, ids, experts)
        for row, expert in enumerate(ids.tolist()):
            torch.testing.assert_close(out[row], experts[expert](x[row]))
        torch.testing.assert_close(route_experts(x, None, experts), experts[0](x))
        torch.testing.assert_close(
            route_experts(x, torch.ones(7, dtype=torch.long), experts), experts[1](x)
        )


@pytest.mark.parametrize("forced_layout", LAYOUTS, indirect=True)
@pytest.mark.parametrize(
    ("activation", "act"),
    [("silu", F.silu), ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"))],
)
def test_gated_mlp_is_the_gated_block_before_and_after_fusing(
    forced_layout: str, activation: str, act: object
) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(32, 48, activation=activation, bias=True)
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = F.linear(
            act(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
            * F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias),
            mlp.down_proj.weight,
            mlp.down_proj.bias,
        )  # type: ignore[operator]
        torch.testing.assert_close(mlp(x), want)
        mlp.fuse()
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)


def test_gated_mlp_names_the_activations_it_knows() -> None:
    with pytest.raises(ValueError, match="activation must be one of"):
        GatedMLP(4, 8, activation="relu")


@pytest.mark.parametrize("forced_layout", LAYOUTS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_mlp_in_one_pass_gives_the_two_step_values(
    forced_layout: str, dtype: torch.dtype
) -> None:
    """Tiled silu weights take linear_silu_mul (the gate/up outputs never written whole), bit
    for bit the product then silu_mul; other layouts decline it and take the two steps."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the native kernels are not built here")
    if forced_layout == PACKED and not can_pack(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    torch.manual_seed(2)
    mlp = GatedMLP(64, 48).to(dtype)
    mlp.fuse()
    assert mlp.gate_up is not None and mlp.down is not None
    x = torch.randn(37, 64).to(dtype)
    with torch.no_grad():
        gated = mlp.gate_up.silu_mul(x)
        assert (gated is not None) == (forced_layout == TILED)
        two_steps = kernels.silu_mul(mlp.gate_up(x))
        if gated is not None:
            assert torch.equal(gated, two_steps)
        assert torch.equal(mlp(x), mlp.down(two_steps))
        assert mlp.gate_up.silu_mul(x.t().contiguous().t()) is None  # strided features: declined
