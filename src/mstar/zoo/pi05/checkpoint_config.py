"""A pi0.5 config read from a checkpoint's own files: ``config.json``, then the tensors' shapes.

``mstar serve PATH`` builds ``Pi05Model(config=None, checkpoint=PATH)``, which calls
`config_from_checkpoint`. Each size comes from the first source that has it; tensors are read
from the safetensors headers only (no weight is loaded)::

    field                 config.json (openpi's / LeRobot's / ours)         else
    vocab_size            -                                                 embed_tokens (lm_head)
    rows
    vision                vision_config {num_heads} (or HF's                patch and position
    embeddings,
                          num_attention_heads, layer_norm_eps);             layers counted, fc1; the
                          heads
                          image_resolution is checked                       of a known tower
                          (So400m/14)
    vlm, expert           paligemma_variant, action_expert_variant;         widths, depths, MLPs;
    heads
                          paligemma_config / action_expert_config           from a known variant or
                          the
                          {num_heads, num_kv_heads, head_dim}               one of them given
    action_dim            action_dim, max_action_dim                        action_in_proj's columns
    action_horizon        action_horizon, chunk_size                        the robot's openpi
    horizon
    num_steps             num_inference_steps, num_steps                    10
    max_token_len         max_token_len, tokenizer_max_length               200 (openpi's for pi05)
    cameras               LeRobot's VISUAL input_features + empty_cameras   openpi's three slots
    robot                 robot= ; the assets/ folders ; LeRobot's action   "droid"
                          feature width (8 DROID, 7 LIBERO, 14 ALOHA)
    discrete_state_input  discrete_state_input; LeRobot always bins         the robot's openpi
    config
    prompt_state_dim      LeRobot: max_state_dim (it pads before binning)   None (openpi)

A size that neither gives is a `CheckpointError` naming the file and the key to add.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from mstar.errors import CheckpointError
from mstar.zoo.hf_checkpoint import read_json_object, safetensors_files
from mstar.zoo.pi05.checkpoint import from_checkpoint_names, to_checkpoint_names
from mstar.zoo.pi05.config import (
    GEMMA_VARIANTS,
    GemmaConfig,
    Pi05Config,
    VisionConfig,
    known_vision_heads,
)
from mstar.zoo.pi05.norm_stats import asset_ids
from mstar.zoo.pi05.robots import OPENPI_CAMERAS, ROBOT_LAYOUTS, get_robot_layout

__all__ = [
    "CHECKPOINT_DTYPES",
    "checkpoint_dtype_name",
    "config_from_checkpoint",
    "infer_robot",
    "is_lerobot_config",
]

CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# Robots by LeRobot's action feature width (the dataset's, before padding to max_action_dim).
_ROBOT_BY_ACTION_WIDTH = {layout.action_dim: name for name, layout in ROBOT_LAYOUTS.items()}
_IMAGE_FEATURE_PREFIX = "observation.images."
_DEFAULT_MAX_TOKEN_LEN = 200  # openpi's Pi0Config for pi05
_DEFAULT_NUM_STEPS = 10
_LEROBOT_MAX_STATE_DIM = 32


def is_lerobot_config(found: Mapping[str, Any]) -> bool:
    """Whether a config.json is LeRobot's (``"type": "pi05"``) rather than openpi's conversion's."""
    return found.get("type") == "pi05"


