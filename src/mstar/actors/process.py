"""`SystemProcess`: an actor system in a child process, for workers on other devices.

The child is started with the `spawn` method (a forked child of a process that ran torch can
hang on its first parallel op). It serves the given addresses, runs a setup coroutine named
as `"package.module:function"` (which spawns its actors), reports the bound addresses, and
runs until told to stop (SIGTERM), or until the lifeline pipe to its parent closes: when the
parent drops its `SystemProcess`, exits, or dies. Only strings cross the process boundary
at start-up (the setup's keyword arguments as JSON).

    proc = SystemProcess("myapp.workers:setup_worker", serve=["ipc://"])
    addresses = proc.start()                 # blocks: use asyncio.to_thread in async code
    worker = system.ref("worker", addresses[0])
    ...
    proc.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Self

import msgspec

from mstar.actors.config import SystemConfig
from mstar.actors.system import ActorSystem
from mstar.errors import MissingMainGuardError, PeerLostError
from mstar.transport.janitor import is_pid_alive, sweep_stale

__all__ = ["SystemProcess", "check_main_guard"]

# The exit status of a spawned child that found itself starting processes while it imported
# the parent's main script (see `check_main_guard`).
_MAIN_GUARD_EXIT = 86
_MAIN_GUARD_HELP = (
    "worker processes start with 'spawn', which imports your main script again in each of "
    "them; that script starts worker processes at import time. Put the code that starts the "
    'engine under `if __name__ == "__main__":`'
)


def check_main_guard() -> None:
    """Stop a spawned child that is about to start processes while importing the parent's script.

    A script without an ``if __name__ == "__main__":`` guard runs again (as ``__mp_main__``)
    in every child that `spawn` starts; if it starts worker processes at import time, each
    child would try to as well. The child says why on stderr and exits with a status that
    the parent turns into `MissingMainGuardError`.
    """
    # multiprocessing marks a spawned child as inheriting while it re-imports the parent's
    # main module, and refuses to start processes then (with an obscure RuntimeError).
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"mstar: error: {_MAIN_GUARD_HELP}", file=sys.stderr, flush=True)
        raise SystemExit(_MAIN_GUARD_EXIT)


def _resolve(path: str) -> Callable[..., Awaitable[None]]:
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"setup must look like 'package.module:function', got {path!r}")
    function = getattr(importlib.import_module(module), name)
    if not callable(function):
        raise ValueError(f"{path!r} is not callable")
    return function


class SystemProcess:
    """An actor system running in a spawned child process.

    Args:
        setup: `"package.module:function"`; `async def function(system) -> None` runs in the
            child after it serves, to spawn its actors.
        serve: addresses the child serves (`ipc://` and `tcp://127.0.0.1:0` pick free ones).
        config: the child's system config.
        loop: `"asyncio"` or `"uvloop"`.
        setup_args: keyword arguments of the setup function (JSON-encodable).
    """

    def __init__(
        self,
        setup: str,
        *,
        serve: Sequence[str] = ("ipc://",),
        config: SystemConfig | None = None,
        loop: str = "asyncio",
        setup_args: Mapping[str, Any] | None = None,
    ) -> None:
        if loop not in ("asyncio", "uvloop"):
            raise ValueError(f"loop must be 'asyncio' or 'uvloop', got {loop!r}")
        if not serve:
            raise ValueError("the child must serve at least one address")
        self.setup = setup
        self.serve = list(serve)
        self.config = config or SystemConfig()
        self.loop = loop
        self.setup_args = msgspec.json.encode(dict(setup_args or {})).decode()
        self.addresses: list[str] = []
        self._process: multiprocessing.process.BaseProcess | None = None
        self._pid: int | None = None
        self._is_started = False
        self._lifeline: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The child's pid, once started."""
        return self._pid

    @property
    def sentinel(self) -> int | None:
        """A descriptor that turns readable when the child exits, once started."""
        return None if self._process is None else self._process.sentinel

    @property
    def is_alive(self) -> bool:
        """Whether the child runs."""
        return self._process is not None and self._process.is_alive()

    def start(self, timeout: float = 60.0) -> list[str]:
        """Start the child and block until it serves; return its bound addresses.

        Raises:
            PeerLostError: the child died or did not report within `timeout`.
        """
        if self._is_started:
            raise RuntimeError("a SystemProcess starts once")
        self._is_started = True
        check_main_guard()
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        config = msgspec.json.encode(self.config).decode()
        # Not a daemon: a worker may start processes of its own (torch.compile does). The
        # lifeline ends it instead, also when this interpreter exits without calling stop().
        process = context.Process(
            target=_child_main,
            args=(self.setup, self.serve, config, self.loop, theirs, self.setup_args),
            name=f"mstar-system:{self.setup}",
        )
        process.start()
        theirs.close()
        self._process, self._lifeline, self._pid = process, ours, process.pid
        multiprocessing.util.Finalize(self, ours.close, exitpriority=10)
        try:
            if not ours.poll(timeout):
                raise PeerLostError(f"the child system did not start within {timeout} s")
            report = msgspec.json.decode(ours.recv_bytes())
        except (EOFError, OSError) as exc:
            process.join(5)
            exitcode = process.exitcode
            self.kill()
            if exitcode == _MAIN_GUARD_EXIT:
                raise MissingMainGuardError(_MAIN_GUARD_HELP) from None
            raise PeerLostError(
                f"the child system exited (code {exitcode}) before it served"
            ) from exc
        except PeerLostError:
            self.kill()
            raise
        if "error" in report:
            process.join(10)
            self.kill()
            raise PeerLostError(f"the child system failed to start: {report['error']}")
        self.addresses = list(report["addresses"])
        return self.addresses

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the child to shut down (SIGTERM) and wait; kill it if it takes over `timeout`."""
        process = self._process
        if process is None:
            return
        if process.is_alive() and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            process.join(timeout)
        if process.is_alive():
            self.kill()
        self._reap()
        self._close_lifeline()

    def kill(self) -> None:
        """Kill the child at once (SIGKILL) and reap it."""
        process = self._process
        if process is None:
            return
        if process.is_alive():
            process.kill()
        process.join(10)
        self._reap()
        self._close_lifeline()

    def _reap(self) -> None:
        # A reaped child's Process object still holds its sentinel pipe until collected:
        # close it now, or every restarted worker leaks a descriptor.
        process = self._process
        if process is not None and process.exitcode is not None:
            process.close()
            self._process = None

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _child_main(
    setup: str,
    serve: list[str],
    config: str,
    loop: str,
    lifeline: Connection,
    setup_args: str = "{}",
) -> None:
    """Run in the child: serve, set up, report, and wait to be stopped."""
    parsed = msgspec.json.decode(config, type=SystemConfig)
    main = _child(setup, serve, parsed, lifeline, msgspec.json.decode(setup_args))
    if loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


async def _child(
    setup: str,
    serve: list[str],
    config: SystemConfig,
    lifeline: Connection,
    setup_args: dict[str, Any],
) -> None:
    parent = os.getppid()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # The lifeline turns readable when the parent closes its end or dies.
    loop.add_reader(lifeline.fileno(), stop.set)
    error: str | None = None
    try:
        async with ActorSystem(config) as system:
            try:
                addresses = [await system.serve(address) for address in serve]
                await _resolve(setup)(system, **setup_args)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                lifeline.send_bytes(msgspec.json.encode({"addresses": addresses}))
                await stop.wait()
        # Reported once the system has shut down, so nothing of it is left behind.
        if error is not None:
            lifeline.send_bytes(msgspec.json.encode({"error": error}))
    finally:
        loop.remove_reader(lifeline.fileno())
        lifeline.close()
        # A parent that was killed left its shared segment and socket files: nobody else
        # may be there to remove them.
        if not is_pid_alive(parent):
            sweep_stale(parent)
