"""Qwen3-Omni checkpoints: the Hugging Face layout, random ones in it, and loading either.

A checkpoint is a directory with ``config.json`` (a `Qwen3OmniMoeConfig`) and safetensors
weights (one file, or shards with ``model.safetensors.index.json``), named as
`Qwen3OmniMoeForConditionalGeneration` saves them::

    thinker.model.*  thinker.lm_head.*  thinker.audio_tower.*  thinker.visual.*
    talker.model.*   talker.codec_head.*  talker.{text,hidden}_projection.*  talker.code_predictor.*
    code2wav.*

(our names: see `mstar.zoo.qwen3_omni.modules.weights`). MoE experts come either one tensor
per expert and projection (``...mlp.experts.{e}.{gate,up,down}_proj.weight``, the published
files) or fused (``...mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``...mlp.experts.down_proj``
``[E, H, I]``); per-expert tensors are stacked on loading, gate rows before up rows.

Loading reads only what the chosen nodes need (`NODE_WEIGHTS`), straight into parameters
allocated in the target dtype::

    make_empty_weights       every parameter on meta; rotary tables and buffers on the device
      for each shard holding a needed tensor (opened once; its mapping released as it goes):
        get_tensor(name)     a view of the memory-mapped file
        target[slice].copy_  into the parameter (in dtype, on device); the expert's slice if stacked
      replace_parameter      once all of a parameter's tensors are in
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from mstar.engines.layers import WeightSlice
from mstar.engines.parallel import current_shard
from mstar.errors import CheckpointError
from mstar.progress import progress
from mstar.zoo.hf_checkpoint import (
    ShardReader,
    load_hf_config,
    parameters_on_meta,
    read_safetensors_header,
    replace_parameter,
    safetensors_files,
)
from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig
from mstar.zoo.qwen3_omni.modules.weights import Qwen3OmniWeights, node_weight_names

__all__ = [
    "RANDOM_INIT_VERSION",
    "checkpoint_name",
    "load_qwen3_omni",
    "make_empty_weights",
    "make_random_checkpoint",
    "our_name",
]

log = structlog.get_logger(__name__)

RANDOM_INIT_VERSION = 2
"""The version of `make_random_checkpoint`'s initialisation (cached random weights are keyed on
it)."""

# (checkpoint prefix, our prefix); the first match wins.
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("thinker.audio_tower.", "audio_tower."),
    ("thinker.visual.", "visual."),
    ("thinker.model.", "thinker_text.model."),
    ("thinker.lm_head.", "thinker_text.lm_head."),
    ("talker.code_predictor.", "code_predictor."),
    ("talker.model.", "talker_text.model."),
    ("talker.codec_head.", "talker_text.codec_head."),
    ("talker.text_projection.", "text_projection."),
    ("talker.hidden_projection.", "hidden_projection."),
    ("code2wav.", "code2wav."),
)
_PER_EXPERT = re.compile(
    r"^(?P<stem>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def our_name(name: str) -> str | None:
    """Return our name for a checkpoint tensor name (None: not a Qwen3-Omni name)."""
    for ckpt, ours in _PREFIXES:
        if name.startswith(ckpt):
            return ours + name[len(ckpt) :]
    return None


def checkpoint_name(name: str) -> str:
    """Return the checkpoint name of one of our tensors (fused experts keep their fused names)."""
    for ckpt, ours in _PREFIXES:
        if name.startswith(ours):
            return ckpt + name[len(ours) :]
    raise CheckpointError(f"no Qwen3-Omni checkpoint name for {name!r}")


def _some(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"


def _plan(
    files: dict[str, Path], expected: dict[str, torch.Size]
) -> tuple[dict[str, list[str]], set[str], list[str], list[str]]:
    """Map each of our tensors to the checkpoint tensors it is made of.

    Also return which of ours are stacked from per-expert tensors, and the unknown and
    missing names.

    A fused expert tensor is made of one tensor per expert (``gate_up_proj``: each expert's
    gate then up); any other tensor of exactly one.
    """
    sources: dict[str, list[str]] = {}
    stacked: set[str] = set()
    per_expert: dict[str, dict[int, dict[str, str]]] = {}
    unknown: list[str] = []
    for name in files:
        match = _PER_EXPERT.match(name)
        if match is not None:
            stem = our_name(match["stem"])
            if stem is None:
                unknown.append(name)
                continue
            per_expert.setdefault(stem, {}).setdefault(int(match["expert"]), {})[match["proj"]] = (
                name
            )
            continue
        mine = our_name(name)
        if mine is None or mine not in expected:
            unknown.append(name)
        else:
            sources[mine] = [name]
    for stem, experts in per_expert.items():
        gate_up, down = f"{stem}.gate_up_proj", f"{stem}.down_proj"
        if gate_up not in expected:
            unknown.extend(n for e in experts.values() for n in e.values())
            continue
        count = expected[gate_up][0]
        present = [experts.get(e, {}) for e in range(count)]
        extra = [n for e, projs in experts.items() if e >= count for n in projs.values()]
        unknown.extend(extra)
        if all({"gate_proj", "up_proj", "down_proj"} <= set(p) for p in present):
            sources[gate_up] = [n for p in present for n in (p["gate_proj"], p["up_proj"])]
            sources[down] = [p["down_proj"] for p in present]
            stacked |= {gate_up, down}
    missing = [name for name in expected if name not in sources]
    return sources, stacked, unknown, missing


def make_empty_weights(
    config: Qwen3OmniConfig,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Qwen3OmniWeights:
    """Build `Qwen3OmniWeights` with every parameter on the meta device (nothing allocated).

    The derived state (rotary tables, the encoders' and Code2Wav's buffers) is made on
    ``device``, floating buffers in ``dtype``; `load_qwen3_omni` puts parameters in place.
    """
    from transformers.initialization import no_init_weights

    device = torch.device(device)
    # Built where the old full load built it, so the derived tables are computed on the same
    # device, bit for bit; only the parameters move to meta (see `parameters_on_meta`).
    with no_init_weights(), parameters_on_meta(), torch.device(device):
        weights = Qwen3OmniWeights(config)
    for module in weights.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype=dtype)
    return weights.requires_grad_(False).eval()


@dataclass
class _Target:
    """One of our parameters being filled: where each of its checkpoint tensors goes.

    ``shape`` is the parameter's, ``full_shape`` the whole model's (they differ for a
    tensor-parallel rank's share, ``part``, read from each checkpoint tensor's slice).
    """

    name: str
    shape: torch.Size
    sources: list[str]
    is_stacked: bool
    full_shape: torch.Size
    share: WeightSlice | None = None
    value: torch.Tensor | None = None
    num_left: int = 0

    def part_shape(self) -> tuple[int, ...]:
        """Return the shape of each checkpoint tensor: one expert's projection when stacked."""
        full = self.full_shape
        if not self.is_stacked:
            return tuple(full)
        rows = full[1] // 2 if self.name.endswith("gate_up_proj") else full[1]
        return (rows, full[2])

    def source_share(self) -> WeightSlice | None:
        """Return the share of each checkpoint tensor this rank reads (None: all of it)."""
        share = self.share
        if share is None or not self.is_stacked:
            return share
        # one expert's gate, up or down: the fused tensor's dims less the expert's
        return WeightSlice(share.dim - 1, share.start, share.stop, share.stop - share.start)

    def part(self, index: int) -> torch.Tensor:
        """Return the slice of ``value`` checkpoint tensor ``index`` fills (gate rows before up
        rows)."""
        assert self.value is not None
        if not self.is_stacked:
            return self.value
        if self.name.endswith("gate_up_proj"):
            half = self.shape[1] // 2
            expert, is_up = divmod(index, 2)
            return self.value[expert, is_up * half : (is_up + 1) * half]
        return self.value[index]