def config_from_checkpoint(
    path: str | Path, *, robot: str | None = None, name: str | None = None
) -> Pi05Config:
    """Read a pi0.5 config from a checkpoint directory (see the module doc for each field's
    sources).

    Args:
        path: The checkpoint directory (``model.safetensors``, optionally ``config.json``).
        robot: The robot the model serves; by default inferred (`infer_robot`).
        name: The config's name; by default the directory's.

    Raises:
        CheckpointError: The directory has no weights, a size is in neither ``config.json`` nor
            the tensors (the message names the file and the key), or the two disagree.
        UnsupportedModelError: The robot is unknown, or the sizes make no pi0.5 model.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"pi0.5 checkpoint directory {str(directory)!r} does not exist")
    config_file = directory / "config.json"
    found = read_json_object(config_file) if config_file.is_file() else {}
    if found.get("pi05") is False:
        raise CheckpointError(
            f"{str(config_file)!r} has pi05=false: a pi0 checkpoint, which mstar does not serve"
        )
    sizes = _Sizes(found, config_file, _tensor_shapes(directory), directory)
    layout = get_robot_layout(robot if robot is not None else infer_robot(directory, found))
    lerobot = is_lerobot_config(found)
    vlm, expert = sizes.gemmas()
    action_dim = sizes.action_dim()
    if layout.action_dim > action_dim:
        raise CheckpointError(
            f"pi0.5 checkpoint {str(directory)!r} has actions of {action_dim} dims, fewer than the "
            f"{layout.action_dim} {layout.label} needs"
        )
    vision = sizes.vision()
    horizon = sizes.int_key("action_horizon", "chunk_size", default=layout.action_horizon)
    cameras = sizes.cameras()
    max_token_len = sizes.int_key(
        "max_token_len", "tokenizer_max_length", default=_DEFAULT_MAX_TOKEN_LEN
    )
    discrete = found.get("discrete_state_input")
    if discrete is not None and not isinstance(discrete, bool):
        raise sizes.error("discrete_state_input", f"must be true or false, got {discrete!r}")
    prefix_len = len(cameras) * vision.num_patches + max_token_len
    extra: dict[str, str] = {
        key: str(found[key])
        for key in ("paligemma_variant", "action_expert_variant")
        if key in found
    }
    return Pi05Config(
        name=name or directory.resolve().name,
        vision=vision,
        vlm=vlm,
        expert=expert,
        vocab_size=sizes.vocab_size(),
        action_dim=action_dim,
        action_horizon=horizon,
        num_steps=sizes.int_key("num_inference_steps", "num_steps", default=_DEFAULT_NUM_STEPS),
        max_token_len=max_token_len,
        cameras=cameras,
        robot_dof=layout.action_dim,
        robot=layout.name,
        discrete_state_input=discrete
        if discrete is not None
        else (lerobot or layout.discrete_state_input),
        prompt_state_dim=sizes.int_key("max_state_dim", default=_LEROBOT_MAX_STATE_DIM)
        if lerobot
        else None,
        min_period=sizes.float_key("min_period", default=4e-3),
        max_period=sizes.float_key("max_period", default=4.0),
        max_position=max(2048, prefix_len + horizon),
        extra=extra,
    )


def infer_robot(checkpoint_dir: str | Path, found: Mapping[str, Any]) -> str:
    """Return the robot a checkpoint was trained for, else "droid".

    openpi names it in its ``assets/`` folders (``droid``, ``physical-intelligence/libero``,
    ``trossen``); LeRobot in its action feature's width (8 DROID, 7 LIBERO, 14 ALOHA).
    """
    robots = {
        robot for robot in map(_robot_of_asset, asset_ids(checkpoint_dir)) if robot is not None
    }
    if len(robots) == 1:
        return robots.pop()
    features = found.get("output_features")
    action = features.get("action") if isinstance(features, Mapping) else None
    shape = action.get("shape") if isinstance(action, Mapping) else None
    if isinstance(shape, list) and len(shape) == 1 and shape[0] in _ROBOT_BY_ACTION_WIDTH:
        return _ROBOT_BY_ACTION_WIDTH[shape[0]]
    return "droid"


def _robot_of_asset(asset_id: str) -> str | None:
    name = asset_id.lower()
    if "libero" in name:
        return "libero"
    if "trossen" in name or "aloha" in name:
        return "aloha"
    if "droid" in name:
        return "droid"
    return None


def checkpoint_dtype_name(path: str | Path) -> str:
    """Return the dtype a checkpoint's weights are in: config.json's
    ``torch_dtype``/``dtype``/``precision``, else the tensors'.

    Raises:
        CheckpointError: The dtype is not one mstar runs pi0.5 in.
    """
    directory = Path(path)
    config_file = directory / "config.json"
    found = read_json_object(config_file) if config_file.is_file() else {}
    for key in ("torch_dtype", "dtype", "precision"):
        if key in found:
            if found[key] not in CHECKPOINT_DTYPES:
                raise CheckpointError(
                    f"{str(config_file)!r} has {key}={found[key]!r}; pi0.5 runs in "
                    f"{', '.join(CHECKPOINT_DTYPES)}"
                )
            return str(found[key])
    files = safetensors_files(directory)
    probe = next(iter(to_checkpoint_names({"action_in_proj.weight": None})))
    name = probe if probe in files else next(iter(files))
    with safe_open(str(files[name]), framework="pt") as f:
        stored = f.get_slice(name).get_dtype()
    if stored not in _SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{str(files[name])!r} stores {name} as {stored}; pi0.5 runs in "
            f"{', '.join(CHECKPOINT_DTYPES)}"
        )
    return _SAFETENSORS_DTYPES[stored]


def _tensor_shapes(directory: Path) -> dict[str, list[int]]:
    """Return every tensor's shape under our names (`from_checkpoint_names`), from the headers."""
    files = safetensors_files(directory)
    shapes: dict[str, list[int]] = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                shapes[name] = list(f.get_slice(name).get_shape())
    return from_checkpoint_names(shapes)


