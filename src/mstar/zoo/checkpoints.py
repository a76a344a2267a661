"""Which zoo family a checkpoint belongs to, read from the files its upstream publishes.

``mstar serve PATH`` and `resolve_model` call `checkpoint_spec`: it looks at the names of the
files (and, for a Hugging Face directory, ``config.json``'s ``model_type``) and returns the
family's model built from the checkpoint's own config files. A path that matches no family is
an error naming what was found and what each family needs; nothing falls back to another
family.

=============  ================================================================================
family         the files
=============  ================================================================================
Llama          ``config.json`` with ``model_type: llama`` and ``*.safetensors``
Orpheus        the same (its speech LM), served with ``snac_dir`` (a SNAC directory:
               ``config.json`` + ``pytorch_model.bin``)
Qwen3-Omni     ``config.json`` with ``model_type: qwen3_omni_moe`` and ``*.safetensors``
BAGEL          ``llm_config.json``, ``vit_config.json``, ``ema.safetensors``, ``ae.safetensors``
pi0.5          ``model.safetensors`` and ``config.json`` (openpi's ``paligemma_variant`` or
               LeRobot's ``"type": "pi05"``)
V-JEPA 2       upstream's one ``.pt`` file (``encoder`` and ``predictor`` state dicts)
=============  ================================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mstar.errors import CheckpointError, ModelLoadError
from mstar.runtime.model import ModelSpec
from mstar.zoo.hf_checkpoint import read_json_object

__all__ = ["FAMILY_FILES", "checkpoint_spec"]

# What each family needs, for the message when a path matches none.
FAMILY_FILES: dict[str, str] = {
    "Llama": "config.json with model_type 'llama' and *.safetensors",
    "Orpheus": "a Llama directory (its speech LM) served with --snac-dir (SNAC: config.json "
    "+ pytorch_model.bin)",
    "Qwen3-Omni": "config.json with model_type 'qwen3_omni_moe' and *.safetensors",
    "BAGEL": "llm_config.json, vit_config.json, ema.safetensors and ae.safetensors",
    "pi0.5": "model.safetensors and config.json (openpi's paligemma_variant, or LeRobot's "
    '"type": "pi05")',
    "V-JEPA 2": "upstream's .pt file holding 'encoder' and 'predictor'",
}

_BAGEL_FILES = ("llm_config.json", "vit_config.json", "ema.safetensors", "ae.safetensors")
_TORCH_FILE_SUFFIXES = (".pt", ".pth", ".tar")
_SNAC_FIELDS = frozenset({"encoder_dim", "decoder_dim", "encoder_rates", "decoder_rates"})
_ORPHEUS_TOKEN = "<custom_token_"


def checkpoint_spec(path: str | Path, **options: Any) -> ModelSpec:
    """Return the spec of the model in ``path``, its config read from the checkpoint's files.

    Args:
        path: A checkpoint directory, or V-JEPA 2's ``.pt`` file.
        options: The model's other keyword arguments (``dtype``, Orpheus's ``snac_dir``, ...).

    Raises:
        ModelLoadError: The path does not exist, or matches no family (the message lists the
            files found and what each family needs).
    """
    path = Path(path).expanduser().resolve()
    if path.is_file():
        from mstar.zoo.vjepa2.checkpoint import is_vjepa2_checkpoint

        if path.suffix in _TORCH_FILE_SUFFIXES and is_vjepa2_checkpoint(path):
            return ModelSpec("mstar.zoo.vjepa2.model:VJepa2Model", _kwargs(path, options))
        found = f"a file named {path.name!r}"
        if path.suffix in _TORCH_FILE_SUFFIXES:
            found += (
                " without V-JEPA 2's 'encoder' (patch_embed.proj.weight) and "
                "'predictor' (predictor_embed.weight)"
            )
        raise _unrecognised(path, found)
    if not path.is_dir():
        raise ModelLoadError(f"no checkpoint at {str(path)!r}: no such file or directory")
    names = {p.name for p in path.iterdir()}
    if {"llm_config.json", "vit_config.json"} & names:
        missing = [n for n in _BAGEL_FILES if n not in names]
        if missing:
            raise ModelLoadError(
                f"{str(path)!r} looks like a BAGEL checkpoint but lacks {', '.join(missing)} "
                f"(BAGEL needs {FAMILY_FILES['BAGEL']})"
            )
        return ModelSpec("mstar.zoo.bagel.model:BagelModel", _kwargs(path, options))
    if "config.json" not in names:
        raise _unrecognised(path, _listing(names))
    raw = _read_json(path / "config.json")
    if raw.get("type") == "pi05" or "paligemma_variant" in raw or "action_expert_variant" in raw:
        return ModelSpec("mstar.zoo.pi05.model:Pi05Model", _kwargs(path, options))
    model_type = raw.get("model_type")
    if model_type == "qwen3_omni_moe":
        return ModelSpec("mstar.zoo.qwen3_omni.model:Qwen3OmniModel", _kwargs(path, options))
    if model_type == "llama":
        if options.get("snac_dir") is not None:
            return ModelSpec("mstar.zoo.orpheus.model:OrpheusModel", _kwargs(path, options))
        if _has_orpheus_tokens(path):
            raise ModelLoadError(
                f"{str(path)!r} is an Orpheus speech LM (its tokenizer has Orpheus's audio "
                "tokens): "
                "serve it with --snac-dir DIR (a SNAC 24 kHz checkpoint: config.json + "
                "pytorch_model.bin)"
            )
        return ModelSpec("mstar.zoo.llm:TextLLM", {"checkpoint": str(path), **options})
    if set(raw) >= _SNAC_FIELDS:
        raise ModelLoadError(
            f"{str(path)!r} is a SNAC codec, not a model of its own: serve an Orpheus speech LM "
            f"with it (mstar serve LM_DIR --snac-dir {path})"
        )
    found = (
        f"config.json with model_type {model_type!r}"
        if model_type
        else "config.json without model_type"
    )
    raise _unrecognised(path, f"{found}; {_listing(names)}")


def _kwargs(path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a family model read from ``path``: no preset, the checkpoint."""
    return {"config": None, "checkpoint": str(path), **options}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path)
    except CheckpointError as exc:
        raise ModelLoadError(str(exc)) from exc


def _has_orpheus_tokens(path: Path) -> bool:
    """Whether the directory's tokenizer holds Orpheus's ``<custom_token_N>`` audio tokens."""
    for name in ("tokenizer.json", "tokenizer_config.json", "added_tokens.json"):
        file = path / name
        if file.is_file() and _ORPHEUS_TOKEN in file.read_text(errors="replace"):
            return True
    return False


def _listing(names: set[str], limit: int = 12) -> str:
    shown = sorted(names)[:limit]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"files {', '.join(shown)}{more}" if names else "an empty directory"


def _unrecognised(path: Path, found: str) -> ModelLoadError:
    needs = "; ".join(f"{family}: {files}" for family, files in FAMILY_FILES.items())
    return ModelLoadError(
        f"{str(path)!r} is not a checkpoint mstar recognises (found {found}). Each family "
        f"needs: {needs}"
    )