def load_qwen3_omni(
    checkpoint_dir: str | Path,
    config: Qwen3OmniConfig | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    nodes: Iterable[str] | None = None,
    into: Qwen3OmniWeights | None = None,
) -> Qwen3OmniWeights:
    """Load the weights of ``nodes`` from a checkpoint directory onto ``device``, floats in
    ``dtype``.

    Only the tensors those nodes read (`NODE_WEIGHTS`) are read, from the shards that hold
    them; the other parameters stay on the meta device. Each parameter is allocated once, in
    ``dtype`` on ``device``, and filled straight from the file's memory map (per-expert tensors
    into their slice of the fused one), so the load holds little more than the weights it
    keeps. A progress bar per shard is drawn when stderr is a terminal.

    Args:
        checkpoint_dir: The directory.
        config: The model (default: read from the directory's ``config.json``).
        device: Where the weights go.
        dtype: Their dtype.
        nodes: The graph nodes whose weights to load (default: every node's).
        into: Weights loaded before onto the same device in the same dtype (for other
            nodes): add these nodes' parameters to them, reading only those not loaded yet.

    Raises:
        CheckpointError: The directory lacks its weights or config, or holds missing,
            unexpected or misshapen tensors.
        KeyError: An unknown node.
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise CheckpointError(f"Qwen3-Omni checkpoint directory {str(directory)!r} does not exist")
    nodes = None if nodes is None else list(nodes)
    if config is None:
        config = (
            into.config
            if into is not None
            else Qwen3OmniConfig(name=directory.name, hf=load_hf_config(directory))
        )
    device = torch.device(device)
    weights = into if into is not None else make_empty_weights(config, device=device, dtype=dtype)
    full_shapes = {n: p.shape for n, p in weights.named_parameters()}
    shares = _shard_decoders(weights, nodes)
    params = dict(weights.named_parameters())
    wanted = [n for n in node_weight_names(weights, nodes) if params[n].is_meta]
    if not wanted:
        return weights
    files = safetensors_files(directory)
    # The whole checkpoint must match the config, whichever part of it this rank reads.
    sources, stacked, unknown, missing = _plan(files, full_shapes)
    if missing or unknown:
        raise CheckpointError(
            f"Qwen3-Omni checkpoint {str(directory)!r} does not match config {config.name!r}: "
            f"missing {len(missing)} tensors {_some(checkpoint_name(n) for n in missing)}, "
            f"unexpected {len(unknown)} tensors {_some(unknown)} (wrong config, or not a "
            "Qwen3-Omni checkpoint?)"
        )
    targets = [
        _Target(n, params[n].shape, sources[n], n in stacked, full_shapes[n], shares.get(n))
        for n in wanted
    ]
    by_shard: dict[Path, list[tuple[_Target, int, str]]] = {}
    for target in targets:
        for index, name in enumerate(target.sources):
            by_shard.setdefault(files[name], []).append((target, index, name))
    # Check every shape from the headers before allocating or reading anything.
    num_bytes = 0
    for path, parts in by_shard.items():
        header = read_safetensors_header(path)
        for target, _, name in parts:
            entry = header.get(name)
            if entry is None:
                raise CheckpointError(
                    f"tensor {name!r} is not in {str(path)!r}, though the index places it there"
                )
            if entry.shape != target.part_shape():
                raise CheckpointError(
                    f"tensor {name!r} in {str(path)!r} has shape {list(entry.shape)} but config "
                    f"{config.name!r} needs {list(target.part_shape())} for "
                    f"{checkpoint_name(target.name)!r}"
                )
            num_bytes += entry.nbytes
    started = time.perf_counter()
    # Keep at most ~1/32 of the load (4-128 MiB) of file mapped at once (see `ShardReader`).
    window = min(128 << 20, max(4 << 20, num_bytes // 32))
    with torch.no_grad(), ShardReader(window_bytes=window) as reader:
        for i, (path, parts) in enumerate(by_shard.items(), start=1):
            label = f"loading {config.name} weights {i}/{len(by_shard)} ({path.name})"
            with progress(label, total=len(parts)) as update:
                for target, index, name in parts:
                    if target.value is None:
                        is_float = params[target.name].is_floating_point()
                        target.value = torch.empty(
                            target.shape,
                            dtype=dtype if is_float else params[target.name].dtype,
                            device=device,
                        )
                        target.num_left = len(target.sources)
                    share = target.source_share()
                    if share is None:
                        reader.copy_into(path, name, target.part(index))
                    else:
                        reader.copy_slice_into(path, name, share, target.part(index))
                    target.num_left -= 1
                    if target.num_left == 0:
                        replace_parameter(weights, target.name, target.value)
                        target.value = None
                    update(advance=1)
            reader.close(path)
    log.info(
        "loaded Qwen3-Omni weights",
        checkpoint=str(directory),
        nodes=None if nodes is None else sorted(nodes),
        num_tensors=len(wanted),
        num_bytes=reader.num_bytes_read,
        seconds=round(time.perf_counter() - started, 3),
    )
    return weights.to_device_tables()


def _shard_decoders(weights: Qwen3OmniWeights, nodes: list[str] | None) -> dict[str, WeightSlice]:
    """Under `sharded` (a tensor-parallel rank loading the thinker or the talker), keep that
    decoder's shard only (still on meta, before anything is read); return each sharded tensor's
    share."""
    shard = current_shard()
    if shard is None:
        return {}
    shares: dict[str, WeightSlice] = {}
    for node, decoder, name in (
        ("thinker", weights.thinker_text, "thinker_text"),
        ("talker", weights.talker_text, "talker_text"),
    ):
        if nodes is not None and node not in nodes:
            continue
        if decoder.shard is not None or not decoder.model.norm.weight.is_meta:
            if decoder.shard != shard:
                raise CheckpointError(f"the {node} is loaded here already, as another shard")
            continue
        shares.update({f"{name}.{k}": v for k, v in decoder.shard_slices(shard).items()})
        decoder.shard_(shard)
    return shares


def make_random_checkpoint(
    config: Qwen3OmniConfig,
    directory: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write a checkpoint of random weights for ``config`` with transformers' ``save_pretrained``.

    The reference model (`Qwen3OmniMoeForConditionalGeneration`) is built with its own
    initialisation under ``torch.manual_seed(seed)`` and saved in the published layout.

    Args:
        config: The model.
        directory: Where to write it.
        seed: The initialisation's seed.
        dtype: Cast the weights to this dtype before saving (default: float32, as drawn).
        max_shard_size: Split the files past this size (bytes, or "5MB" as transformers
            reads it), with a ``model.safetensors.index.json`` (default: transformers' own).
    """
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeForConditionalGeneration,
    )

    directory = Path(directory)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(config.make_hf_config())
        # transformers initialises the thinker's MoE blocks but leaves the talker's experts as
        # allocated (uninitialised memory) and its router at zero: draw them here, reproducibly.
        with torch.no_grad():
            for layer in model.talker.model.layers:
                for param in (
                    layer.mlp.experts.gate_up_proj,
                    layer.mlp.experts.down_proj,
                    layer.mlp.gate.weight,
                ):
                    param.normal_(0.0, 0.02)
            # transformers draws every convolution from N(0, 0.02): through Code2Wav's stack of
            # narrow convolutions the signal shrinks by ~0.3 a layer and the waveform comes out
            # at ~1e-7 (every PCM16 sample 0). torch's own fan-in scaled init keeps it audible.
            for module in model.code2wav.modules():
                if isinstance(module, torch.nn.Conv1d | torch.nn.ConvTranspose1d):
                    module.reset_parameters()
    if dtype is not None:
        torch.nn.Module.to(model, dtype)  # in place (transformers' typed `to` confuses mypy)
    if max_shard_size is None:
        model.save_pretrained(str(directory))
    else:
        model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    return directory
