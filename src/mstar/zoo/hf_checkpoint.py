"""Hugging Face checkpoint directories: `config.json` plus safetensors, sharded or not.

```
checkpoint/
  config.json
  model.safetensors                       (one file)
  -- or --
  model.safetensors.index.json            {"weight_map": {"tensor name": "shard file"}}
  model-00001-of-00002.safetensors ...
```

Big checkpoints are loaded lazily: build the module with `parameters_on_meta`, read only the
tensors a part needs through a `ShardReader` (each shard opened when first read, its mapping
released every ``window_bytes``), and put each one in place with `replace_parameter`.
"""

from __future__ import annotations

import contextlib
import json
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.engines.layers import WeightSlice
from mstar.engines.sampling_params import SamplingParams
from mstar.errors import CheckpointError, InvalidSamplingParamsError

__all__ = [
    "DTYPES",
    "GENERATION_DEFAULT_KEYS",
    "SafetensorsEntry",
    "ShardReader",
    "checkpoint_dtype",
    "checkpoint_nbytes",
    "load_generation_defaults",
    "load_hf_config",
    "load_into_module",
    "load_state_dict",
    "parameters_on_meta",
    "read_json_object",
    "read_safetensors_header",
    "replace_parameter",
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
    """Return the dtype a config dict names (``torch_dtype``, or transformers 5's ``dtype``), else
    float32.

    Raises:
        CheckpointError: The config names a dtype mstar does not run.
    """
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    if name not in DTYPES:
        raise CheckpointError(
            f"the checkpoint's torch_dtype is {name!r}; mstar runs {', '.join(DTYPES)}"
        )
    return str(name)


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
"""The sampling settings a checkpoint's `generation_config.json` gives requests that leave them
unset."""


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
    slices: Mapping[str, WeightSlice] | None = None,
) -> None:
    """Copy a checkpoint's tensors into `module`'s parameters and persistent buffers.

    Every parameter must be found, with the right shape, and every checkpoint tensor must
    be used; dtypes are converted to the module's.

    Args:
        module: the target; its `state_dict()` names are the checkpoint names.
        checkpoint_dir: a Hugging Face checkpoint directory.
        ignore: checkpoint tensors to skip (e.g. a tied `lm_head.weight`).
        optional: module tensors the checkpoint may lack (they keep their values).
        slices: the part of a tensor to read, by name (a tensor-parallel rank's shard, read
            from the file's slice: the whole tensor is never loaded).
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
                    part = (slices or {}).get(name)
                    if part is not None:
                        _load_slice(f, name, part, target)
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise CheckpointError(
                            f"tensor {name!r} in {path.name} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(target.shape)}"
                        )
                    target.copy_(tensor)


def _load_slice(f: Any, name: str, part: WeightSlice, target: torch.Tensor) -> None:
    """Read ``part`` of checkpoint tensor ``name`` into ``target`` (zeros past its end)."""
    target.zero_()
    if part.zero:
        return
    copy_slice(f.get_slice(name), name, part, target)


def copy_slice(view: Any, name: str, part: WeightSlice, target: torch.Tensor) -> None:
    """Copy ``part`` of a safetensors slice ``view`` (``safe_open(...).get_slice(name)``) into
    ``target``, which holds the part's shape (its padding is left as it is).

    Raises:
        CheckpointError: The part does not fit the tensor or the target.
    """
    shape = list(view.get_shape())
    for src, n, dst in part.pieces(shape[part.dim]):
        index = [slice(None)] * len(shape)
        index[part.dim] = slice(src, src + n)
        tensor = view[tuple(index)]
        expected = list(target.shape)
        expected[part.dim] = n
        if list(tensor.shape) != expected:
            raise CheckpointError(
                f"tensor {name!r}: its slice has shape {tuple(tensor.shape)}, the shard expects "
                f"{tuple(expected)}"
            )
        target.narrow(part.dim, dst, n).copy_(tensor)


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


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor as a safetensors header describes it."""

    dtype: str  # the format's code: "F32", "BF16", "I64", ...
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: str | Path) -> dict[str, SafetensorsEntry]:
    """Return every tensor a safetensors file holds, reading only its header (no tensor data).

    The format: an 8-byte little-endian header length, then a JSON object mapping each tensor
    name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (and ``__metadata__``).

    Raises:
        CheckpointError: The file cannot be read or its header is not a safetensors header.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        entries = {
            name: SafetensorsEntry(
                str(info["dtype"]),
                tuple(int(d) for d in info["shape"]),
                int(info["data_offsets"][1]) - int(info["data_offsets"][0]),
            )
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(
            f"cannot read the safetensors header of {str(path)!r}: {exc}"
        ) from exc
    return entries


def checkpoint_nbytes(checkpoint_dir: str | Path) -> int:
    """Return the bytes of tensor data in a checkpoint's safetensors files (headers excluded)."""
    paths = set(safetensors_files(checkpoint_dir).values())
    return sum(e.nbytes for path in paths for e in read_safetensors_header(path).values())


