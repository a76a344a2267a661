"""BAGEL checkpoints: the published layout, random ones in it, and loading either.

The published checkpoint (``ByteDance-Seed/BAGEL-7B-MoT``) is a directory::

    checkpoint/
      llm_config.json    Qwen2 config (hidden_size, num_hidden_layers, ...)
      vit_config.json    SigLIP config (num_hidden_layers counts the dropped last layer)
      ema.safetensors    language_model.*, time_embedder.*, vae2llm.*, llm2vae.*, latent_pos_embed.*,
                         vit_model.vision_model.*, connector.*, vit_pos_embed.*
      ae.safetensors     the FLUX autoencoder (BFL names)

Our names (`BagelWeights.state_dict()`) are the checkpoint's but for two things: the ViT sits
at ``vit_model.*`` (transformers' `SiglipVisionModel` has no ``vision_model`` level), and its
patch embedding is a conv ``[hidden, 3, p, p]`` where the checkpoint keeps upstream's linear
``[hidden, p * p * 3]`` over (row, col, channel).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mstar.errors import CheckpointError
from mstar.zoo.bagel.config import BagelConfig
from mstar.zoo.bagel.llm import sincos_2d
from mstar.zoo.bagel.vae import FluxVAE, bfl_vae_shapes
from mstar.zoo.bagel.weights import BagelWeights
from mstar.zoo.cache import mstar_cache_dir, written_once

__all__ = [
    "cached_random_checkpoint",
    "from_checkpoint_name",
    "load_bagel",
    "make_random_checkpoint",
    "to_checkpoint_name",
]

log = structlog.get_logger(__name__)

EMA_FILE, AE_FILE = "ema.safetensors", "ae.safetensors"
LLM_CONFIG, VIT_CONFIG = "llm_config.json", "vit_config.json"
_PATCH = "vit_model.embeddings.patch_embedding.weight"
_RANDOM_FORMAT = 1  # bump when the random weights change


def to_checkpoint_name(name: str) -> str:
    """Return the checkpoint's name of one of ours."""
    return "vit_model.vision_model." + name.removeprefix("vit_model.") if name.startswith("vit_model.") else name


def from_checkpoint_name(name: str) -> str:
    """Return our name of a checkpoint tensor."""
    prefix = "vit_model.vision_model."
    return "vit_model." + name.removeprefix(prefix) if name.startswith(prefix) else name


def _checkpoint_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if name == _PATCH:
        return (shape[0], shape[1] * shape[2] * shape[3])
    return shape


def _from_checkpoint_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if name == _PATCH:  # linear over (row, col, channel) -> conv [out, c, p, p]
        out, c, p, _ = shape
        return tensor.reshape(out, p, p, c).permute(0, 3, 1, 2)
    return tensor


def _to_checkpoint_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if name == _PATCH:
        return tensor.permute(0, 2, 3, 1).reshape(tensor.shape[0], -1).contiguous()
    return tensor


def llm_config_json(config: BagelConfig) -> dict[str, Any]:
    """Return ``llm_config.json`` of a config (Qwen2's keys)."""
    llm = config.llm
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": llm.hidden_size,
        "intermediate_size": llm.intermediate_size,
        "num_hidden_layers": llm.num_layers,
        "num_attention_heads": llm.num_heads,
        "num_key_value_heads": llm.num_kv_heads,
        "vocab_size": llm.vocab_size,
        "rope_theta": llm.rope_theta,
        "rms_norm_eps": llm.rms_norm_eps,
        "max_position_embeddings": llm.max_position,
        "tie_word_embeddings": False,
    }


def vit_config_json(config: BagelConfig) -> dict[str, Any]:
    """Return ``vit_config.json`` of a config (it counts the layer upstream drops)."""
    vit = config.vit
    return {
        "model_type": "siglip_vision_model",
        "hidden_size": vit.hidden_size,
        "intermediate_size": vit.intermediate_size,
        "num_attention_heads": vit.num_heads,
        "num_hidden_layers": vit.num_layers + 1,
        "patch_size": vit.patch_size,
        "image_size": vit.image_size,
    }


def _check_json(directory: Path, filename: str, want: Mapping[str, Any], config: BagelConfig) -> None:
    path = directory / filename
    if not path.is_file():
        raise CheckpointError(f"BAGEL checkpoint {str(directory)!r} has no {filename}")
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    for key, value in want.items():
        if key in ("architectures", "model_type", "hidden_act", "tie_word_embeddings"):
            continue
        if key in found and found[key] != value:
            raise CheckpointError(
                f"{path}: {key} is {found[key]!r} but config {config.name!r} has {value!r} (wrong config for this checkpoint?)"
            )


