"""Hugging Face checkpoint directories: `config.json` plus safetensors, sharded or not.

```
checkpoint/
  config.json
  model.safetensors                       (one file)
  -- or --
  model.safetensors.index.json            {"weight_map": {"tensor name": "shard file"}}
  model-00001-of-00002.safetensors ...
```
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.engines.sampling_params import SamplingParams
from mstar.errors import CheckpointError, InvalidSamplingParamsError

__all__ = [
    "DTYPES",
    "GENERATION_DEFAULT_KEYS",
    "checkpoint_dtype",
    "load_generation_defaults",
    "load_hf_config",
    "load_into_module",
    "load_state_dict",
    "read_json_object",
    "safetensors_files",
    "save_state_dict",
]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def _directory(checkpoint_dir: str | Path) -> Path:
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    return path


def load_hf_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Read `config.json` of a checkpoint directory as a dict."""
    path = _directory(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path.parent)!r} has no config.json")
    return read_json_object(path)


def read_json_object(path: Path) -> dict[str, Any]:
    """Read a JSON file holding an object.

    Raises:
        CheckpointError: The file cannot be read, is not JSON, or holds another value.
    """
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{str(path)!r} must hold a JSON object")
    return value


DTYPES = ("float32", "bfloat16", "float16")
"""The weight dtypes a model's ``dtype`` option names (besides "auto": the checkpoint's)."""


def checkpoint_dtype(config: dict[str, Any]) -> str:
    """Return the dtype a config dict names (``torch_dtype``, or transformers 5's ``dtype``), else float32.

    Raises:
        CheckpointError: The config names a dtype mstar does not run.
    """
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    if name not in DTYPES:
        raise CheckpointError(f"the checkpoint's torch_dtype is {name!r}; mstar runs {', '.join(DTYPES)}")
    return str(name)


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
"""The sampling settings a checkpoint's `generation_config.json` gives requests that leave them unset."""


def load_generation_defaults(checkpoint_dir: str | Path) -> dict[str, float | int]:
    """Return the sampling defaults of a checkpoint's `generation_config.json` (empty without one).

    As vLLM reads them: the keys of `GENERATION_DEFAULT_KEYS` the file sets (other fields,
    ``do_sample`` among them, are not sampling defaults here).

    Raises:
        CheckpointError: The file is not a JSON object, or a value is not a valid setting.
    """
    path = _directory(checkpoint_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = read_json_object(path)
    defaults = {k: config[k] for k in GENERATION_DEFAULT_KEYS if config.get(k) is not None}
    try:
        SamplingParams(**defaults)
    except InvalidSamplingParamsError as exc:
        raise CheckpointError(f"{str(path)!r}: {exc}") from exc
    return defaults


def safetensors_files(checkpoint_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the safetensors file holding it."""
    from safetensors import safe_open

    directory = _directory(checkpoint_dir)
    index = directory / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot read the weight map of {str(index)!r}: {exc}") from exc
        files = {name: directory / shard for name, shard in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise CheckpointError(
                f"checkpoint {str(directory)!r} lacks shard files listed in {_INDEX}: {missing}"
            )
        return files
    single = directory / _SINGLE
    candidates = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not candidates:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} has no {_SINGLE}, no {_INDEX} and no *.safetensors"
        )
    files = {}
    for path in candidates:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                files[name] = path
    return files


def load_state_dict(
    checkpoint_dir: str | Path, *, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Load every tensor of a checkpoint directory."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, path in safetensors_files(checkpoint_dir).items():
        by_file.setdefault(path, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in names:
                state[name] = f.get_tensor(name)
    return state


def load_into_module(
    module: nn.Module,
    checkpoint_dir: str | Path,
    *,
    ignore: Iterable[str] = (),
    optional: Iterable[str] = (),
) -> None:
    """Copy a checkpoint's tensors into `module`'s parameters and persistent buffers.

    Every parameter must be found, with the right shape, and every checkpoint tensor must
    be used; dtypes are converted to the module's.

    Args:
        module: the target; its `state_dict()` names are the checkpoint names.
        checkpoint_dir: a Hugging Face checkpoint directory.
        ignore: checkpoint tensors to skip (e.g. a tied `lm_head.weight`).
        optional: module tensors the checkpoint may lack (they keep their values).
    """
    from safetensors import safe_open

    files = safetensors_files(checkpoint_dir)
    targets = module.state_dict(keep_vars=True)
    ignored = set(ignore)
    missing = sorted(set(targets) - set(files) - set(optional))
    unexpected = sorted(set(files) - set(targets) - ignored)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(checkpoint_dir)!r} does not match the model: "
            f"missing {len(missing)} tensors {missing[:8]}, "
            f"unexpected {len(unexpected)} tensors {unexpected[:8]}"
        )
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name in targets:
            by_file.setdefault(path, []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    target = targets[name]
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise CheckpointError(
                            f"tensor {name!r} in {path.name} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(target.shape)}"
                        )
                    target.copy_(tensor)


def save_state_dict(
    state: dict[str, torch.Tensor],
    checkpoint_dir: str | Path,
    config: dict[str, Any],
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Write `config.json` and the tensors (sharded past `max_shard_bytes`) to a directory."""
    from safetensors.torch import save_file

    directory = Path(checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state.items():
        t = t.detach().contiguous().cpu()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()  # tied weights: safetensors refuses shared storage
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    if max_shard_bytes is None:
        save_file(tensors, str(directory / _SINGLE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