class ShardReader:
    """Read chosen tensors of safetensors shards, opening each shard only when one is read.

    safetensors maps a file into memory and hands out views of the mapping; pages are read
    as a view is touched, and every page touched stays resident while the shard is open. So
    the reader closes and reopens a shard after each ``window_bytes`` read, and `copy_into`
    copies a tensor larger than that in blocks of rows, reopening between blocks: copy each
    tensor where it goes and drop any view before the next read, and at most about
    ``max(window_bytes, one row)`` of file is mapped and resident at once (a view still held
    keeps its pages).

    Attributes:
        num_bytes_read: Bytes of tensor data handed out so far.
        paths_opened: The shards opened so far.
    """

    def __init__(self, *, window_bytes: int = 64 << 20) -> None:
        self.window_bytes = window_bytes
        self.num_bytes_read = 0
        self.paths_opened: set[Path] = set()
        self._handles: dict[Path, Any] = {}
        self._mapped: dict[Path, int] = {}  # bytes read through the open handle
        self._headers: dict[Path, dict[str, SafetensorsEntry]] = {}

    def _open(self, path: Path, nbytes: int) -> Any:
        """Return the shard's handle, reopened first if reading ``nbytes`` more would pass the
        window."""
        from safetensors import safe_open

        mapped = self._mapped.get(path, 0)
        if mapped and mapped + nbytes > self.window_bytes:
            self.close(path)
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt")
            self._mapped[path] = 0
            self.paths_opened.add(path)
        return handle

    def _count(self, path: Path, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.num_bytes_read += nbytes
        self._mapped[path] += nbytes

    def get_tensor(self, path: Path, name: str) -> torch.Tensor:
        """Return tensor ``name`` of shard ``path`` (a view of its mapping; CPU, the file's
        dtype)."""
        tensor: torch.Tensor = self._open(path, self._entry(path, name).nbytes).get_tensor(name)
        self._count(path, tensor)
        return tensor

    def _entry(self, path: Path, name: str) -> SafetensorsEntry:
        header = self._headers.get(path)
        if header is None:
            header = self._headers[path] = read_safetensors_header(path)
        entry = header.get(name)
        if entry is None:
            raise CheckpointError(f"{str(path)!r} has no tensor {name!r}")
        return entry

    def copy_into(self, path: Path, name: str, out: torch.Tensor) -> None:
        """Copy tensor ``name`` of shard ``path`` into ``out`` (its shape; any dtype and device).

        Raises:
            CheckpointError: The shard has no such tensor, or it has another shape.
        """
        entry = self._entry(path, name)
        if entry.shape != tuple(out.shape):
            raise CheckpointError(
                f"tensor {name!r} in {str(path)!r} has shape {list(entry.shape)}, expected "
                f"{list(out.shape)}"
            )
        if entry.nbytes <= self.window_bytes or len(entry.shape) == 0 or entry.shape[0] < 2:
            out.copy_(self.get_tensor(path, name))
            return
        num_rows = entry.shape[0]
        row_bytes = entry.nbytes // num_rows
        step = max(1, self.window_bytes // max(1, row_bytes))
        for lo in range(0, num_rows, step):
            rows = min(step, num_rows - lo)
            block: torch.Tensor = self._open(path, rows * row_bytes).get_slice(name)[lo : lo + rows]
            out[lo : lo + step].copy_(block)
            self._count(path, block)
            del block

    def copy_slice_into(self, path: Path, name: str, part: WeightSlice, out: torch.Tensor) -> None:
        """Copy ``part`` of tensor ``name`` of shard ``path`` into ``out`` (a tensor-parallel
        rank's share: only its rows or columns are read)."""
        entry = self._entry(path, name)
        view = self._open(path, entry.nbytes).get_slice(name)
        copy_slice(view, name, part, out)
        self._count(path, out)

    def close(self, path: Path | None = None) -> None:
        """Release one shard's mapping (default: every shard's)."""
        for p in [path] if path is not None else list(self._handles):
            handle = self._handles.pop(p, None)
            self._mapped.pop(p, None)
            if handle is not None:
                handle.__exit__(None, None, None)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _MetaDepth(threading.local):
    depth = 0  # parameters_on_meta blocks open on this thread


_meta = _MetaDepth()
_meta_lock = threading.Lock()
_meta_users = 0
_register_parameter = nn.Module.register_parameter


def _register_parameter_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if param is not None and _meta.depth and not param.is_meta:
        param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    _register_parameter(self, name, param)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Register the parameters of modules built in this block, on this thread, on the meta device.

    Buffers and plain tensor attributes (rotary tables, offsets) are made as usual, where the
    block's default device puts them: they are derived data, not in the checkpoint. A
    parameter is first made where its module makes it and moved at once (on a CPU an
    untouched allocation costs no memory); other threads build modules as usual meanwhile.
    Put the weights in place with `replace_parameter`.
    """
    global _meta_users
    with _meta_lock:
        if _meta_users == 0:
            nn.Module.register_parameter = _register_parameter_on_meta  # type: ignore[method-assign]
        _meta_users += 1
    _meta.depth += 1
    try:
        yield
    finally:
        _meta.depth -= 1
        with _meta_lock:
            _meta_users -= 1
            if _meta_users == 0:
                nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign]


def replace_parameter(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Make ``value`` the parameter at dotted ``name`` of ``module`` (frozen: no gradient)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if leaf not in owner._parameters:
        raise KeyError(f"{type(module).__name__} has no parameter {name!r}")
    owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
