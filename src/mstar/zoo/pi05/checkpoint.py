"""pi0.5 checkpoints: the published PyTorch layout, random ones in it, and loading either.

The published checkpoint (openpi's converted ``PI0Pytorch``, also ``lerobot/pi05_base``) is a
directory::

    checkpoint/
      model.safetensors                 one fp32 file, openpi's parameter names
      config.json                       openpi's {action_dim, action_horizon, *_variant, ...}
                                        or LeRobot's {"type": "pi05", chunk_size, ...}
      assets/<asset_id>/norm_stats.json {"norm_stats": {"state": {mean, std, q01, q99}, "actions":
      ...}}

Our names (`Pi05Weights.state_dict()`) are the checkpoint's with prefixes taken off:

======================================  =======================================================
ours                                    checkpoint
======================================  =======================================================
``vision_tower.*``
``paligemma_with_expert.paligemma.model.vision_tower.vision_model.*``
``multi_modal_projector.linear.*``
``paligemma_with_expert.paligemma.model.multi_modal_projector.linear.*``
``language_model.embed_tokens.weight``  ``paligemma_with_expert.paligemma.lm_head.weight`` (tied)
``language_model.*``                    ``paligemma_with_expert.paligemma.model.language_model.*``
``gemma_expert.*``                      ``paligemma_with_expert.gemma_expert.model.*``
``action_{in,out}_proj.*``              the same, top level
``time_mlp_{in,out}.*``                 the same, top level
(ignored)                               ``paligemma_with_expert.gemma_expert.lm_head.weight``
======================================  =======================================================

The token embedding is tied to the VLM's ``lm_head``; saving keeps only ``lm_head``, so the
published file has no ``...language_model.embed_tokens.weight``. Loading accepts either name
and prefers ``embed_tokens``. The action expert's ``lm_head`` is random and unused upstream.

`load_pi05` reads the parameters of the nodes it is given (`NODE_WEIGHTS`: SigLIP and the
projector for ``vision``, both experts and the action and time projections for ``llm``), into
weights loaded before for other nodes if given; the rest stay on the meta device. A
tensor-parallel rank's ``llm`` (under `mstar.engines.parallel.sharded`) reads its share of each
sharded tensor from the file's slice (`Pi05Weights.shard_slices`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.models.siglip.modeling_siglip import SiglipVisionEmbeddings

from mstar.engines.layers import WeightSlice
from mstar.engines.parallel import current_shard
from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.cache import mstar_cache_dir, written_once
from mstar.zoo.hf_checkpoint import (
    copy_slice,
    load_hf_config,
    replace_parameter,
    safetensors_files,
)
from mstar.zoo.pi05.config import GEMMA_VARIANTS, GemmaConfig, Pi05Config, known_vision_heads
from mstar.zoo.pi05.modules import Pi05Weights
from mstar.zoo.pi05.robots import OPENPI_CAMERAS, get_robot_layout

__all__ = [
    "CONFIG_FORMATS",
    "NODE_WEIGHTS",
    "cached_random_checkpoint",
    "from_checkpoint_names",
    "load_pi05",
    "make_random_checkpoint",
    "to_checkpoint_names",
]

log = structlog.get_logger(__name__)

_T = TypeVar("_T")

WEIGHTS_FILE = "model.safetensors"
DROID_ASSET_ID = "droid"

# (our name, checkpoint name): prefixes when they end in ".", else one exact name. The first
# match wins, so the tied embedding comes before the language model's prefix.
_NAME_TABLE: tuple[tuple[str, str], ...] = (
    ("vision_tower.", "paligemma_with_expert.paligemma.model.vision_tower.vision_model."),
    (
        "multi_modal_projector.linear.",
        "paligemma_with_expert.paligemma.model.multi_modal_projector.linear.",
    ),
    ("language_model.embed_tokens.weight", "paligemma_with_expert.paligemma.lm_head.weight"),
    ("language_model.", "paligemma_with_expert.paligemma.model.language_model."),
    ("gemma_expert.", "paligemma_with_expert.gemma_expert.model."),
    ("action_in_proj.", "action_in_proj."),
    ("action_out_proj.", "action_out_proj."),
    ("time_mlp_in.", "time_mlp_in."),
    ("time_mlp_out.", "time_mlp_out."),
)
NODE_WEIGHTS: dict[str, tuple[str, ...]] = {
    "vision": ("vision_tower.", "multi_modal_projector."),
    "llm": (
        "language_model.",
        "gemma_expert.",
        "action_in_proj.",
        "action_out_proj.",
        "time_mlp_in.",
        "time_mlp_out.",
    ),
}
"""The parameters (our name prefixes) each graph node reads."""

_TIED_EMBEDDING = "paligemma_with_expert.paligemma.lm_head.weight"
_EXPERT_LM_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"
_IGNORED = frozenset({_EXPERT_LM_HEAD})

# config.json keys (openpi's and LeRobot's spellings) that must agree with the config.
_VARIANT_KEYS = {"paligemma_variant": "vlm", "action_expert_variant": "expert"}
# Shapes the weights fix. The action horizon is not one of them: the action expert runs over
# however many action tokens it is given, so a checkpoint trained with chunks of 50
# (`lerobot/pi05_base`) serves DROID's 15 (its config.json's chunk_size is only its default).
_INT_KEYS = {
    "action_dim": "action_dim",
    "max_action_dim": "action_dim",
}

# Bump when `make_random_checkpoint` writes something different: cached copies are keyed on it.
_RANDOM_FORMAT = 2

CONFIG_FORMATS = ("lerobot", "openpi")
"""The ``config.json`` layouts `make_random_checkpoint` writes: LeRobot's ``PI05Config``, or
openpi's conversion script's (``examples/convert_jax_model_to_pytorch.py``)."""


def _rename(name: str, table: Iterable[tuple[str, str]]) -> str | None:
    for source, target in table:
        if name == source:
            return target
        if source.endswith(".") and name.startswith(source):
            return target + name[len(source) :]
    return None


def to_checkpoint_names(state_dict: Mapping[str, _T]) -> dict[str, _T]:
    """Rename our tensors (`Pi05Weights.state_dict()`) to the published checkpoint's names.

    Raises:
        CheckpointError: A name is not one of `Pi05Weights`'s.
    """
    out: dict[str, _T] = {}
    unknown = []
    for name, value in state_dict.items():
        renamed = _rename(name, _NAME_TABLE)
        if renamed is None:
            unknown.append(name)
        else:
            out[renamed] = value
    if unknown:
        raise CheckpointError(f"no pi0.5 checkpoint name for {_some(unknown)}")
    return out


def _from_names(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """Map our names to the checkpoint names they come from; also return the names we do not
    know."""
    ours: dict[str, str] = {}
    unknown: list[str] = []
    for name in names:
        if name in _IGNORED:
            continue
        renamed = _rename(name, ((ckpt, mine) for mine, ckpt in _NAME_TABLE))
        if renamed is None:
            unknown.append(name)
        # embed_tokens wins over lm_head
        elif renamed not in ours or ours[renamed] == _TIED_EMBEDDING:
            ours[renamed] = name
    return ours, unknown


def from_checkpoint_names(tensors: Mapping[str, _T]) -> dict[str, _T]:
    """Rename a published checkpoint's tensors to ours, dropping the unused expert ``lm_head``.

    The VLM's ``lm_head.weight`` becomes ``language_model.embed_tokens.weight`` unless the
    checkpoint also holds that name, which then wins.

    Raises:
        CheckpointError: A name is not in the pi0.5 layout.
    """
    ours, unknown = _from_names(tensors)
    if unknown:
        raise CheckpointError(f"not pi0.5 checkpoint names: {_some(unknown)}")
    return {mine: tensors[ckpt] for mine, ckpt in ours.items()}


# -- loading ----------------------------------------------------------------------------------


def load_pi05(
    checkpoint_dir: str | Path,
    config: Pi05Config,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    nodes: Iterable[str] | None = None,
    into: Pi05Weights | None = None,
) -> Pi05Weights:
    """Load a checkpoint directory into `Pi05Weights` on ``device`` in ``dtype`` (see
    `Pi05Weights.to_precision`).

    Names, shapes and the ``config.json`` (when present) are checked before any weight is
    allocated; tensors are then read one at a time. Under `sharded` (a tensor-parallel rank
    loading the ``llm`` node) the experts are this rank's shard (`Pi05Weights.shard_`), read
    from the tensors' slices only.

    Args:
        checkpoint_dir: The directory.
        config: The model.
        device: Where the weights go.
        dtype: Their dtype.
        nodes: The graph nodes whose weights to read (`NODE_WEIGHTS`; default: every node's);
            the other parameters stay on the meta device.
        into: Weights loaded before onto the same device, in the same dtype, as the same shard
            (for other nodes): add these nodes' parameters to them.

    Raises:
        CheckpointError: The directory lacks the weights, holds missing, unexpected or
            misshapen tensors, its ``config.json`` disagrees with ``config``, or ``into`` holds
            another shard.
        KeyError: An unknown node.
    """
    nodes = list(NODE_WEIGHTS if nodes is None else nodes)
    prefixes = tuple(p for node in nodes for p in NODE_WEIGHTS[node])
    if into is not None and not _unloaded(into, prefixes):
        _shard_llm(into, nodes)  # checks the shard
        return into
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise CheckpointError(f"pi0.5 checkpoint directory {str(directory)!r} does not exist")
    if (directory / "config.json").is_file():
        _check_config_json(load_hf_config(directory), config, directory)
    files = safetensors_files(directory)
    with torch.device("meta"):
        model = Pi05Weights(config)
    expected = model.state_dict()
    ours, unknown = _from_names(files)
    missing = [name for name in expected if name not in ours]
    unexpected = sorted(unknown + [ckpt for mine, ckpt in ours.items() if mine not in expected])
    if missing or unexpected:
        missing_names = list(to_checkpoint_names(dict.fromkeys(missing)))
        raise CheckpointError(
            f"pi0.5 checkpoint {str(directory)!r} does not match config {config.name!r}: "
            f"missing {len(missing)} tensors {_some(missing_names)}, "
            f"unexpected {len(unexpected)} tensors {_some(unexpected)} (wrong config, or not "
            "a pi0.5 checkpoint?)"
        )
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for mine, ckpt in ours.items():
        by_file.setdefault(files[ckpt], []).append((mine, ckpt))
    # The whole checkpoint must fit the config, whichever part of it this rank reads.
    _check_shapes(by_file, expected, directory, config)

    if into is None:
        model = model.to_precision(dtype)  # on meta: only the dtypes change
    else:
        model = into
    shares = _shard_llm(model, nodes)
    wanted = set(_unloaded(model, prefixes))
    params = dict(model.named_parameters())
    device = torch.device(device)
    with torch.no_grad():
        for path, pairs in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for mine, ckpt in pairs:
                    if mine not in wanted:
                        continue
                    target = torch.empty_like(params[mine], device=device)
                    share = shares.get(mine)
                    if share is None:
                        target.copy_(f.get_tensor(ckpt))
                    else:  # a rank's share: its slice of the tensor (zeros past its end)
                        target.zero_()
                        if not share.zero:
                            copy_slice(f.get_slice(ckpt), ckpt, share, target)
                    replace_parameter(model, mine, target)
    if "vision" in nodes:
        _reset_position_ids(model, device)
    return model.eval().requires_grad_(False)


def _unloaded(model: Pi05Weights, prefixes: tuple[str, ...]) -> list[str]:
    """Return the names of the parameters under ``prefixes`` still on the meta device."""
    return [n for n, p in model.named_parameters() if n.startswith(prefixes) and p.is_meta]


def _shard_llm(model: Pi05Weights, nodes: list[str]) -> dict[str, WeightSlice]:
    """Under `sharded` (a tensor-parallel rank loading the ``llm`` node), keep the experts'
    shard only (on meta, before anything is read); return each sharded tensor's share.

    Raises:
        CheckpointError: ``model``'s experts are another shard (or whole) already.
    """
    if "llm" not in nodes:
        return {}
    shard = current_shard()
    # (its products may have left their modules once fused: look at whatever is left)
    loaded = any(
        not p.is_meta for n, p in model.named_parameters() if n.startswith("language_model.")
    )
    if model.shard != shard and (model.shard is not None or loaded):
        raise CheckpointError("pi0.5's llm is loaded here already, as another shard")
    if shard is None or model.shard is not None:
        return {}
    shares = model.shard_slices(shard)
    model.shard_(shard)
    return shares


def _check_shapes(
    by_file: Mapping[Path, list[tuple[str, str]]],
    expected: Mapping[str, torch.Tensor],
    directory: Path,
    config: Pi05Config,
) -> None:
    wrong = []
    for path, pairs in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for mine, ckpt in pairs:
                shape = list(f.get_slice(ckpt).get_shape())
                want = list(expected[mine].shape)
                if shape != want:
                    wrong.append(f"{ckpt} has shape {shape}, the config expects {want}")
    if wrong:
        raise CheckpointError(
            f"pi0.5 checkpoint {str(directory)!r} does not fit config {config.name!r} "
            f"({len(wrong)} tensors; wrong config?): "
            + "; ".join(wrong[:8])
            + ("; ..." if len(wrong) > 8 else "")
        )


def _reset_position_ids(model: Pi05Weights, device: torch.device) -> None:
    """Fill the non-persistent buffers (no checkpoint holds them) on ``device``."""
    persistent = set(model.state_dict())
    transient = {name for name, _ in model.named_buffers() if name not in persistent}
    # a new one needs a value here
    assert transient == {"vision_tower.embeddings.position_ids"}, transient
    for module in model.modules():
        if isinstance(module, SiglipVisionEmbeddings):
            ids = module.position_ids
            fresh = torch.arange(ids.shape[-1], device=device).expand(ids.shape).contiguous()
            module.register_buffer("position_ids", fresh, persistent=False)


def _check_config_json(found: Mapping[str, Any], config: Pi05Config, directory: Path) -> None:
    where = f"{str(directory / 'config.json')!r}"
    for key, part in _VARIANT_KEYS.items():
        if key not in found:
            continue
        name = found[key]
        gemma: GemmaConfig = getattr(config, part)
        known = GEMMA_VARIANTS.get(str(name).removesuffix("_lora"))  # LoRA variants keep the sizes
        declared = config.extra.get(key)
        if (known is not None and known != gemma) or (
            known is None and declared not in (None, name)
        ):
            sizes = f" ({known})" if known is not None else ""
            raise CheckpointError(
                f"{where} names {key} {name!r}{sizes}, but config {config.name!r} has {part} "
                f"{_variant_name(config, key, gemma)!r} ({gemma}): load it with a config "
                f"whose {part} matches"
            )
    for key, field in _INT_KEYS.items():
        if key not in found:
            continue
        want = getattr(config, field)
        if not isinstance(found[key], int) or found[key] != want:
            raise CheckpointError(
                f"{where} has {key}={found[key]!r}, but config {config.name!r} has {field}={want}: "
                f"load it with a config whose {field} is {found[key]!r}"
            )


def _variant_name(config: Pi05Config, key: str, gemma: GemmaConfig) -> str:
    """Return the expert's variant name: the config's ``extra[key]``, else the known sizes', else
    "custom"."""
    if key in config.extra:
        return config.extra[key]
    return next((name for name, known in GEMMA_VARIANTS.items() if known == gemma), "custom")


# -- random checkpoints -----------------------------------------------------------------------


def make_random_checkpoint(
    config: Pi05Config,
    directory: str | Path,
    *,
    seed: int = 0,
    norm_stats: Mapping[str, Mapping[str, Any]] | None = None,
    asset_id: str | None = None,
    config_format: str = "lerobot",
) -> Path:
    """Write seeded random weights in the published layout; return the directory.

    Writes ``model.safetensors`` (fp32, the expert's unused ``lm_head`` included),
    ``config.json`` and ``assets/<asset_id>/norm_stats.json``. Each file is written aside and
    renamed into place, the weights last. ``config.json`` holds what `config_from_checkpoint`
    needs to read ``config`` back: upstream's keys, and ours (``paligemma_config``,
    ``vision_config``, ...) only for sizes no known variant has.

    Args:
        config: The model's sizes.
        directory: Where to write (created if needed).
        seed: Seeds the weights and the generated stats.
        norm_stats: ``{"state": {"mean", "std", "q01", "q99"}, "actions": {...}}``; by default
            random stats with ``q01 < q99``, as wide as the robot's state and actions.
        asset_id: The folder under ``assets/``; by default the robot's openpi asset id.
        config_format: One of `CONFIG_FORMATS`. LeRobot's implies that the prompt's state is
            padded to ``max_state_dim``; openpi's cannot name cameras other than its three.

    Raises:
        UnsupportedModelError: ``config_format`` is unknown or cannot describe ``config``.
    """
    directory = Path(directory)
    layout = get_robot_layout(config.robot)
    config_json = json.dumps(_config_json(config, config_format), indent=2)
    generator = torch.Generator().manual_seed(seed)
    tensors = to_checkpoint_names(_random_weights(config, generator))
    tensors[_EXPERT_LM_HEAD] = _normal(
        (config.vocab_size, config.expert.width), config.expert.width**-0.5, generator
    )
    stats = (
        _random_norm_stats(layout.state_dim, config.robot_dof, seed)
        if norm_stats is None
        else norm_stats
    )
    asset_id = layout.asset_id if asset_id is None else asset_id
    _write_atomically(directory / "config.json", lambda path: path.write_text(config_json))
    payload = {
        "norm_stats": {
            key: {f: _floats(v) for f, v in value.items()} for key, value in stats.items()
        }
    }
    stats_json = json.dumps(payload, indent=2)
    _write_atomically(
        directory / "assets" / asset_id / "norm_stats.json",
        lambda path: path.write_text(stats_json),
    )
    _write_atomically(
        directory / WEIGHTS_FILE,
        lambda path: save_file(tensors, str(path), metadata={"format": "pt"}),
    )
    return directory


def cached_random_checkpoint(config: Pi05Config, seed: int = 0) -> Path:
    """Return a random checkpoint of ``config`` under the mstar cache, writing it once.

    The folder is keyed on the config's values and the seed, and appears whole (it is
    written aside and renamed), so concurrent processes never see half of one. Meant for the
    small configs (``pi05-tiny``, ``pi05-small``): ``pi05-droid`` is 14.5 GB.
    """
    digest = hashlib.sha256(f"{_RANDOM_FORMAT}:{config!r}".encode()).hexdigest()[:12]
    return written_once(
        mstar_cache_dir() / "pi05" / f"{config.name}-seed{seed}-{digest}",
        lambda folder: make_random_checkpoint(config, folder, seed=seed),
        label=f"random {config.name} weights",
    )


def _random_weights(config: Pi05Config, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Return seeded random weights under our names.

    Weights are normal with std ``1/sqrt(fan_in)`` (embeddings ``1/sqrt(width)``), so
    activations stay near unit scale at every depth and tests on random weights see every
    block; biases and the zero-centred Gemma norm weights are small noise around 0, SigLIP
    LayerNorm weights small noise around 1 (noise, not constants, so no two tensors of one
    shape are equal and a swapped name shows in a round trip).
    """
    with torch.device("meta"):
        model = Pi05Weights(config)
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            shape = tuple(param.shape)
            if isinstance(module, nn.LayerNorm) and name == "weight":
                value = 1.0 + _normal(shape, 0.02, generator)
            elif isinstance(module, nn.Embedding):
                value = _normal(shape, shape[1] ** -0.5, generator)
            elif isinstance(module, nn.Linear | nn.Conv2d) and name == "weight":
                value = _normal(shape, math.prod(shape[1:]) ** -0.5, generator)
            else:  # biases, Gemma norm weights
                value = _normal(shape, 0.02, generator)
            out[f"{prefix}.{name}" if prefix else name] = value
    assert out.keys() == model.state_dict().keys()
    return out


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * std