def load_bagel(
    checkpoint_dir: str | Path,
    config: BagelConfig,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[BagelWeights, FluxVAE]:
    """Load a checkpoint directory: `BagelWeights` from ``ema.safetensors``, the VAE from ``ae.safetensors``.

    Both JSON configs, every name and every shape are checked before weights are allocated.

    Raises:
        CheckpointError: A file is missing or disagrees with ``config``; tensors are missing,
            unexpected or misshapen.
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise CheckpointError(f"BAGEL checkpoint directory {str(directory)!r} does not exist")
    _check_json(directory, LLM_CONFIG, llm_config_json(config), config)
    _check_json(directory, VIT_CONFIG, vit_config_json(config), config)
    for filename in (EMA_FILE, AE_FILE):
        if not (directory / filename).is_file():
            raise CheckpointError(f"BAGEL checkpoint {str(directory)!r} has no {filename}")
    with torch.device("meta"):
        weights = BagelWeights(config)
    expected = {name: tuple(t.shape) for name, t in weights.state_dict().items()}
    ema = directory / EMA_FILE
    with safe_open(str(ema), framework="pt") as f:
        found = {from_checkpoint_name(name): (name, tuple(f.get_slice(name).get_shape())) for name in f.keys()}  # noqa: SIM118
    missing = sorted(to_checkpoint_name(n) for n in expected if n not in found)
    unexpected = sorted(ckpt for mine, (ckpt, _) in found.items() if mine not in expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{ema} does not match config {config.name!r}: missing {len(missing)} tensors {_some(missing)}, "
            f"unexpected {len(unexpected)} {_some(unexpected)} (wrong config, or not a BAGEL checkpoint?)"
        )
    wrong = [
        f"{ckpt} has shape {list(shape)}, the config expects {list(_checkpoint_shape(mine, expected[mine]))}"
        for mine, (ckpt, shape) in found.items()
        if shape != _checkpoint_shape(mine, expected[mine])
    ]
    if wrong:
        raise CheckpointError(f"{ema} does not fit config {config.name!r}: " + "; ".join(wrong[:6]))
    weights = weights.to(dtype=dtype)
    weights.to_empty(device=device)
    _reset_buffers(weights)
    targets = weights.state_dict(keep_vars=True)
    with torch.no_grad(), safe_open(str(ema), framework="pt") as f:
        for mine, (ckpt, _) in found.items():
            targets[mine].copy_(_from_checkpoint_tensor(mine, f.get_tensor(ckpt), expected[mine]))
    vae = FluxVAE(config.vae)
    with safe_open(str(directory / AE_FILE), framework="pt") as f:
        ae = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    vae.load_bfl(ae)
    vae = vae.to(device=device, dtype=dtype)
    return weights.eval().requires_grad_(False), vae.eval().requires_grad_(False)


def _reset_buffers(weights: BagelWeights) -> None:
    """Refill the non-persistent buffers that `to_empty` left uninitialised (the ViT's position ids)."""
    persistent = set(weights.state_dict())
    transient = {name for name, _ in weights.named_buffers() if name not in persistent}
    assert transient <= {"vit_model.embeddings.position_ids"}, transient  # a new one needs a value here
    ids = weights.vit_model.embeddings.position_ids
    ids.copy_(torch.arange(ids.shape[-1], device=ids.device).expand_as(ids))


def random_tensors(config: BagelConfig, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Return seeded random ``ema`` and ``ae`` tensors under the checkpoint's names (fp32).

    Norms are near one, the position tables are their sin-cos values, the velocity head is
    not zero (upstream initialises it to zero; trained weights are not).
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in BagelWeights(config).state_dict().items()}
    ema: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name == "latent_pos_embed.pos_embed":
            tensor = sincos_2d(config.llm.hidden_size, config.max_latent_size)
        elif name == "vit_pos_embed.pos_embed":
            tensor = sincos_2d(config.llm.hidden_size, config.vit.max_patches_per_side)
        elif "norm" in name.rsplit(".", 2)[-2] or name.endswith(("layer_norm1.weight", "layer_norm2.weight")):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator) if name.endswith("weight") else 0.02 * torch.randn(shape, generator=generator)
        elif len(shape) == 1:
            tensor = 0.02 * torch.randn(shape, generator=generator)
        else:
            fan_in = shape[1] if len(shape) == 2 else int(torch.tensor(shape[1:]).prod())
            std = 1.0 if "embed" in name and len(shape) == 2 and "patch" not in name else fan_in**-0.5
            tensor = std * torch.randn(shape, generator=generator)
        ema[to_checkpoint_name(name)] = _to_checkpoint_tensor(name, tensor)
    ae: dict[str, torch.Tensor] = {}
    for name, shape in bfl_vae_shapes(config.vae).items():
        if len(shape) == 1:
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            ae[name] = base + 0.02 * torch.randn(shape, generator=generator)
        else:
            fan_in = int(torch.tensor(shape[1:]).prod())
            ae[name] = fan_in**-0.5 * torch.randn(shape, generator=generator)
    return ema, ae


def make_random_checkpoint(config: BagelConfig, directory: str | Path, *, seed: int = 0) -> Path:
    """Write seeded random weights in the published layout (both JSON configs, both files); return the directory."""
    directory = Path(directory)
    ema, ae = random_tensors(config, seed)
    _write(directory / LLM_CONFIG, lambda p: p.write_text(json.dumps(llm_config_json(config), indent=2)))
    _write(directory / VIT_CONFIG, lambda p: p.write_text(json.dumps(vit_config_json(config), indent=2)))
    _write(directory / AE_FILE, lambda p: save_file(ae, str(p), metadata={"format": "pt"}))
    _write(directory / EMA_FILE, lambda p: save_file(ema, str(p), metadata={"format": "pt"}))
    return directory


def cached_random_checkpoint(config: BagelConfig, seed: int = 0) -> Path:
    """Return a random checkpoint of ``config`` under the mstar cache, writing it once (small configs)."""
    digest = hashlib.sha256(f"{_RANDOM_FORMAT}:{config!r}".encode()).hexdigest()[:12]
    return written_once(
        mstar_cache_dir() / "bagel" / f"{config.name}-seed{seed}-{digest}",
        lambda folder: make_random_checkpoint(config, folder, seed=seed),
        label=f"random {config.name} weights",
    )


def _write(path: Path, write: Callable[[Path], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    write(staging)
    staging.replace(path)


def _some(names: list[str], limit: int = 6) -> str:
    return "[" + ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") + "]"
