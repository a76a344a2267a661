"""Peak memory a benchmark target adds while it serves one load point (weights excluded).

On CPU the peak is this process's resident-set high-water mark above the resident set when
the point's first request started (Linux: the mark is reset through ``/proc/self/clear_refs``);
on CUDA it is the peak allocation above the allocation then.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

__all__ = ["PeakMemory"]


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak memory (MiB) added while a side runs one load point, keyed by (side, point).

    Call `start` as each of a side's requests starts and `stop` as it ends; the first of a
    burst resets the high-water mark.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[tuple[str, str], float] = {}
        self.num_active: dict[str, int] = {}
        self.base: dict[str, int] = {}

    def start(self, side: str) -> None:
        """Note a request of `side` starting; the first of a burst resets the high-water mark."""
        if self.num_active.get(side, 0) == 0:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(self.device)
                self.base[side] = torch.cuda.memory_allocated(self.device)
            else:
                # Linux: "5" resets the VmHWM high-water mark of this process.
                with contextlib.suppress(OSError):
                    Path("/proc/self/clear_refs").write_text("5")
                self.base[side] = _status_bytes("VmRSS:")
        self.num_active[side] = self.num_active.get(side, 0) + 1

    def stop(self, side: str, request_id: str) -> None:
        """Note a request of `side` ending; keep the largest peak of its point.

        The harness names requests `<kind>-<point>-<i>` (`warmup-<point>-<i>` for warm-up).
        """
        self.num_active[side] -= 1
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) - self.base[side]
        else:
            peak = _status_bytes("VmHWM:") - self.base[side]
        key = (side, request_id.rsplit("-", 1)[0])
        self.peaks[key] = max(self.peaks.get(key, 0.0), peak / 2**20)
