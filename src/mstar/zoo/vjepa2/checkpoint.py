"""V-JEPA 2-AC checkpoints: the published layout, random ones in it, and loading either.

A checkpoint is one ``.pt`` file (``torch.save`` zip format) holding a dict with an
``"encoder"`` and a ``"predictor"`` state dict under the upstream parameter names
(``vjepa2-ac-vitg.pt``). Keys may carry ``module.`` / ``backbone.`` prefixes (distributed
training wrappers); loading strips them. The encoder may also hold a ``pos_embed`` that
RoPE models ignore. Files are read with ``torch.load(weights_only=True)`` (no code runs)
and memory-mapped, so loading one part does not read the other.

Upstream publishes no config beside the file: `config_from_checkpoint` reads the sizes from
the tensors' shapes and counts (without touching their data) and takes what no tensor holds
(heads, image size, frames) from upstream's variants.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.vjepa2.config import EncoderConfig, PredictorConfig, VJepa2Config
from mstar.zoo.vjepa2.encoder import Block, VJepa2Encoder
from mstar.zoo.vjepa2.predictor import ACBlock, ACPredictor

__all__ = [
    "ENCODER_NUM_HEADS",
    "PREDICTOR_NUM_HEADS",
    "checkpoint_dtype",
    "config_from_checkpoint",
    "config_from_parts",
    "is_vjepa2_checkpoint",
    "load_encoder",
    "load_predictor",
    "make_random_checkpoint",
    "random_state_dicts",
    "parts_dtype",
    "read_part",
    "read_parts",
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
                m.weight.copy_(
                    torch.randn(m.weight.shape, generator=generator).clamp_(-2.0, 2.0) * 0.02
                )
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


def _load_payload(path: Path) -> Mapping[str, Any]:
    """Return the file's top-level dict, memory-mapped (tensor data is read when touched)."""
    if not path.is_file():
        raise CheckpointError(f"V-JEPA 2 checkpoint {str(path)!r} does not exist")
    try:
        payload: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a corrupt or foreign file: say which
        raise CheckpointError(f"cannot read V-JEPA 2 checkpoint {str(path)!r}: {exc}") from exc
    if not isinstance(payload, Mapping):
        raise CheckpointError(
            f"{str(path)!r} is not a V-JEPA 2-AC checkpoint: expected a dict with 'encoder' and "
            f"'predictor' state dicts, found {type(payload).__name__}"
        )
    return payload


def _part(payload: Mapping[str, Any], part: str, path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(payload.get(part), Mapping):
        raise CheckpointError(
            f"{str(path)!r} is not a V-JEPA 2-AC checkpoint: expected a dict with "
            f"'encoder' and 'predictor' state dicts, found {sorted(map(str, payload))} (no "
            f"{part!r})"
        )
    out = {}
    for key, value in payload[part].items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{str(path)!r}: {part} entry {key!r} is not a tensor")
        out[_clean(str(key))] = value
    return out


def read_part(path: str | Path, part: str) -> dict[str, torch.Tensor]:
    """Return one part's state dict (``"encoder"`` or ``"predictor"``), keys cleaned.

    Raises:
        CheckpointError: The file is missing, unreadable, or lacks the part.
    """
    if part not in _PARTS:
        raise ValueError(f"part must be one of {_PARTS}, got {part!r}")
    path = Path(path)
    return _part(_load_payload(path), part, path)


def read_parts(path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """Return ``{"encoder": ..., "predictor": ...}`` from one memory-mapped load, keys cleaned.

    Raises:
        CheckpointError: The file is missing, unreadable, or lacks a part.
    """
    path = Path(path)
    payload = _load_payload(path)
    return {part: _part(payload, part, path) for part in _PARTS}


def is_vjepa2_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is an upstream V-JEPA 2-AC ``.pt``: a ``torch.save`` zip whose dict holds an
    ``encoder`` with ``patch_embed.proj.weight`` and a ``predictor`` with
    ``predictor_embed.weight``.

    Cheap: only the zip directory and the pickle are read; the tensors stay memory-mapped.
    """
    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        parts = read_parts(path)
    except CheckpointError:
        return False
    return (
        "patch_embed.proj.weight" in parts["encoder"]
        and "predictor_embed.weight" in parts["predictor"]
    )


def _check_state(
    module: nn.Module, state: Mapping[str, torch.Tensor], part: str, path: Path, hint: str
) -> dict[str, torch.Tensor]:
    """Return ``state`` less ignored keys, checked against ``module``'s keys and shapes."""
    expected = module.state_dict()
    state = {k: v for k, v in state.items() if k not in _IGNORED[part]}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{str(path)!r} does not match this {part}: missing "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''} ({hint})"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{str(path)!r}: {part} weight {key!r} has shape {list(tensor.shape)}, the config "
                f"expects {list(expected[key].shape)} ({hint})"
            )
    return state


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], part: str, path: Path) -> None:
    state = _check_state(module, state, part, path, "wrong config?")
    module.load_state_dict(state, strict=True, assign=True)