def _random_norm_stats(
    state_width: int, action_width: int, seed: int
) -> dict[str, dict[str, list[float]]]:
    generator = torch.Generator().manual_seed(seed + 1)
    stats = {}
    for key, width in (("state", state_width), ("actions", action_width)):
        mean = torch.randn(width, generator=generator, dtype=torch.float64) * 0.5
        std = 0.1 + torch.rand(width, generator=generator, dtype=torch.float64)
        stats[key] = {
            "mean": mean.tolist(),
            "std": std.tolist(),
            "q01": (mean - 2 * std).tolist(),
            "q99": (mean + 2 * std).tolist(),
        }
    return stats


def _floats(value: Any) -> list[float]:
    return [float(x) for x in torch.as_tensor(value, dtype=torch.float64).flatten().tolist()]


def _config_json(config: Pi05Config, config_format: str) -> dict[str, Any]:
    """Return the ``config.json`` of ``config`` in one of `CONFIG_FORMATS`, plus our keys where
    needed."""
    if config_format == "lerobot":
        found = _lerobot_config_json(config)
    elif config_format == "openpi":
        found = _openpi_config_json(config)
    else:
        raise UnsupportedModelError(
            f"config_format must be one of {', '.join(CONFIG_FORMATS)}, got {config_format!r}"
        )
    return found | _size_blocks(config)