class _Sizes:
    """The sizes a checkpoint's config.json and tensor shapes give, with errors naming where to add
    one."""

    def __init__(
        self,
        found: Mapping[str, Any],
        config_file: Path,
        shapes: Mapping[str, list[int]],
        directory: Path,
    ) -> None:
        self.found = found
        self.config_file = config_file
        self.shapes = shapes
        self.weights = directory / "model.safetensors"

    # -- config.json ------------------------------------------------------------------------

    def error(self, key: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{str(self.config_file)!r}: {key} {problem}")

    def int_key(self, *keys: str, default: int | None = None, within: str | None = None) -> int:
        """Return the first of ``keys`` config.json has (in its ``within`` block, if given), else
        ``default``."""
        block = self.block(within) if within is not None else self.found
        for key in keys:
            if key in block:
                value = block[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise self.error(
                        f"{within}.{key}" if within else key,
                        f"must be a positive integer, got {value!r}",
                    )
                return value
        if default is None:
            raise self.error(f"{within}.{keys[0]}" if within else keys[0], "is missing")
        return default

    def float_key(self, key: str, *, default: float) -> float:
        value = self.found.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise self.error(key, f"must be a positive number, got {value!r}")
        return float(value)

    def block(self, key: str) -> Mapping[str, Any]:
        value = self.found.get(key, {})
        if not isinstance(value, Mapping):
            raise self.error(key, f"must be an object, got {type(value).__name__}")
        return value

    def optional_int(self, within: str, *keys: str) -> int | None:
        block = self.block(within)
        return self.int_key(*keys, within=within) if any(k in block for k in keys) else None

    # -- tensors ----------------------------------------------------------------------------

    def shape(self, ours: str) -> list[int]:
        if ours not in self.shapes:
            theirs = next(iter(to_checkpoint_names({ours: None})))
            raise CheckpointError(
                f"{str(self.weights)!r} has no tensor {theirs} (not a pi0.5 checkpoint?)"
            )
        return self.shapes[ours]

    def num_layers(self, prefix: str) -> int:
        pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
        indices = {int(m.group(1)) for name in self.shapes if (m := pattern.match(name))}
        if not indices or indices != set(range(len(indices))):
            theirs = next(iter(to_checkpoint_names({prefix: None})))
            raise CheckpointError(
                f"{str(self.weights)!r} has layers {sorted(indices)} under {theirs}, not 0..n-1"
            )
        return len(indices)

    # -- the parts --------------------------------------------------------------------------

    def vocab_size(self) -> int:
        return self.shape("language_model.embed_tokens.weight")[0]

    def action_dim(self) -> int:
        action_dim = self.shape("action_in_proj.weight")[1]
        for key in ("action_dim", "max_action_dim"):
            if key in self.found and self.found[key] != action_dim:
                raise self.error(
                    key, f"is {self.found[key]!r}, but action_in_proj takes {action_dim} dims"
                )
        return action_dim

    def vision(self) -> VisionConfig:
        width, _, patch, _ = self.shape("vision_tower.embeddings.patch_embedding.weight")
        num_patches = self.shape("vision_tower.embeddings.position_embedding.weight")[0]
        side = math.isqrt(num_patches)
        if side * side != num_patches:
            raise CheckpointError(
                f"{str(self.weights)!r}: SigLIP has {num_patches} positions, not a square grid"
            )
        image_size = side * patch
        resolution = self.found.get("image_resolution")
        if resolution is not None and list(resolution) != [image_size, image_size]:
            raise self.error(
                "image_resolution",
                f"is {resolution!r}, but SigLIP's positions cover {image_size}x{image_size}",
            )
        depth = self.num_layers("vision_tower.encoder.layers.")
        mlp_dim = self.shape("vision_tower.encoder.layers.0.mlp.fc1.weight")[0]
        heads = self.optional_int("vision_config", "num_heads", "num_attention_heads")
        if heads is None:
            heads = known_vision_heads(width, depth, mlp_dim)
        if heads is None:
            raise self.error(
                "vision_config.num_heads",
                f"is missing: the SigLIP tower (width {width}, {depth} layers, MLP "
                f"{mlp_dim}) is no known one, "
                "and its head count is in no tensor's shape",
            )
        eps = self.block("vision_config").get("layer_norm_eps", 1e-6)
        return VisionConfig(
            image_size=image_size,
            patch_size=patch,
            width=width,
            depth=depth,
            mlp_dim=mlp_dim,
            num_heads=heads,
            layer_norm_eps=float(eps),
        )

    def gemmas(self) -> tuple[GemmaConfig, GemmaConfig]:
        """Return the VLM and the action expert; their attention geometry is shared."""
        parts = (
            ("language_model.", "paligemma_variant", "paligemma_config"),
            ("gemma_expert.", "action_expert_variant", "action_expert_config"),
        )
        q_features = self.shape("language_model.layers.0.self_attn.q_proj.weight")[0]
        kv_features = self.shape("language_model.layers.0.self_attn.k_proj.weight")[0]
        if [q_features, kv_features] != [
            self.shape("gemma_expert.layers.0.self_attn.q_proj.weight")[0],
            self.shape("gemma_expert.layers.0.self_attn.k_proj.weight")[0],
        ]:
            raise CheckpointError(
                f"{str(self.weights)!r}: the VLM's and the action expert's attention differ "
                "in shape"
            )
        given: dict[str, tuple[int, str]] = {}  # field -> (value, where it came from)
        for _, variant_key, block_key in parts:
            for field, keys in (
                ("num_heads", ("num_heads", "num_attention_heads")),
                ("num_kv_heads", ("num_kv_heads", "num_key_value_heads")),
                ("head_dim", ("head_dim",)),
            ):
                value = self.optional_int(block_key, *keys)
                if value is not None:
                    given.setdefault(field, (value, f"{block_key}.{keys[0]}"))
            known = self._variant(variant_key)
            if known is not None:
                for field in ("num_heads", "num_kv_heads", "head_dim"):
                    given.setdefault(
                        field, (getattr(known, field), f"{variant_key} {self.found[variant_key]!r}")
                    )
        heads, kv_heads, head_dim = self._attention(q_features, kv_features, given)
        out = []
        for prefix, variant_key, _ in parts:
            width = self.shape(f"{prefix}layers.0.mlp.gate_proj.weight")[1]
            gemma = GemmaConfig(
                width=width,
                depth=self.num_layers(f"{prefix}layers."),
                mlp_dim=self.shape(f"{prefix}layers.0.mlp.gate_proj.weight")[0],
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
            )
            known = self._variant(variant_key)
            if known is not None and known != gemma:
                raise self.error(
                    variant_key,
                    f"is {self.found[variant_key]!r} ({known}), but the tensors have {gemma}",
                )
            out.append(gemma)
        return out[0], out[1]

    def _variant(self, key: str) -> GemmaConfig | None:
        name = self.found.get(key)
        # LoRA keeps the sizes
        return GEMMA_VARIANTS.get(str(name).removesuffix("_lora")) if name is not None else None

    def _attention(
        self, q_features: int, kv_features: int, given: Mapping[str, tuple[int, str]]
    ) -> tuple[int, int, int]:
        """Return (heads, KV heads, head size) from the projections' widths and any one of them
        given."""
        if "head_dim" in given:
            head_dim = given["head_dim"][0]
        elif "num_heads" in given:
            head_dim = q_features // given["num_heads"][0]
        elif "num_kv_heads" in given:
            head_dim = kv_features // given["num_kv_heads"][0]
        else:
            raise self.error(
                "paligemma_config.head_dim",
                "is missing (and no known paligemma_variant or action_expert_variant gives "
                "it): the queries' "
                f"{q_features} and the keys' {kv_features} features do not tell heads from "
                "head size",
            )
        if head_dim < 1 or q_features % head_dim or kv_features % head_dim:
            raise CheckpointError(
                f"{str(self.config_file)!r}: head size {head_dim} does not divide the "
                f"projections ({q_features} query, {kv_features} key features)"
            )
        resolved = {
            "num_heads": q_features // head_dim,
            "num_kv_heads": kv_features // head_dim,
            "head_dim": head_dim,
        }
        for field, (value, where) in given.items():
            if resolved[field] != value:
                raise CheckpointError(
                    f"{str(self.config_file)!r}: {where} gives {field} {value}, but the "
                    f"tensors give {resolved[field]}"
                )
        return resolved["num_heads"], resolved["num_kv_heads"], head_dim

    def cameras(self) -> tuple[str, ...]:
        features = self.found.get("input_features")
        if not isinstance(features, Mapping):
            return OPENPI_CAMERAS
        names = [
            key.removeprefix(_IMAGE_FEATURE_PREFIX)
            for key, feature in features.items()
            if isinstance(feature, Mapping) and feature.get("type") == "VISUAL"
        ]
        empty = self.found.get("empty_cameras", 0)
        if isinstance(empty, bool) or not isinstance(empty, int) or empty < 0:
            raise self.error("empty_cameras", f"must be a count, got {empty!r}")
        names += [f"empty_camera_{i}" for i in range(empty) if f"empty_camera_{i}" not in names]
        return tuple(names) if names else OPENPI_CAMERAS
