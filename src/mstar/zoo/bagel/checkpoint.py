"""BAGEL checkpoints: the published layout, random ones in it, and loading either.

The published checkpoint (``ByteDance-Seed/BAGEL-7B-MoT``) is a directory::

    checkpoint/
      llm_config.json    Qwen2 config (hidden_size, num_hidden_layers, ...)
      vit_config.json    SigLIP config (num_hidden_layers counts the dropped last layer)
      ema.safetensors    language_model.*, time_embedder.*, vae2llm.*, llm2vae.*,
      latent_pos_embed.*,
                         vit_model.vision_model.*, connector.*, vit_pos_embed.*
      ae.safetensors     the FLUX autoencoder (BFL names)

plus, in a published one, Qwen2's tokenizer (``vocab.json``, ``merges.txt``,
``tokenizer_config.json``; see `mstar.zoo.bagel.tokenizer`). A random checkpoint has no
tokenizer files: its vocabulary is the toy one (bytes, the four specials on top).

`config_from_checkpoint` reads a config from the files alone: the sizes of both JSON configs,
and what only the weights say from tensor shapes in the safetensors headers (nothing is
loaded)::

    latent_patch_size      vae2llm.weight               [hidden, p * p * z_channels]
    max_latent_size        latent_pos_embed.pos_embed   [max_latent_size^2, hidden]
    vit max patches/side   vit_pos_embed.pos_embed      [side^2, hidden]  (= image_size /
    patch_size)
    timestep_frequencies   time_embedder.mlp.0.weight   [hidden, frequencies]
    VAE ch, ch_mult,       ae.safetensors' encoder.conv_in, encoder.down.{i}.block.{j},
      num_res_blocks,      decoder.conv_in [.., z_channels, 3, 3]
      z_channels

Our names (`BagelWeights.state_dict()`) are the checkpoint's but for two things: the ViT sits
at ``vit_model.*`` (transformers' `SiglipVisionModel` has no ``vision_model`` level), and its
patch embedding is a conv ``[hidden, 3, p, p]`` where the checkpoint keeps upstream's linear
``[hidden, p * p * 3]`` over (row, col, channel).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mstar.engines.layers import WeightSlice
from mstar.engines.parallel import current_shard
from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.bagel.checkpoint_files import (
    NORM_GROUPS_KEY,
    llm_config_of,
    read_header,
    read_json,
    shape_of,
    side_of,
    vae_config_of,
    vit_config_of,
)
from mstar.zoo.bagel.config import BagelConfig, ImageSizing, SpecialTokens, toy_tokens
from mstar.zoo.bagel.llm import sincos_2d
from mstar.zoo.bagel.tokenizer import TOKEN_NAMES, has_tokenizer, load_tokenizer, special_tokens_of
from mstar.zoo.bagel.vae import FluxVAE, bfl_vae_shapes
from mstar.zoo.bagel.weights import BagelWeights
from mstar.zoo.cache import mstar_cache_dir, written_once
from mstar.zoo.hf_checkpoint import copy_slice

__all__ = [
    "cached_random_checkpoint",
    "check_checkpoint",
    "check_tokens",
    "config_from_checkpoint",
    "from_checkpoint_name",
    "LLM_PARTS",
    "PARTS",
    "VIT_PARTS",
    "load_bagel",
    "make_random_checkpoint",
    "to_checkpoint_name",
]

log = structlog.get_logger(__name__)

EMA_FILE, AE_FILE = "ema.safetensors", "ae.safetensors"
LLM_CONFIG, VIT_CONFIG = "llm_config.json", "vit_config.json"
_PATCH = "vit_model.embeddings.patch_embedding.weight"
_RANDOM_FORMAT = 2  # bump when the random weights change
# Upstream's serving sizes (app.py: ImageTransform(1024, 512, 16) and (980, 224, 14); inferencer.py:
# 1024 x 1024 images, 1024 text tokens), capped to what a checkpoint's position tables cover.
_IMAGE_SIDE, _VAE_MIN, _VIT_MAX, _VIT_MIN, _MAX_TEXT_TOKENS = 1024, 512, 980, 224, 1024


def to_checkpoint_name(name: str) -> str:
    """Return the checkpoint's name of one of ours."""
    return (
        "vit_model.vision_model." + name.removeprefix("vit_model.")
        if name.startswith("vit_model.")
        else name
    )


def from_checkpoint_name(name: str) -> str:
    """Return our name of a checkpoint tensor."""
    prefix = "vit_model.vision_model."
    return "vit_model." + name.removeprefix(prefix) if name.startswith(prefix) else name


def _checkpoint_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if name == _PATCH:
        return (shape[0], shape[1] * shape[2] * shape[3])
    return shape