def _openpi_config_json(config: Pi05Config) -> dict[str, Any]:
    """openpi's conversion script's keys, and the Pi0Config fields mstar reads when present."""
    if config.cameras != OPENPI_CAMERAS or config.prompt_state_dim is not None:
        raise UnsupportedModelError(
            "openpi's config.json names neither cameras nor a padded prompt state"
        )
    found: dict[str, Any] = {
        "action_dim": config.action_dim,
        "action_horizon": config.action_horizon,
        "paligemma_variant": _variant_name(config, "paligemma_variant", config.vlm),
        "action_expert_variant": _variant_name(config, "action_expert_variant", config.expert),
        "precision": "float32",
        "pi05": True,
        "max_token_len": config.max_token_len,
        "discrete_state_input": config.discrete_state_input,
    }
    if config.num_steps != 10:
        found["num_steps"] = config.num_steps
    if (config.min_period, config.max_period) != (4e-3, 4.0):
        found |= {"min_period": config.min_period, "max_period": config.max_period}
    return found


def _size_blocks(config: Pi05Config) -> dict[str, Any]:
    """Our keys for the head counts no tensor shape gives, where no known variant or tower has
    them."""
    blocks: dict[str, Any] = {}
    for key, block, gemma in (
        ("paligemma_variant", "paligemma_config", config.vlm),
        ("action_expert_variant", "action_expert_config", config.expert),
    ):
        if GEMMA_VARIANTS.get(_variant_name(config, key, gemma).removesuffix("_lora")) != gemma:
            blocks[block] = {
                "num_heads": gemma.num_heads,
                "num_kv_heads": gemma.num_kv_heads,
                "head_dim": gemma.head_dim,
            }
    vision = config.vision
    if (
        known_vision_heads(vision.width, vision.depth, vision.mlp_dim) != vision.num_heads
        or vision.layer_norm_eps != 1e-6
    ):
        blocks["vision_config"] = {
            "num_heads": vision.num_heads,
            "layer_norm_eps": vision.layer_norm_eps,
        }
    return blocks


