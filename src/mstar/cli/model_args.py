"""The model options `mstar serve` and `mstar run` share: a checkpoint, its dtype, its side files.

    mstar serve ./Qwen3-Omni-30B-A3B-Instruct --dtype bfloat16
    mstar serve qwen3-omni-30b-a3b --checkpoint ./Qwen3-Omni-30B-A3B-Instruct
    mstar serve ./orpheus-3b-0.1-ft --snac-dir ./snac_24khz
    mstar serve ./pi05_libero --robot libero
    mstar serve ./bagel-finetune --model-option seed=3

Each flag becomes the keyword argument of the model's class of the same name (``--snac-dir``
is ``snac_dir``); `resolve_model` refuses one the model does not take, naming the ones it does
(`mstar models --verbose` lists them).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mstar.errors import ModelLoadError

__all__ = ["DTYPE_CHOICES", "add_model_arguments", "key_value_pairs", "model_kwargs"]

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# flag dest -> the model's keyword
_FLAGS = {
    "checkpoint": "checkpoint",
    "dtype": "dtype",
    "tokenizer": "tokenizer",
    "snac_dir": "snac_dir",
    "robot": "robot",
    "norm_stats": "norm_stats",
    "asset_id": "asset_id",
}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the model options to ``parser``, as a group of their own."""
    group = parser.add_argument_group(
        "model options",
        "passed to the model as keyword arguments; a flag the model does not take is an error "
        "naming the ones it does (`mstar models --verbose`)",
    )
    group.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="the checkpoint of a zoo name that needs one (MODEL may also be the path itself)",
    )
    group.add_argument(
        "--dtype",
        default=None,
        choices=DTYPE_CHOICES,
        help="weights' dtype; auto: the checkpoint's own (config.json's torch_dtype). "
        "Default: the model's",
    )
    group.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a tokenizer kept apart from the checkpoint (pi0.5: PaliGemma's tokenizer.model)",
    )
    group.add_argument(
        "--snac-dir",
        default=None,
        metavar="DIR",
        help="Orpheus: the SNAC 24 kHz codec (config.json + pytorch_model.bin)",
    )
    group.add_argument(
        "--robot",
        default=None,
        metavar="LAYOUT",
        help="pi0.5: the robot's observation and action layout (droid, libero, aloha)",
    )
    group.add_argument(
        "--norm-stats",
        default=None,
        metavar="FILE",
        help="pi0.5: the norm_stats.json to use (default: found in the checkpoint)",
    )
    group.add_argument(
        "--asset-id",
        default=None,
        metavar="ID",
        help="pi0.5: which assets/<ID>/ holds the norm stats",
    )
    group.add_argument(
        "--model-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other keyword of the model; VALUE is read as JSON when it parses, else as "
        "a string (repeatable)",
    )


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Return the model's keyword arguments from the flags (only those given).

    Raises:
        ModelLoadError: A ``--model-option`` that is not KEY=VALUE, or names a flag's keyword.
    """
    kwargs = {
        key: getattr(args, dest)
        for dest, key in _FLAGS.items()
        if getattr(args, dest, None) is not None
    }
    options = key_value_pairs(args.model_option, "--model-option", "seed=3", ModelLoadError)
    for key in options.keys() & kwargs.keys():
        raise ModelLoadError(
            f"--model-option {key}=... repeats --{key.replace('_', '-')}: give it once"
        )
    return {**kwargs, **options}


def key_value_pairs(
    pairs: list[str], flag: str, example: str, error: type[Exception]
) -> dict[str, Any]:
    """Parse repeated ``KEY=VALUE`` flags: VALUE as JSON where it parses, else as a string."""
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise error(f"{flag} {pair!r}: write KEY=VALUE, e.g. {example}")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed
