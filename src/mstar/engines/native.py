"""Native CPU kernels: C++ in `csrc/`, built at first use by torch's extension loader.

The build (about half a minute) happens once per machine, source and torch version; the
library is cached under torch's extensions directory (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) and later processes load it in milliseconds. It is compiled
for the CPU it runs on (``-march=native``): the name of the cached build carries the CPU's
feature flags, so a cache shared between machines never hands one CPU another's code.

Where no C++ compiler is found, or the build fails, `cpu_kernels` returns None once with a
warning and callers keep their torch-only paths; ``MSTAR_NATIVE_KERNELS=0`` turns the
kernels off without trying.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
from pathlib import Path
from types import ModuleType

import structlog
import torch

__all__ = ["build_for", "cpu_kernels", "native_kernels_enabled"]

_log = structlog.get_logger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "cpu_kernels.cpp"
"""The one translation unit; it includes the headers beside it (`sources`)."""
CFLAGS = ("-O3", "-march=native", "-fopenmp")
"""``-fopenmp``: ATen's `at::parallel_for` is inline code around ``#pragma omp parallel``, which
a compiler without it ignores (every loop on the calling thread whatever torch's thread
count). The kernels' grains (`grain_for` in `csrc/simd.h`) keep work under about 4 MiB of
memory and products on the calling thread: on two threads, teams for the small work of a small
model's decode step cost more than they saved (tiny Llama TPOT 1.40 -> 1.80 ms with a team for
every product), while long work gains (1,536-token prompts: TTFT 126 -> 97 ms in float32,
16 requests' decode 1.3x tokens/s)."""

_lock = threading.Lock()
_loaded: ModuleType | None = None
_tried = False


ENABLED = os.environ.get("MSTAR_NATIVE_KERNELS", "1") != "0"
"""Whether native kernels may be used: ``MSTAR_NATIVE_KERNELS`` was not ``0`` at import. Read
once, not per call (layers ask on every step; an environment lookup cost 5 % of a step's
Python); tests switch the kernels off by setting it."""


def native_kernels_enabled() -> bool:
    """Whether native kernels may be used (see `ENABLED`)."""
    return ENABLED


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def sources() -> dict[str, bytes]:
    """Return every file of the kernels' source (the unit and its headers), by name."""
    return {
        path.name: path.read_bytes()
        for path in sorted(CSRC.iterdir())
        if path.suffix in (".cpp", ".h")
    }


def _build_name(cflags: tuple[str, ...] = CFLAGS) -> str:
    digest = hashlib.sha256()
    for name, text in sources().items():
        digest.update(name.encode() + b"\0" + text)
    for part in (_cpu_flags().encode(), torch.__version__.encode(), " ".join(cflags).encode()):
        digest.update(part)
    return f"mstar_cpu_kernels_{digest.hexdigest()[:16]}"


def _build(cflags: tuple[str, ...] = CFLAGS) -> ModuleType:
    from torch.utils import cpp_extension

    try:  # torch's loader runs `ninja` from PATH: the ninja package's own binary serves
        import ninja

        path = os.environ.get("PATH", "")
        if ninja.BIN_DIR not in path.split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
    except ImportError:
        pass
    name = _build_name(cflags)
    # Compile a copy kept in the build's own directory, not the checkout's file: torch's loader
    # writes the source's path into its ninja file, so two checkouts (or a moved one) would
    # rebuild on every switch between them, and one process of either trigger it for all.
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    for filename, text in sources().items():
        copy = build_dir / filename
        # the name hashes the texts: written once
        if not copy.is_file() or copy.read_bytes() != text:
            partial = copy.with_name(f"{filename}.{os.getpid()}.tmp")
            partial.write_bytes(text)
            os.replace(partial, copy)  # atomic: a concurrent build never reads half a file
    source = build_dir / SOURCE.name
    # torch's loader serialises builds with a lock file that a killed build leaves behind, and
    # every later process then waits on it forever. Builds here hold an flock the kernel drops
    # when its holder dies: whoever holds it is the only builder, so a torch lock file it finds
    # is stale and goes.
    with open(build_dir / "mstar.flock", "a+b") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=list(cflags),
            verbose=False,
        )


def build_for(march: str) -> ModuleType:
    """Build the kernels for another CPU (``-march=``, e.g. ``haswell``: AVX2 without AVX-512).

    The vector paths a machine without this one's instruction sets takes, so they can be run
    and checked here (on a CPU that has what ``march`` assumes). Raises what the build raises.
    """
    return _build(tuple(f"-march={march}" if f.startswith("-march=") else f for f in CFLAGS))


def cpu_kernels() -> ModuleType | None:
    """Return the built kernels (see `csrc/cpu_kernels.cpp`), building them on first call; None if
    they cannot be."""
    global _loaded, _tried
    if not native_kernels_enabled():
        return None
    if _tried:  # the per-call path: layers ask on every step
        return _loaded
    with _lock:
        if not _tried:
            start = time.perf_counter()
            try:
                _loaded = _build()
            except Exception as error:  # no compiler, a failed build: the torch paths serve
                _log.warning(
                    "native_kernels_unavailable", error=str(error).strip().splitlines()[-1][:300]
                )
            else:
                _log.info("native_kernels_ready", seconds=round(time.perf_counter() - start, 2))
            # Set once the build is over: a thread that reads it outside the lock must not
            # take a build still running for a failed one.
            _tried = True
        return _loaded