def _lerobot_config_json(config: Pi05Config) -> dict[str, Any]:
    """LeRobot's ``PI05Config`` fields, plus openpi's spellings of the same sizes."""
    size = config.vision.image_size
    found: dict[str, Any] = {
        "type": "pi05",
        "paligemma_variant": _variant_name(config, "paligemma_variant", config.vlm),
        "action_expert_variant": _variant_name(config, "action_expert_variant", config.expert),
        "dtype": "float32",
        "chunk_size": config.action_horizon,
        "n_action_steps": config.action_horizon,
        "action_horizon": config.action_horizon,
        "action_dim": config.action_dim,
        "max_state_dim": config.prompt_state_dim or config.action_dim,
        "max_action_dim": config.action_dim,
        "num_inference_steps": config.num_steps,
        "min_period": config.min_period,
        "max_period": config.max_period,
        "tokenizer_max_length": config.max_token_len,
        "image_resolution": [size, size],
    }
    if not config.discrete_state_input:  # not LeRobot's: it always bins the state
        found["discrete_state_input"] = False
    layout = get_robot_layout(config.robot)
    if config.cameras != OPENPI_CAMERAS or config.robot != "droid":
        # LeRobot's features: the cameras (in slot order), the robot's state and action widths.
        cameras = {
            f"observation.images.{c}": {"type": "VISUAL", "shape": [3, size, size]}
            for c in config.cameras
        }
        found["input_features"] = cameras | {
            "observation.state": {"type": "STATE", "shape": [layout.state_dim]}
        }
        found["output_features"] = {"action": {"type": "ACTION", "shape": [config.robot_dof]}}
    return found


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through ``write`` on a file beside it, then rename that into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    write(staging)
    staging.replace(path)


def _some(names: list[str], limit: int = 8) -> str:
    return str(names[:limit]) + ("..." if len(names) > limit else "")
