"""Owner-tagged names for socket files and shared segments, and the sweep that removes stale ones.

Every ipc socket file and shared-memory segment mstar creates is named
`mstar-<owner pid>-<random token>[suffix]`. Its owner removes it on shutdown; if the owner
crashed, whoever notices (a peer that lost it, or any later mstar process creating its own
segment) removes every file whose owner pid is no longer alive.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import tempfile
from pathlib import Path

__all__ = [
    "SHM_DIR",
    "is_pid_alive",
    "make_owned_name",
    "runtime_dir",
    "sweep_stale",
]

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# a socket file (.sock), a tensor-parallel group's channel (one per node: .0, .1, ...)
_OWNED = re.compile(r"^mstar-(\d+)-[0-9a-f]+(?:\.sock|\.\d+)?$")


def runtime_dir() -> Path:
    """Return the private directory for auto-named ipc socket files, creating it (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "mstar" if base else Path(tempfile.gettempdir()) / f"mstar-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def make_owned_name(suffix: str = "") -> str:
    """Return a fresh name tagged with this process's pid, e.g. `mstar-1234-9f2c...`."""
    return f"mstar-{os.getpid()}-{secrets.token_hex(6)}{suffix}"


def is_pid_alive(pid: int) -> bool:
    """Return whether a process with this pid exists (it may belong to another user)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed child stays a zombie until its parent reaps it: dead for our purposes.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


def sweep_stale(pid: int | None = None) -> list[Path]:
    """Remove owner-tagged files whose owner process is dead.

    Args:
        pid: only consider files of this owner (a peer just lost); None considers every owner.

    Returns:
        The paths removed.
    """
    removed: list[Path] = []
    for directory in (SHM_DIR, runtime_dir()):
        try:
            entries = list(directory.iterdir())
        except OSError:
            continue
        for path in entries:
            match = _OWNED.match(path.name)
            if match is None:
                continue
            owner = int(match.group(1))
            if (pid is not None and owner != pid) or is_pid_alive(owner):
                continue
            with contextlib.suppress(FileNotFoundError, PermissionError):
                path.unlink()
                removed.append(path)
    if removed:
        log.info("removed %d stale file(s) of dead mstar processes", len(removed))
    return removed
