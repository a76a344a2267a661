"""`--device` for the benchmarks: every rank a placement names goes on the device."""

from __future__ import annotations

import argparse

from mstar.bench import add_device_argument, rank_devices
from mstar.runtime import Placement

TWO_RANKS = """
model: orpheus
node_groups:
  - {node_names: [LLM], ranks: [0]}
  - {node_names: [snac_decoder], ranks: [2]}
"""


def test_every_placed_rank_gets_the_device() -> None:
    assert rank_devices("cuda") == {0: "cuda"}
    assert rank_devices("cuda:1", Placement.from_yaml(TWO_RANKS)) == {0: "cuda:1", 2: "cuda:1"}


def test_the_flag_defaults_to_what_torch_sees() -> None:
    import torch

    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    assert parser.parse_args([]).device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert parser.parse_args(["--device", "cpu"]).device == "cpu"
