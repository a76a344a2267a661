"""V-JEPA 2-AC checkpoints: the published layout, random ones in it, and loading either.

A checkpoint is one ``.pt`` file (``torch.save`` zip format) holding a dict with an
``"encoder"`` and a ``"predictor"`` state dict under the upstream parameter names
(``vjepa2-ac-vitg.pt``). Keys may carry ``module.`` / ``backbone.`` prefixes (distributed
training wrappers); loading strips them. The encoder may also hold a ``pos_embed`` that
RoPE models ignore. Files are read with ``torch.load(weights_only=True)`` (no code runs)
and memory-mapped, so loading one part does not read the other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.errors import CheckpointError
from mstar.zoo.vjepa2.config import VJepa2Config
from mstar.zoo.vjepa2.encoder import Block, VJepa2Encoder
from mstar.zoo.vjepa2.predictor import ACBlock, ACPredictor

__all__ = [
    "load_encoder",
    "load_predictor",
    "make_random_checkpoint",
    "random_state_dicts",
    "read_part",
]

_PARTS = ("encoder", "predictor")
_IGNORED = {"encoder": frozenset({"pos_embed"}), "predictor": frozenset()}
_PREFIXES = ("module.", "backbone.")


def _clean(key: str) -> str:
    for prefix in _PREFIXES:
        key = key.replace(prefix, "")
    return key


def _upstream_init(module: nn.Module, blocks: nn.ModuleList, generator: torch.Generator) -> None:
    """Initialise as upstream does: truncated normal(0.02) weights, zero biases, unit norms,
    output projections of block ``i`` scaled by ``1 / sqrt(2 (i + 1))``."""
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Conv3d):
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=generator).clamp_(-2.0, 2.0) * 0.02)
                if m.bias is not None:
                    m.bias.zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    with torch.no_grad():
        for i, block in enumerate(blocks):
            assert isinstance(block, Block | ACBlock)
            scale = 1.0 / math.sqrt(2.0 * (i + 1))
            block.attn.proj.weight.mul_(scale)
            block.mlp.fc2.weight.mul_(scale)


def random_state_dicts(config: VJepa2Config, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Return ``{"encoder": ..., "predictor": ...}`` random weights under upstream names."""
    generator = torch.Generator().manual_seed(seed)
    encoder = VJepa2Encoder(config.encoder)
    _upstream_init(encoder, encoder.blocks, generator)
    predictor = ACPredictor(config.predictor)
    _upstream_init(predictor, predictor.predictor_blocks, generator)
    return {"encoder": encoder.state_dict(), "predictor": predictor.state_dict()}


def make_random_checkpoint(config: VJepa2Config, path: str | Path, seed: int = 0) -> Path:
    """Write a random checkpoint in the published layout (keys prefixed ``module.``).

    The file is written aside and renamed into place, so readers never see half of it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = random_state_dicts(config, seed)
    payload = {part: {f"module.{k}": v for k, v in sd.items()} for part, sd in parts.items()}
    staging = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    torch.save(payload, staging)
    staging.replace(path)
    return path


def read_part(path: str | Path, part: str) -> dict[str, torch.Tensor]:
    """Return one part's state dict (``"encoder"`` or ``"predictor"``), keys cleaned.

    Raises:
        CheckpointError: The file is missing, unreadable, or lacks the part.
    """
    if part not in _PARTS:
        raise ValueError(f"part must be one of {_PARTS}, got {part!r}")
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"V-JEPA 2 checkpoint {str(path)!r} does not exist")
    try:
        payload: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a corrupt or foreign file: say which
        raise CheckpointError(f"cannot read V-JEPA 2 checkpoint {str(path)!r}: {exc}") from exc
    if not isinstance(payload, Mapping) or not isinstance(payload.get(part), Mapping):
        found = sorted(payload) if isinstance(payload, Mapping) else type(payload).__name__
        raise CheckpointError(
            f"{str(path)!r} is not a V-JEPA 2-AC checkpoint: expected a dict with "
            f"'encoder' and 'predictor' state dicts, found {found}"
        )
    out = {}
    for key, value in payload[part].items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{str(path)!r}: {part} entry {key!r} is not a tensor")
        out[_clean(str(key))] = value
    return out


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], part: str, path: Path) -> None:
    expected = {k: v for k, v in module.state_dict().items()}
    state = {k: v for k, v in state.items() if k not in _IGNORED[part]}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{str(path)!r} does not match this {part}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''} (wrong config?)"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{str(path)!r}: {part} weight {key!r} has shape {list(tensor.shape)}, the config "
                f"expects {list(expected[key].shape)} (wrong config?)"
            )
    module.load_state_dict(state, strict=True, assign=True)


def load_encoder(
    path: str | Path, config: VJepa2Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> VJepa2Encoder:
    """Load the encoder of a checkpoint, fused for inference on ``device``.

    Raises:
        CheckpointError: The file is missing, malformed or does not match ``config``.
    """
    with torch.device("meta"):
        encoder = VJepa2Encoder(config.encoder)
    _load_into(encoder, read_part(path, "encoder"), "encoder", Path(path))
    encoder = encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
    encoder.fuse_for_inference()  # last: `.to()` does not move fused weights
    return encoder


def load_predictor(
    path: str | Path, config: VJepa2Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ACPredictor:
    """Load the predictor of a checkpoint, fused for inference on ``device``.

    Raises:
        CheckpointError: The file is missing, malformed or does not match ``config``.
    """
    with torch.device("meta"):
        predictor = ACPredictor(config.predictor)
    _load_into(predictor, read_part(path, "predictor"), "predictor", Path(path))
    predictor = predictor.to(device=device, dtype=dtype).eval().requires_grad_(False)
    predictor.fuse_for_inference()  # last: `.to()` does not move fused weights
    return predictor
