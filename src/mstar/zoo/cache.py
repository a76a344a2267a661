"""The mstar cache: what the zoo writes once and reuses (converted and random checkpoints).

`written_once` makes a folder appear whole: it is written aside and renamed into place, with
a marker file last, so concurrent processes never see half of one and a crash leaves nothing
that passes for complete.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import structlog

from mstar.progress import progress

__all__ = ["mstar_cache_dir", "written_once"]

log = structlog.get_logger(__name__)

_COMPLETE = ".complete"


def mstar_cache_dir() -> Path:
    """Return the cache root: `$MSTAR_CACHE_DIR`, else `$XDG_CACHE_HOME/mstar`, else
    ~/.cache/mstar."""
    explicit = os.environ.get("MSTAR_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mstar"


def written_once(root: Path, write: Callable[[Path], object], *, label: str) -> Path:
    """Return the folder ``root``, first filling it with ``write(folder)`` unless it is complete.

    Args:
        root: The folder (under `mstar_cache_dir`, keyed on what it holds).
        write: Writes the folder's files into the folder it is given (a staging folder).
        label: What is written, for the log and the progress line.
    """
    if (root / _COMPLETE).is_file():
        return root
    log.info("writing_to_cache", what=label, path=str(root))
    staging = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with progress(f"writing {label} (once)"):
            write(staging)
        (staging / _COMPLETE).write_text(label)
        if root.exists() and not (root / _COMPLETE).is_file():
            shutil.rmtree(root, ignore_errors=True)  # a folder an older format left incomplete
        try:
            staging.rename(root)
        except OSError:
            if not (root / _COMPLETE).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root