# --- sizes read from a checkpoint ---------------------------------------------------------------

ENCODER_NUM_HEADS: dict[int, int] = {
    192: 3,
    384: 6,
    768: 12,
    1024: 16,
    1280: 16,
    1408: 22,
    1664: 26,
}
"""Upstream's encoder heads per width (``src/models/vision_transformer.py``: ``vit_tiny`` ...
``vit_gigantic_xformers``; at 1408 and 1664 the ``_xformers`` variants, which V-JEPA 2
publishes)."""

PREDICTOR_NUM_HEADS: dict[int, int] = {1024: 16}
"""Upstream's AC-predictor heads per width (``configs/train/vitg16/droid-256px-8f.yaml``)."""

UPSTREAM_HEAD_DIM = 64
"""Head width of every upstream variant above but ViT-H: the rule for widths not in the tables."""

UPSTREAM_IMG_SIZE = 256
UPSTREAM_NUM_FRAMES = 64
"""What ``src/hub/backbones.py::_make_vjepa2_ac_model`` builds the published model with."""

_MLP_RATIOS = (4.0, 48 / 11)  # upstream's ratios, kept exact when the hidden width matches one


def _tensor(
    state: Mapping[str, torch.Tensor], key: str, ndim: int, part: str, path: Path
) -> torch.Tensor:
    tensor = state.get(key)
    if tensor is None:
        raise CheckpointError(f"{str(path)!r}: the {part} lacks {key!r}, which gives its sizes")
    if tensor.dim() != ndim:
        raise CheckpointError(
            f"{str(path)!r}: {part} {key!r} has shape {list(tensor.shape)}, expected {ndim} "
            "dimensions"
        )
    return tensor


def _num_blocks(state: Mapping[str, torch.Tensor], prefix: str, part: str, path: Path) -> int:
    """Count the blocks ``{prefix}{i}.*``; they must be numbered 0 .. n-1."""
    indices = {
        int(head)
        for key in state
        if key.startswith(prefix) and (head := key[len(prefix) :].split(".", 1)[0]).isdigit()
    }
    if not indices:
        raise CheckpointError(f"{str(path)!r}: the {part} has no blocks ({prefix}0.* is missing)")
    gaps = sorted(set(range(max(indices) + 1)) - indices)
    if gaps:
        raise CheckpointError(
            f"{str(path)!r}: the {part} has blocks up to {prefix}{max(indices)} but "
            f"{prefix}{gaps[0]}.* is missing"
        )
    return max(indices) + 1


def _num_heads(
    width: int, override: int | None, table: Mapping[int, int], part: str, argument: str, path: Path
) -> int:
    if override is not None:
        return override
    if width in table:
        return table[width]
    if width % UPSTREAM_HEAD_DIM == 0:
        return width // UPSTREAM_HEAD_DIM
    raise CheckpointError(
        f"{str(path)!r}: the {part}'s heads cannot be read from its tensors and its width "
        f"{width} is neither an "
        f"upstream variant's ({sorted(table)}) nor a multiple of {UPSTREAM_HEAD_DIM}: pass "
        f"config_from_checkpoint(..., {argument}=N), or config= a VJepa2Config"
    )


