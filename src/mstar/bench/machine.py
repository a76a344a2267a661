"""What the machine can do, measured in the benchmark's own run: memory bandwidth, FLOP rates.

A floor is only as honest as the limits it divides by: these are measured with the torch
threads the benchmark runs with, best of several repeats, so a shared machine's slow moments
do not loosen the floor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["best_seconds", "measure_bandwidth", "measure_flops", "measure_machine"]


def best_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Return the fastest of ``repeats`` timed calls of ``fn``, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(num_bytes: int = 256 << 20) -> float:
    """Return memory read bandwidth (bytes/s) of this thread's torch threads: a large tensor summed,
    best of 5."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    return x.numel() * 4 / best_seconds(lambda: x.sum())


def measure_flops(dtype: torch.dtype, *, rows: int = 256, width: int = 2048) -> float:
    """Return the floating-point rate (FLOP/s) of a matrix product in `dtype`, best of 5.

    The product is ``[rows, width] @ [width, width]``: a model's layer applied to ``rows``
    tokens, for a compute ceiling at the widths a benchmark's model multiplies.
    """
    a = torch.randn(rows, width).to(dtype)
    b = torch.randn(width, width).to(dtype)
    return 2 * rows * width * width / best_seconds(lambda: torch.mm(a, b))


def measure_machine(dtypes: Sequence[str]) -> dict[str, float]:
    """Return the memory bandwidth and each dtype's FLOP rate (`<dtype>_flop_per_s`).

    bfloat16's rate is the faster of its own product and float32's: a CPU without bfloat16
    arithmetic (where torch's bfloat16 product crawls) still multiplies bfloat16 weights at
    float32's rate once they are widened, as mstar's tiled products do.
    """
    machine = {
        "bandwidth_bytes_per_s": measure_bandwidth(),
        "float32_flop_per_s": measure_flops(torch.float32),
    }
    if "bfloat16" in dtypes:
        machine["bfloat16_flop_per_s"] = max(
            measure_flops(torch.bfloat16), machine["float32_flop_per_s"]
        )
    return machine