def _from_checkpoint_tensor(
    name: str, tensor: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
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
        **({"torch_dtype": llm.torch_dtype} if llm.torch_dtype is not None else {}),
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
        "layer_norm_eps": vit.layer_norm_eps,
    }


def config_from_checkpoint(path: str | Path) -> BagelConfig:
    """Read a BAGEL config from a checkpoint directory in the published layout, named after it.

    Sizes come from ``llm_config.json`` (Qwen2's keys) and ``vit_config.json`` (SigLIP's; its
    ``num_hidden_layers`` counts the layer upstream drops), what only the weights say from the
    safetensors headers (see the module's table). The four special tokens are the tokenizer's
    ids where the directory ships one, else the toy vocabulary's. Serving sizes are upstream's
    (1024 px images, ``ImageTransform(1024, 512, 16)`` / ``(980, 224, 14)``), capped to what
    the position tables cover. Every tensor is then checked against the config.

    Raises:
        CheckpointError: A file or a field is missing, malformed, or disagrees with another
            (the message names the file and the field or tensor).
    """
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"BAGEL checkpoint directory {str(directory)!r} does not exist")
    llm_raw, vit_raw = read_json(directory, LLM_CONFIG), read_json(directory, VIT_CONFIG)
    for filename in (EMA_FILE, AE_FILE):
        if not (directory / filename).is_file():
            raise CheckpointError(f"BAGEL checkpoint {str(directory)!r} has no {filename}")
    ema_path, ae_path = directory / EMA_FILE, directory / AE_FILE
    ema, _ = read_header(ema_path)
    ae, ae_metadata = read_header(ae_path)
    llm = llm_config_of(llm_raw, directory / LLM_CONFIG)
    vit = vit_config_of(vit_raw, directory / VIT_CONFIG, ema, ema_path)
    vae = vae_config_of(ae, ae_metadata, ae_path)
    token_width = shape_of(ema, "vae2llm.weight", ema_path, 2)[1]
    patch = math.isqrt(token_width // vae.z_channels)
    if patch < 1 or patch * patch * vae.z_channels != token_width:
        raise CheckpointError(
            f"{ema_path}: vae2llm.weight takes latent tokens of {token_width} values, not p "
            f"* p * {vae.z_channels} "
            f"(ae.safetensors' z_channels) for any latent_patch_size p"
        )
    max_latent = side_of(ema, "latent_pos_embed.pos_embed", ema_path)
    down = vae.downsample * patch
    side = min(_IMAGE_SIDE // down * down, max_latent * down)
    vit_max = min(_VIT_MAX // vit.patch_size * vit.patch_size, vit.image_size)
    try:
        config = BagelConfig(
            name=directory.resolve().name,
            llm=llm,
            vit=vit,
            vae=vae,
            tokens=_tokens(directory, llm.vocab_size),
            latent_patch_size=patch,
            max_latent_size=max_latent,
            image_size=(side, side),
            vae_image=ImageSizing(side, _min_side(_VAE_MIN, side, down), down),
            vit_image=ImageSizing(
                vit_max, _min_side(_VIT_MIN, vit_max, vit.patch_size), vit.patch_size
            ),
            timestep_frequencies=shape_of(ema, "time_embedder.mlp.0.weight", ema_path, 2)[1],
            max_text_tokens=min(_MAX_TEXT_TOKENS, llm.max_position // 2),
        )
    except UnsupportedModelError as exc:
        raise CheckpointError(f"BAGEL checkpoint {str(directory)!r}: {exc}") from None
    # every tensor of ema.safetensors at the shape the config gives it
    _check_files(directory, config)
    return config


def _min_side(upstream: int, max_side: int, stride: int) -> int:
    """Upstream's shortest side, but at most half the longest (in strides, at least one)."""
    return min(upstream, max(stride, max_side // 2 // stride * stride))


def _tokens(directory: Path, vocab_size: int) -> SpecialTokens:
    """The tokenizer's ids of the four tokens, or the toy vocabulary's where there is no
    tokenizer."""
    if not has_tokenizer(directory):
        if vocab_size < 256 + 4:
            raise CheckpointError(
                f"BAGEL checkpoint {str(directory)!r} has no tokenizer (vocab.json + "
                "merges.txt, or tokenizer.json), and "
                f"{LLM_CONFIG}'s vocab_size {vocab_size} is too small for the toy byte "
                "vocabulary (256 bytes + 4 specials)"
            )
        return toy_tokens(vocab_size)
    tokens = special_tokens_of(load_tokenizer(directory))
    check_tokens(directory, tokens, vocab_size)
    return tokens


def check_tokens(directory: Path, tokens: SpecialTokens, vocab_size: int) -> None:
    """Check that a tokenizer's special ids fall inside the model's vocabulary.

    Raises:
        CheckpointError: One does not.
    """
    for name, token_id in zip(TOKEN_NAMES, _token_ids(tokens), strict=True):
        if not 0 <= token_id < vocab_size:
            raise CheckpointError(
                f"BAGEL checkpoint {str(directory)!r}: the tokenizer's {name} is id {token_id}, "
                f"outside {LLM_CONFIG}'s vocab_size {vocab_size}"
            )


def _token_ids(tokens: SpecialTokens) -> tuple[int, int, int, int]:
    return tokens.bos, tokens.eos, tokens.start_of_image, tokens.end_of_image


def _check_json(
    directory: Path, filename: str, want: Mapping[str, Any], config: BagelConfig
) -> None:
    path = directory / filename
    found = read_json(directory, filename)
    for key, value in want.items():
        if key in ("architectures", "model_type", "hidden_act", "tie_word_embeddings"):
            continue
        if key in found and found[key] != value:
            raise CheckpointError(
                f"{path}: {key} is {found[key]!r} but config {config.name!r} has {value!r} "
                "(wrong config for this checkpoint?)"
            )


def check_checkpoint(checkpoint_dir: str | Path, config: BagelConfig) -> None:
    """Check a checkpoint directory against ``config`` without loading a weight.

    Both JSON configs must agree with it, and ``ema.safetensors`` must hold exactly its tensors
    at its shapes (``ae.safetensors`` is checked as it loads).

    Raises:
        CheckpointError: A file is missing or disagrees with ``config`` (the message names the
            file, and the field or the tensors).
    """
    _check_files(Path(checkpoint_dir), config)


def _check_files(
    directory: Path, config: BagelConfig
) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, tuple[int, ...]]]:
    """Check the directory; return ``ema.safetensors``' tensors (ours -> the checkpoint's name,
    shape) and our shapes."""
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
    found = {
        from_checkpoint_name(name): (name, shape) for name, shape in read_header(ema)[0].items()
    }
    missing = sorted(to_checkpoint_name(n) for n in expected if n not in found)
    unexpected = sorted(ckpt for mine, (ckpt, _) in found.items() if mine not in expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{ema} does not match config {config.name!r}: missing {len(missing)} tensors "
            f"{_some(missing)}, "
            f"unexpected {len(unexpected)} {_some(unexpected)} (wrong config, or not a BAGEL "
            "checkpoint?)"
        )
    wrong = [
        f"{ckpt} has shape {list(shape)}, the config expects "
        f"{list(_checkpoint_shape(mine, expected[mine]))}"
        for mine, (ckpt, shape) in found.items()
        if shape != _checkpoint_shape(mine, expected[mine])
    ]
    if wrong:
        raise CheckpointError(f"{ema} does not fit config {config.name!r}: " + "; ".join(wrong[:6]))
    return found, expected


LLM_PARTS = ("language_model", "time_embedder", "vae2llm", "llm2vae", "latent_pos_embed")
"""The modules of `BagelWeights` the LLM's nodes read."""
VIT_PARTS = ("vit_model", "connector", "vit_pos_embed")
"""The modules of `BagelWeights` the ViT node reads."""
PARTS = (*LLM_PARTS, *VIT_PARTS, "vae")
"""What `load_bagel` can load apart: the modules of ``ema.safetensors``, and the VAE."""


def load_bagel(
    checkpoint_dir: str | Path,
    config: BagelConfig,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    parts: Iterable[str] | None = None,
    into: tuple[BagelWeights, FluxVAE] | None = None,
) -> tuple[BagelWeights, FluxVAE]:
    """Load a checkpoint directory: `BagelWeights` from ``ema.safetensors``, the VAE from
    ``ae.safetensors``.

    Both JSON configs, every name and every shape are checked before weights are allocated.
    Only ``parts`` (default: all of `PARTS`) are read; the others stay on the meta device.
    ``into`` is a pair an earlier call returned: the parts it lacks are added to it. Under
    `mstar.engines.parallel.sharded` the language model is that shard, read from its slices of
    the checkpoint's tensors (`Qwen2MoTForCausalLM.shard_slices`).

    Raises:
        CheckpointError: A file is missing or disagrees with ``config``; tensors are missing,
            unexpected or misshapen.
    """
    directory = Path(checkpoint_dir)
    wanted = set(PARTS if parts is None else parts)
    if unknown := sorted(wanted - set(PARTS)):
        raise ValueError(f"BAGEL has no weights {unknown}; its parts are {', '.join(PARTS)}")
    found, expected = _check_files(directory, config)
    if into is None:
        with torch.device("meta"):
            weights, vae = BagelWeights(config).to(dtype=dtype), FluxVAE(config.vae).to(dtype=dtype)
    else:
        weights, vae = into
    todo = [
        p for p in PARTS if p in wanted and _on_meta(vae if p == "vae" else getattr(weights, p))
    ]
    from_ema = [p for p in todo if p != "vae"]
    shares = _shard_llm(weights, wanted, dtype)
    for part in from_ema:
        getattr(weights, part).to_empty(device=device)
    if "vit_model" in from_ema:
        _reset_buffers(weights)
    targets = weights.state_dict(keep_vars=True)
    with torch.no_grad(), safe_open(str(directory / EMA_FILE), framework="pt") as f:
        for mine, (ckpt, _) in found.items():
            if mine.split(".", 1)[0] not in from_ema:
                continue
            share = shares.get(mine)
            if share is None:
                targets[mine].copy_(
                    _from_checkpoint_tensor(mine, f.get_tensor(ckpt), expected[mine])
                )
                continue
            targets[mine].zero_()  # padding (the vocabulary's last rows) and zero shares
            if not share.zero:
                copy_slice(f.get_slice(ckpt), ckpt, share, targets[mine])
    if "vae" in todo:
        vae.to_empty(device=device)
        with safe_open(str(directory / AE_FILE), framework="pt") as f:
            vae.load_bfl({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return weights.eval().requires_grad_(False), vae.eval().requires_grad_(False)


def _shard_llm(
    weights: BagelWeights, parts: set[str], dtype: torch.dtype
) -> dict[str, WeightSlice]:
    """Under `sharded` (a tensor-parallel rank loading the LLM), keep the language model's shard
    only (still on meta, before anything is read); return each sharded tensor's share, by our
    name.

    Raises:
        CheckpointError: The language model is loaded here already, as another shard.
    """
    shard = current_shard()
    llm = weights.language_model
    if shard is None or "language_model" not in parts:
        return {}
    if not _on_meta(llm):
        if llm.shard != shard:
            raise CheckpointError("BAGEL's language model is loaded here already, as another shard")
        return {}
    shares = {f"language_model.{k}": v for k, v in llm.shard_slices(shard).items()}
    llm.shard_(shard)
    return shares


def _on_meta(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _reset_buffers(weights: BagelWeights) -> None:
    """Refill the non-persistent buffers that `to_empty` left uninitialised (the ViT's position
    ids)."""
    persistent = set(weights.state_dict())
    transient = {name for name, _ in weights.named_buffers() if name not in persistent}
    # a new one needs a value here
    assert transient <= {"vit_model.embeddings.position_ids"}, transient
    ids = weights.vit_model.embeddings.position_ids
    ids.copy_(torch.arange(ids.shape[-1], device=ids.device).expand_as(ids))


def random_tensors(
    config: BagelConfig, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
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
        elif "norm" in name.rsplit(".", 2)[-2] or name.endswith(
            ("layer_norm1.weight", "layer_norm2.weight")
        ):
            tensor = (
                1.0 + 0.1 * torch.randn(shape, generator=generator)
                if name.endswith("weight")
                else 0.02 * torch.randn(shape, generator=generator)
            )
        elif len(shape) == 1:
            tensor = 0.02 * torch.randn(shape, generator=generator)
        else:
            fan_in = shape[1] if len(shape) == 2 else int(torch.tensor(shape[1:]).prod())
            std = (
                1.0 if "embed" in name and len(shape) == 2 and "patch" not in name else fan_in**-0.5
            )
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
    """Write seeded random weights in the published layout (both JSON configs, both files); return
    the directory."""
    directory = Path(directory)
    ema, ae = random_tensors(config, seed)
    _write(
        directory / LLM_CONFIG,
        lambda p: p.write_text(json.dumps(llm_config_json(config), indent=2)),
    )
    _write(
        directory / VIT_CONFIG,
        lambda p: p.write_text(json.dumps(vit_config_json(config), indent=2)),
    )
    ae_metadata = {"format": "pt"}
    if config.vae.norm_groups != 32:
        ae_metadata[NORM_GROUPS_KEY] = str(config.vae.norm_groups)
    _write(directory / AE_FILE, lambda p: save_file(ae, str(p), metadata=ae_metadata))
    _write(directory / EMA_FILE, lambda p: save_file(ema, str(p), metadata={"format": "pt"}))
    return directory


def cached_random_checkpoint(config: BagelConfig, seed: int = 0) -> Path:
    """Return a random checkpoint of ``config`` under the mstar cache, writing it once (small
    configs)."""
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
