"""Where a benchmark runs mstar: ``--device`` for every script, the same default everywhere."""

from __future__ import annotations

import argparse

import torch

from mstar.runtime.placement import Placement

__all__ = ["add_device_argument", "rank_devices"]


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--device`` (default: ``cuda`` where torch sees one, else ``cpu``)."""
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument(
        "--device", default=default, help=f"torch device of mstar's ranks (default {default})"
    )


def rank_devices(device: str, placement: Placement | None = None) -> dict[int, str]:
    """Return `EngineConfig.devices` putting every rank of ``placement`` (default: rank 0) on
    ``device``."""
    ranks = (
        {0} if placement is None else {rank for group in placement.groups for rank in group.ranks}
    )
    return dict.fromkeys(sorted(ranks), device)
