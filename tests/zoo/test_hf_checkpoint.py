"""Hugging Face checkpoint directories: single and sharded safetensors, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from mstar.errors import CheckpointError
from mstar.zoo.hf_checkpoint import (
    load_hf_config,
    load_into_module,
    load_state_dict,
    safetensors_files,
    save_state_dict,
)


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("shard_bytes", [None, 100], ids=["single", "sharded"])
def test_round_trip(tmp_path: Path, shard_bytes: int | None) -> None:
    src = _module()
    save_state_dict(src.state_dict(), tmp_path, {"model_type": "toy"}, max_shard_bytes=shard_bytes)
    if shard_bytes is not None:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(set(safetensors_files(tmp_path).values())) > 1
    assert load_hf_config(tmp_path) == {"model_type": "toy"}
    dst = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    load_into_module(dst, tmp_path)
    for name, tensor in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], tensor)
    assert set(load_state_dict(tmp_path)) == set(src.state_dict())


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_hf_config(tmp_path)
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        safetensors_files(tmp_path)
    save_state_dict(_module().state_dict(), tmp_path, {}, max_shard_bytes=100)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match="lacks shard files"):
        load_into_module(_module(), tmp_path)


def test_missing_unexpected_and_misshapen_tensors(tmp_path: Path) -> None:
    state = _module().state_dict()
    partial = {k: v for k, v in state.items() if k != "2.bias"}
    partial["extra.weight"] = torch.zeros(2)
    save_state_dict(partial, tmp_path / "a", {})
    with pytest.raises(CheckpointError, match=r"missing 1 tensors \['2\.bias'\].*unexpected 1"):
        load_into_module(_module(), tmp_path / "a")
    load_into_module(_module(), tmp_path / "a", ignore=["extra.weight"], optional=["2.bias"])
    wrong = dict(state)
    wrong["0.weight"] = torch.zeros(8, 5)
    save_state_dict(wrong, tmp_path / "b", {})
    with pytest.raises(CheckpointError, match=r"'0\.weight'.*shape \(8, 5\)"):
        load_into_module(_module(), tmp_path / "b")
