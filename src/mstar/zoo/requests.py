"""Request fields several zoo models read the same way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["initial_noise"]


def initial_noise(data: Mapping[str, Any], shape: tuple[int, ...]) -> torch.Tensor:
    """Return a request's initial noise of ``shape``: given (``noise``), seeded (``seed``) or fresh.

    Raises:
        ValueError: ``noise`` is not a finite array of ``shape``, or ``seed`` is not an integer
            in [0, 2**63).
    """
    if "noise" in data:
        noise = torch.as_tensor(np.asarray(data["noise"], dtype=np.float32))
        if tuple(noise.shape) != shape or not bool(torch.isfinite(noise).all()):
            raise ValueError(f"noise must be a finite array of shape {list(shape)}, got {list(noise.shape)}")
        return noise
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return torch.randn(shape, generator=generator)