def _mlp_ratio(width: int, hidden: int) -> float:
    """Return the ratio whose ``int(width * ratio)`` is ``hidden`` (upstream's own when one
    fits)."""
    for ratio in _MLP_RATIOS:
        if int(width * ratio) == hidden:
            return ratio
    ratio = hidden / width
    while int(width * ratio) < hidden:  # the quotient rounded down
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def config_from_parts(
    parts: Mapping[str, Mapping[str, torch.Tensor]],
    path: str | Path,
    *,
    img_size: int = UPSTREAM_IMG_SIZE,
    num_frames: int = UPSTREAM_NUM_FRAMES,
    num_heads: int | None = None,
    pred_num_heads: int | None = None,
) -> VJepa2Config:
    """Return the config of state dicts already read from ``path`` (see
    `config_from_checkpoint`)."""
    path = Path(path)
    enc, pred = parts["encoder"], parts["predictor"]
    patch_w = _tensor(enc, "patch_embed.proj.weight", 5, "encoder", path)
    embed_dim, in_chans, tubelet, patch, patch_cols = patch_w.shape
    if patch != patch_cols:
        raise CheckpointError(
            f"{str(path)!r}: encoder 'patch_embed.proj.weight' has non-square patches "
            f"{patch}x{patch_cols}"
        )
    if in_chans != 3:
        raise CheckpointError(
            f"{str(path)!r}: encoder 'patch_embed.proj.weight' takes {in_chans} channels; "
            "V-JEPA 2 encodes RGB (3)"
        )
    if img_size % patch:
        raise CheckpointError(
            f"{str(path)!r}: patch size {patch} (encoder 'patch_embed.proj.weight') does not "
            "divide the image size "
            f"{img_size}: pass config_from_checkpoint(..., img_size=a multiple of {patch})"
        )
    pred_dim, pred_in = _tensor(pred, "predictor_embed.weight", 2, "predictor", path).shape
    if pred_in != embed_dim:
        raise CheckpointError(
            f"{str(path)!r}: predictor 'predictor_embed.weight' takes {pred_in} features but "
            "the encoder's width "
            f"('patch_embed.proj.weight') is {embed_dim}"
        )
    action_dim = _tensor(pred, "action_encoder.weight", 2, "predictor", path).shape[1]
    hidden = _tensor(enc, "blocks.0.mlp.fc1.weight", 2, "encoder", path).shape[0]
    pred_hidden = _tensor(pred, "predictor_blocks.0.mlp.fc1.weight", 2, "predictor", path).shape[0]
    try:
        encoder = EncoderConfig(
            img_size=img_size,
            patch_size=patch,
            tubelet_size=tubelet,
            in_chans=in_chans,
            embed_dim=embed_dim,
            depth=_num_blocks(enc, "blocks.", "encoder", path),
            num_heads=_num_heads(
                embed_dim, num_heads, ENCODER_NUM_HEADS, "encoder", "num_heads", path
            ),
            mlp_ratio=_mlp_ratio(embed_dim, hidden),
        )
        predictor = PredictorConfig(
            embed_dim=embed_dim,
            pred_dim=pred_dim,
            depth=_num_blocks(pred, "predictor_blocks.", "predictor", path),
            num_heads=_num_heads(
                pred_dim, pred_num_heads, PREDICTOR_NUM_HEADS, "predictor", "pred_num_heads", path
            ),
            mlp_ratio=_mlp_ratio(pred_dim, pred_hidden),
            action_dim=action_dim,
            grid_size=encoder.grid_size,
            num_frames=num_frames,
            tubelet_size=tubelet,
        )
        config = VJepa2Config(path.stem, encoder, predictor)
    except UnsupportedModelError as exc:
        raise CheckpointError(
            f"{str(path)!r}: the sizes its tensors give are not a V-JEPA 2 model: {exc}"
        ) from exc
    # Every tensor of every block must fit the sizes read from the first ones.
    hint = "inconsistent with the sizes read from the checkpoint's first tensors"
    with torch.device("meta"):
        _check_state(VJepa2Encoder(config.encoder), enc, "encoder", path, hint)
        _check_state(ACPredictor(config.predictor), pred, "predictor", path, hint)
    return config


