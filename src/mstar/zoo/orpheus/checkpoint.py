"""Orpheus checkpoints: random ones in the real formats, and loading either kind.

A checkpoint is two directories, laid out as the published ones are::

    llm/   config.json  model.safetensors       (transformers' LlamaForCausalLM.save_pretrained)
    snac/  config.json  pytorch_model.bin       (snac.SNAC's state dict, weight-norm
                                                 parametrizations as
                                                 ...parametrizations.weight.original0/1)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mstar.errors import CheckpointError
from mstar.zoo.hf_checkpoint import load_hf_config
from mstar.zoo.llama import LlamaCausalLM, LlamaConfig, load_llama
from mstar.zoo.orpheus.codec import NoiseMode, SnacCodec, load_snac
from mstar.zoo.orpheus.config import OrpheusConfig

__all__ = [
    "llama_hf_config",
    "load_orpheus_codec",
    "load_orpheus_llm",
    "make_random_checkpoint",
]

_ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def llama_hf_config(config: OrpheusConfig) -> dict[str, Any]:
    """Return the Hugging Face ``config.json`` fields of the config's Llama backbone."""
    llm, layout = config.llm, config.layout
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": llm.vocab_size,
        "hidden_size": llm.hidden_size,
        "intermediate_size": llm.intermediate_size,
        "num_hidden_layers": llm.num_hidden_layers,
        "num_attention_heads": llm.num_attention_heads,
        "num_key_value_heads": llm.num_key_value_heads,
        "head_dim": llm.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": llm.max_position_embeddings,
        "rms_norm_eps": llm.rms_norm_eps,
        "rope_theta": llm.rope_theta,
        "rope_scaling": dict(llm.rope_scaling) if llm.rope_scaling else None,
        "tie_word_embeddings": llm.tie_word_embeddings,
        "attention_bias": llm.attention_bias,
        "mlp_bias": llm.mlp_bias,
        "initializer_range": config.initializer_range,
        "bos_token_id": layout.start_of_text,
        "eos_token_id": layout.end_of_speech,
        "pad_token_id": layout.pad,
        "torch_dtype": llm.torch_dtype or "float32",
    }


def _save_random_llama(config: OrpheusConfig, directory: Path, seed: int) -> None:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    fields = llama_hf_config(config)
    dtype = getattr(torch, fields["torch_dtype"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(HFLlamaConfig(**fields))
    model.to(dtype).save_pretrained(directory)


def _save_random_snac(config: OrpheusConfig, directory: Path, seed: int) -> None:
    from snac import SNAC

    raw = config.snac.to_json_dict()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SNAC(**raw)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    torch.save(model.state_dict(), directory / "pytorch_model.bin")


def make_random_checkpoint(
    config: OrpheusConfig, out_dir: str | Path, *, seed: int = 0
) -> OrpheusConfig:
    """Write random weights for ``config`` under ``out_dir/llm`` and ``out_dir/snac``.

    The same seed writes the same weights. Returns the config pointing at the new directories.
    """
    out = Path(out_dir)
    llm_dir, snac_dir = out / "llm", out / "snac"
    _save_random_llama(config, llm_dir, seed)
    _save_random_snac(config, snac_dir, seed + 1)
    return config.with_checkpoints(llm_dir, snac_dir)


def load_orpheus_llm(
    config: OrpheusConfig, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> LlamaCausalLM:
    """Load the backbone from ``config.llm_dir`` for `KVCacheEngine` (`mstar.zoo.llama`).

    Raises:
        CheckpointError: Files are missing, or the architecture differs from the config's.
    """
    llm_dir, _ = config.require_checkpoints()
    found = LlamaConfig.from_hf(load_hf_config(llm_dir))
    diffs = [
        f"{name} {getattr(found, name)} (expected {getattr(config.llm, name)})"
        for name in _ARCH_FIELDS
        if getattr(found, name) != getattr(config.llm, name)
    ]
    if diffs:
        raise CheckpointError(
            f"{config.name}: the Llama checkpoint {str(llm_dir)!r} does not match: "
            f"{', '.join(diffs)}"
        )
    return load_llama(llm_dir, device=device, dtype=dtype)


def load_orpheus_codec(
    config: OrpheusConfig,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    noise: NoiseMode = "seeded",
) -> SnacCodec:
    """Load SNAC from ``config.snac_dir`` (its ``config.json`` must match ``config.snac``).

    Raises:
        CheckpointError: Files are missing or do not match.
    """
    _, snac_dir = config.require_checkpoints()
    return load_snac(snac_dir, expected=config.snac, device=device, dtype=dtype, noise=noise)
