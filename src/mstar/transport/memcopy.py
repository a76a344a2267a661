"""`AdaptiveCopier`: copy large tensors with whichever method is faster on this host right now.

Writing a tensor into the shared arena is the one copy of a shared-memory handoff, so its
speed is the handoff's speed. Two methods compete:

- torch's `copy_`, split statically over the intra-op threads: fastest on an idle machine
  (~25-30 GB/s on two cores), but when a core is busy with other work, every copy waits
  for the thread stuck behind it (measured: down to 1-2 GB/s);
- one `memmove` in the calling thread: half the peak, but it degrades gracefully
  (~8-12 GB/s on the same busy machine).

The copier times every large copy, keeps a moving average of each method's throughput,
uses the better one, and tries the other one every `probe_every` copies so that it notices
when the machine's load changes.
"""

from __future__ import annotations

import ctypes
import time

import torch

__all__ = ["AdaptiveCopier"]

# Below this, a copy is too short to time meaningfully or to be worth choosing for.
_MIN_ADAPTIVE_BYTES = 1 << 20


class AdaptiveCopier:
    """Copy CPU tensors into raw memory, choosing the method by measured throughput.

    Args:
        probe_every: every this many large copies use the method not currently preferred.
        smoothing: weight of the newest measurement in each method's moving average.
    """

    METHODS = ("torch", "memmove")

    def __init__(self, probe_every: int = 8, smoothing: float = 0.3) -> None:
        if probe_every < 2 or not 0 < smoothing <= 1:
            raise ValueError("need probe_every >= 2 and 0 < smoothing <= 1")
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.gbps = dict.fromkeys(self.METHODS, 0.0)
        self._num_large = 0

    def choose(self) -> str:
        """Return the method for the next large copy (and count it)."""
        self._num_large += 1
        best, other = sorted(self.METHODS, key=self.gbps.__getitem__, reverse=True)
        unmeasured = [m for m in self.METHODS if self.gbps[m] == 0.0]
        if unmeasured:
            return unmeasured[0]
        return other if self._num_large % self.probe_every == 0 else best

    def record(self, method: str, nbytes: int, seconds: float) -> None:
        """Fold one measured copy into the method's moving average."""
        rate = nbytes / max(seconds, 1e-9) / 1e9
        old = self.gbps[method]
        self.gbps[method] = (
            rate if old == 0.0 else (1 - self.smoothing) * old + self.smoothing * rate
        )

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into `dst` (same dtype and shape; `dst` contiguous CPU memory)."""
        nbytes = src.numel() * src.element_size()
        if nbytes < _MIN_ADAPTIVE_BYTES or not src.is_contiguous() or src.is_conj() or src.is_neg():
            dst.copy_(src)
            return
        method = self.choose()
        start = time.perf_counter()
        if method == "memmove":
            # ctypes releases the GIL for the call: other threads keep running meanwhile.
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        else:
            dst.copy_(src)
        self.record(method, nbytes, time.perf_counter() - start)
