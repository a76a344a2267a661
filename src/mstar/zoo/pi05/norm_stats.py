"""Where a pi0.5 checkpoint keeps its norm stats: openpi's ``norm_stats.json`` or LeRobot's
normalizers.

`find_norm_stats` looks, in order, and takes the first it finds::

    norm_stats=PATH                                  a norm_stats.json, or a LeRobot normalizer file
    <ckpt>/assets/<asset_id>/norm_stats.json         openpi (asset id per robot: droid,
                                                     physical-intelligence/libero, trossen)
    <ckpt>/assets/**/norm_stats.json                 openpi, when there is exactly one
    <ckpt>/norm_stats.json
    <ckpt>/policy_*processor_step_*_*normalizer_processor.safetensors
                                                     LeRobot: flat tensors "observation.state.q01",
                                                     "action.q99", ... (the preprocessor's
                                                     normalizer
                                                     holds both; the postprocessor's the actions)

An asset id the user names is looked for alone: a checkpoint without it is an error, not a
reason to serve other stats.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from mstar.errors import CheckpointError
from mstar.zoo.pi05.policy import NORM_STATS_FILE, NormStats, QuantileStats

__all__ = [
    "LEROBOT_ACTION_KEY",
    "LEROBOT_NORMALIZER_PATTERN",
    "LEROBOT_STATE_KEY",
    "asset_ids",
    "find_norm_stats",
    "load_lerobot_normalizer",
    "load_norm_stats",
]

# LeRobot's pipelines save each (un)normalizer step as "<pipeline>_step_<i>_<step
# name>.safetensors".
LEROBOT_NORMALIZER_PATTERN = "policy_*processor_step_*_*normalizer_processor.safetensors"
LEROBOT_STATE_KEY = "observation.state"
LEROBOT_ACTION_KEY = "action"
_STAT_NAMES = ("q01", "q99", "mean", "std")


def find_norm_stats(
    checkpoint_dir: str | Path,
    asset_id: str,
    *,
    path: str | Path | None = None,
    is_asset_id_given: bool = False,
) -> tuple[NormStats, str]:
    """Find and read a checkpoint's norm stats (see the module doc for the order).

    Args:
        checkpoint_dir: The checkpoint directory.
        asset_id: The folder under ``assets/`` to look in first.
        path: An explicit file, which is then the only place looked.
        is_asset_id_given: The user named ``asset_id``: look nowhere else.

    Returns:
        The stats and where they came from (for logs and errors).

    Raises:
        CheckpointError: No stats anywhere (the message lists every place looked), several
            ``assets/`` folders and none named, or a file that is malformed.
    """
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise CheckpointError(f"norm stats {str(file)!r} (given as norm_stats=) is not a file")
        return load_norm_stats([file]), str(file)
    directory = Path(checkpoint_dir)
    named = directory / "assets" / asset_id / NORM_STATS_FILE
    if named.is_file():
        return load_norm_stats([named]), str(named)
    if is_asset_id_given:
        found = ", ".join(asset_ids(directory)) or "none"
        raise CheckpointError(
            f"norm stats {str(named)!r} not found (asset ids in the checkpoint: {found})"
        )
    looked = [str(named)]
    assets = (
        sorted((directory / "assets").rglob(NORM_STATS_FILE))
        if (directory / "assets").is_dir()
        else []
    )
    looked.append(str(directory / "assets" / "**" / NORM_STATS_FILE))
    if len(assets) > 1:
        raise CheckpointError(
            f"pi0.5 checkpoint {str(directory)!r} holds norm stats of several robots "
            f"({', '.join(asset_ids(directory))}) and none for asset id {asset_id!r}: "
            "pass asset_id= (or norm_stats= a file)"
        )
    if assets:
        return load_norm_stats(assets), str(assets[0])
    top = directory / NORM_STATS_FILE
    looked.append(str(top))
    if top.is_file():
        return load_norm_stats([top]), str(top)
    # The preprocessor's normalizer first: it holds the state, the postprocessor's only actions.
    lerobot = sorted(
        directory.glob(LEROBOT_NORMALIZER_PATTERN),
        key=lambda p: ("postprocessor" in p.name, p.name),
    )
    looked.append(str(directory / LEROBOT_NORMALIZER_PATTERN))
    if lerobot:
        return load_norm_stats(lerobot), ", ".join(str(p) for p in lerobot)
    raise CheckpointError(
        f"pi0.5 checkpoint {str(directory)!r} has no norm stats; looked for {'; '.join(looked)}. "
        "Pass norm_stats= the file (openpi's norm_stats.json or LeRobot's normalizer .safetensors)"
    )


def asset_ids(checkpoint_dir: str | Path) -> list[str]:
    """Return the asset ids under ``assets/`` that hold a ``norm_stats.json`` (e.g.
    ``physical-intelligence/libero``)."""
    assets = Path(checkpoint_dir) / "assets"
    if not assets.is_dir():
        return []
    return sorted(p.parent.relative_to(assets).as_posix() for p in assets.rglob(NORM_STATS_FILE))


def load_norm_stats(files: Sequence[Path]) -> NormStats:
    """Read stats from one ``norm_stats.json``, or from LeRobot normalizer ``.safetensors`` files.

    Raises:
        CheckpointError: The files are missing or malformed, or lack quantiles.
    """
    if len(files) == 1 and files[0].suffix != ".safetensors":
        return NormStats.load(files[0])
    return load_lerobot_normalizer(files)


def load_lerobot_normalizer(files: Sequence[Path]) -> NormStats:
    """Read LeRobot's (un)normalizer files: ``observation.state.{q01,q99,mean,std}`` and
    ``action.*``.

    A key's stats come from the first file that holds them.

    Raises:
        CheckpointError: A file is not safetensors, or the files lack the state's or the
            actions' quantiles.
    """
    found: dict[str, np.ndarray] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="np") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                    if (
                        name.startswith((f"{LEROBOT_STATE_KEY}.", f"{LEROBOT_ACTION_KEY}."))
                        and name not in found
                    ):
                        found[name] = np.asarray(f.get_tensor(name), dtype=np.float64).reshape(-1)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(
                f"LeRobot normalizer {str(file)!r} is not a readable safetensors file: {exc}"
            ) from None
    where = ", ".join(repr(str(f)) for f in files)
    return NormStats(
        state=_quantiles(found, LEROBOT_STATE_KEY, where),
        actions=_quantiles(found, LEROBOT_ACTION_KEY, where),
    )


def _quantiles(found: dict[str, np.ndarray], key: str, where: str) -> QuantileStats:
    for name in ("q01", "q99"):
        if f"{key}.{name}" not in found:
            raise CheckpointError(
                f"LeRobot normalizer {where} has no {f'{key}.{name}'!r}: pi0.5 normalizes "
                "with quantiles "
                "(LeRobot's augment_dataset_quantile_stats.py adds them)"
            )
    stats = {name: found.get(f"{key}.{name}") for name in _STAT_NAMES}
    try:
        q01, q99 = stats["q01"], stats["q99"]
        assert q01 is not None and q99 is not None  # checked above
        return QuantileStats(q01=q01, q99=q99, mean=stats["mean"], std=stats["std"])
    except ValueError as exc:
        raise CheckpointError(f"LeRobot normalizer {where}: {key!r}: {exc}") from None
