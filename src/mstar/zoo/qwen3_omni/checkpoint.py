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
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from mstar.errors import CheckpointError
from mstar.zoo.hf_checkpoint import load_hf_config, safetensors_files
from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig
from mstar.zoo.qwen3_omni.modules.weights import Qwen3OmniWeights

__all__ = ["RANDOM_INIT_VERSION", "checkpoint_name", "load_qwen3_omni", "make_random_checkpoint", "our_name"]

RANDOM_INIT_VERSION = 2
"""The version of `make_random_checkpoint`'s initialisation (cached random weights are keyed on it)."""

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


def load_qwen3_omni(
    checkpoint_dir: str | Path,
    config: Qwen3OmniConfig | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Qwen3OmniWeights:
    """Load a checkpoint directory into `Qwen3OmniWeights` on ``device``, floats cast to ``dtype``.

    Args:
        checkpoint_dir: The directory.
        config: The model (default: read from the directory's ``config.json``).
        device: Where the weights go.
        dtype: Their dtype.

    Raises:
        CheckpointError: The directory lacks its weights or config, or holds missing,
            unexpected or misshapen tensors.
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise CheckpointError(f"Qwen3-Omni checkpoint directory {str(directory)!r} does not exist")
    if config is None:
        config = Qwen3OmniConfig(name=directory.name, hf=load_hf_config(directory))
    files = safetensors_files(directory)
    from transformers.initialization import no_init_weights

    device = torch.device(device)
    with no_init_weights(), torch.device(device):
        weights = Qwen3OmniWeights(config)
    state = weights.state_dict()
    expected = {name: tensor.shape for name, tensor in state.items()}
    sources, stacked, unknown, missing = _plan(files, expected)
    if missing or unknown:
        raise CheckpointError(
            f"Qwen3-Omni checkpoint {str(directory)!r} does not match config {config.name!r}: "
            f"missing {len(missing)} tensors {_some(checkpoint_name(n) for n in missing)}, "
            f"unexpected {len(unknown)} tensors {_some(unknown)} (wrong config, or not a Qwen3-Omni checkpoint?)"
        )
    handles: dict[Path, object] = {}
    try:
        for mine, names in sources.items():
            parts = []
            for name in names:
                path = files[name]
                handle = handles.get(path)
                if handle is None:
                    handle = handles[path] = safe_open(str(path), framework="pt")
                parts.append(handle.get_tensor(name))  # type: ignore[attr-defined]
            tensor = _stack(mine, parts) if mine in stacked else parts[0]
            target = state[mine]
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"tensor {names[0]!r} of checkpoint {str(directory)!r} has shape {list(tensor.shape)} "
                    f"but config {config.name!r} needs {list(target.shape)} for {checkpoint_name(mine)!r}"
                )
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype) if tensor.is_floating_point() else tensor)
    finally:
        handles.clear()
    weights = weights.to(dtype=dtype).requires_grad_(False)
    return weights.to_device_tables().eval()


def _stack(mine: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-expert tensors: ``gate_up_proj`` from (gate, up) pairs, ``down_proj`` one per expert."""
    if mine.endswith("gate_up_proj"):
        return torch.stack([torch.cat(parts[i : i + 2], dim=0) for i in range(0, len(parts), 2)])
    return torch.stack(parts)


def make_random_checkpoint(
    config: Qwen3OmniConfig, directory: str | Path, *, seed: int = 0
) -> Path:
    """Write a checkpoint of random weights for ``config`` with transformers' ``save_pretrained``.

    The reference model (`Qwen3OmniMoeForConditionalGeneration`) is built with its own
    initialisation under ``torch.manual_seed(seed)`` and saved in the published layout.
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
    model.save_pretrained(str(directory))
    return directory
