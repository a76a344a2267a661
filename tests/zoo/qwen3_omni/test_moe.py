"""Qwen3-MoE blocks made deterministic: each row computes as it would alone, and as before."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.layers import make_linears_deterministic
from mstar.engines.native import cpu_kernels
from mstar.zoo.qwen3_omni.modules.moe import SparseMoE


@pytest.mark.skipif(cpu_kernels() is None, reason="needs the native CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_deterministic_moe_computes_each_row_as_alone(dtype: torch.dtype) -> None:
    """Router, routed experts (rows grouped by expert: their counts change with the batch) and
    the shared expert: bit for bit the row alone, and within rounding of the dense products."""
    gen = torch.Generator().manual_seed(0)
    moe = SparseMoE(64, 48, num_experts=8, top_k=2, norm_topk_prob=True, shared_inner=32)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    moe = moe.to(dtype).eval()
    x = torch.randn(37, 64, generator=gen).to(dtype)
    with torch.no_grad():
        dense = moe(x)
        assert make_linears_deterministic(moe) >= 2 + 4  # router, experts; 4 linears
        batch = moe(x)
        for i in range(len(x)):
            assert torch.equal(batch[i], moe(x[i : i + 1])[0])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(batch.float(), dense.float(), atol=tol, rtol=tol)
