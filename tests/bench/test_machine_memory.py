"""Machine limits and peak memory: what is called, what is kept per side and point."""

from __future__ import annotations

import torch

from mstar.bench.machine import best_seconds, measure_flops
from mstar.bench.memory import PeakMemory


def test_best_seconds_warms_up_once_then_times_each_repeat() -> None:
    calls: list[int] = []
    assert best_seconds(lambda: calls.append(1), repeats=3) >= 0
    assert len(calls) == 1 + 3


def test_peak_memory_keeps_the_largest_peak_of_each_side_and_point() -> None:
    memory = PeakMemory(torch.device("cpu"))
    memory.start("mstar")
    memory.start("mstar")  # a burst: the second start does not reset the mark
    held = torch.ones(8 << 20, dtype=torch.uint8) + 1  # 8 MiB touched while both run
    memory.stop("mstar", "concurrency-2-0")
    memory.stop("mstar", "concurrency-2-1")
    memory.start("hf")
    memory.stop("hf", "warmup-2-0")
    assert set(memory.peaks) == {("mstar", "concurrency-2"), ("hf", "warmup-2")}
    assert memory.num_active == {"mstar": 0, "hf": 0}
    del held


def test_flops_are_measured_at_the_given_widths() -> None:
    assert measure_flops(torch.float32, rows=8, width=64) > 0