def config_from_checkpoint(
    path: str | Path,
    *,
    img_size: int = UPSTREAM_IMG_SIZE,
    num_frames: int = UPSTREAM_NUM_FRAMES,
    num_heads: int | None = None,
    pred_num_heads: int | None = None,
) -> VJepa2Config:
    """Return the config of an upstream ``.pt``, read from its tensors' shapes (one mmap load).

    Upstream publishes no config file, so the sizes come from the state dicts:

    - encoder: ``embed_dim``, ``in_chans``, ``tubelet_size``, ``patch_size`` from
      ``patch_embed.proj.weight`` ``[D, C, t, p, p]``; ``depth`` the count of ``blocks.{i}``;
      ``mlp_ratio`` from ``blocks.0.mlp.fc1.weight``;
    - predictor: ``pred_dim`` (upstream's ``predictor_embed_dim``) from
      ``predictor_embed.weight``; ``depth`` the count of ``predictor_blocks.{i}``;
      ``action_dim`` (``action_embed_dim``) from ``action_encoder.weight``; ``mlp_ratio`` from
      ``predictor_blocks.0.mlp.fc1.weight``.

    What no tensor holds comes from upstream:

    - heads: `ENCODER_NUM_HEADS` / `PREDICTOR_NUM_HEADS` keyed by width (1408 gives 22, the
      ``vit_giant_xformers`` V-JEPA 2 publishes, not ``vit_giant``'s 16), else
      ``width // 64``, else an error asking for ``num_heads`` / ``pred_num_heads``;
    - ``img_size`` 256 and ``num_frames`` 64 (so 32 frames, a horizon of 31): the values the
      hub builds the published model with; RoPE has no tensor that depends on them;
    - ``use_extrinsics`` False: ``extrinsics_encoder`` is in every checkpoint, used or not
      (mstar serves the model without extrinsics); qkv biases and ``norm_eps`` 1e-6 as
      upstream's blocks; planning defaults `CEMConfig`.

    Every tensor is then checked against the sizes (a missing or extra key, or a block of
    another shape, is an error). The config is named after the file's stem.

    Args:
        path: The ``.pt`` file.
        img_size, num_frames, num_heads, pred_num_heads: Override upstream's values above.

    Raises:
        CheckpointError: The file is missing or unreadable, lacks ``encoder`` or ``predictor``,
            lacks a tensor or a block, or holds shapes that disagree (the message names the
            file and the tensor).
    """
    return config_from_parts(
        read_parts(path),
        path,
        img_size=img_size,
        num_frames=num_frames,
        num_heads=num_heads,
        pred_num_heads=pred_num_heads,
    )


def parts_dtype(parts: Mapping[str, Mapping[str, torch.Tensor]]) -> torch.dtype:
    """Return the floating dtype all weights share (float32 if they differ or are another one)."""
    dtypes = {
        t.dtype
        for part, sd in parts.items()
        for k, t in sd.items()
        if t.is_floating_point() and k not in _IGNORED[part]
    }
    if len(dtypes) == 1 and (dtype := dtypes.pop()) in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        return dtype
    return torch.float32


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    """Return the dtype of a checkpoint's weights (`parts_dtype`; no config is read: there is
    none)."""
    return parts_dtype(read_parts(path))


def load_encoder(
    path: str | Path,
    config: VJepa2Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
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
    path: str | Path,
    config: VJepa2Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
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
