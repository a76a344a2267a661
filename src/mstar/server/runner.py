"""The HTTP server's process: bind, run uvicorn with a draining shutdown, start the engine in
its lifespan (`run_server`). `mstar serve` (`mstar.cli.serve`) drives it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI

from mstar.progress import progress
from mstar.server.config import ServerConfig
from mstar.server.http_protocol import timed_h11
from mstar.server.state import ServerState

__all__ = [
    "WS_PING_INTERVAL_S",
    "WS_PING_TIMEOUT_S",
    "DrainingServer",
    "EngineStart",
    "loading_display",
    "run_server",
    "uvicorn_config",
]

log = structlog.get_logger(__name__)

WS_PING_INTERVAL_S = 20.0
WS_PING_TIMEOUT_S = 20.0


@contextlib.contextmanager
def loading_display(name: str) -> Iterator[None]:
    """Show a spinner with elapsed time while a model loads (on a terminal); log it anyway.

    The runtime does not report per-node load progress, so this shows activity and elapsed
    time rather than a percentage.
    """
    start = time.perf_counter()
    log.info("model_loading", model=name)
    with progress(f"loading {name} (weights, engines)"):
        yield
    log.info("model_loaded", model=name, seconds=round(time.perf_counter() - start, 3))


class EngineStart:
    """The task starting the engine inside uvicorn's lifespan, while it runs: what a signal cancels.

    Its `loading` wraps the engine's start (`make_app`'s ``loading``), around ``display``.
    """

    def __init__(
        self, display: Callable[[str], contextlib.AbstractContextManager[Any]] = loading_display
    ) -> None:
        self.display = display
        self.task: asyncio.Task[Any] | None = None

    @contextlib.contextmanager
    def loading(self, name: str) -> Iterator[None]:
        """Remember the current task while the engine starts in it."""
        self.task = asyncio.current_task()
        try:
            with self.display(name):
                yield
        finally:
            self.task = None


def uvicorn_config(app: FastAPI, config: ServerConfig) -> uvicorn.Config:
    """Return uvicorn's settings for ``app``: connection timeouts, quiet logs, lifespan on."""
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,  # the server logs each request itself, with its request id
        server_header=False,
        http=timed_h11(config.header_timeout_s),
        timeout_keep_alive=max(1, round(config.keep_alive_timeout_s)),
        # WebSocket sessions (robots) last hours and may idle between calls: ping every 20 s
        # and drop a peer whose pong is 20 s late, as openpi's server (websockets' defaults)
        # does. uvicorn's "auto" ws picks a websockets-based protocol, which honours both.
        ws_ping_interval=WS_PING_INTERVAL_S,
        ws_ping_timeout=WS_PING_TIMEOUT_S,
        # Room past the realtime event limit, so the session can answer a larger event with
        # an error event before it closes (beyond this, the protocol closes with 1009).
        ws_max_size=2 * config.max_realtime_event_bytes,
        # Draining ends every request within the grace (and a few seconds for their error
        # events); uvicorn then waits a little for their connections to close.
        timeout_graceful_shutdown=int(config.graceful_shutdown_s + 10),
        lifespan="on",
    )


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains on the first SIGTERM or SIGINT (a second one stops at once).

    Draining keeps the listener open: new requests get 503 and `/health` says "stopping",
    running requests get ``config.graceful_shutdown_s`` to finish (`ServerState.drain`);
    then uvicorn shuts down as usual (connections, then the lifespan and the engine). A
    signal while the engine still starts (joining a Ray cluster, waiting for its placement,
    loading; ``start`` tells of it) has nothing to drain: it cancels the start, which stops
    what it began, and `is_start_cancelled` turns true.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        server_config: ServerConfig,
        app: FastAPI,
        start: EngineStart | None = None,
    ) -> None:
        super().__init__(config)
        self.server_config = server_config
        self.app = app
        self.start = start
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self.is_start_cancelled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve (remembering the loop, which signal handlers hand the drain to)."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Begin draining (or stop a start); a second signal, or no running loop, exits at once."""
        loop = self._loop
        starting = self.start.task if self.start is not None else None
        if (
            not self.is_start_cancelled
            and starting is not None
            and loop is not None
            and not loop.is_closed()
        ):
            # uvicorn would wait for the lifespan's start (minutes, on a cluster) before it
            # looks at the signal. The start then fails by cancellation: no error to report.
            self.is_start_cancelled = True
            logging.getLogger("uvicorn.error").addFilter(_not_cancelled)
            loop.call_soon_threadsafe(starting.cancel)
            return
        if self._drain is not None or self.should_exit or loop is None or loop.is_closed():
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # raised again once the server stopped, as uvicorn does
        loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """Start draining (on the server's loop); exit once it is over."""
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(
                self._drain_then_exit(), name="mstar-drain"
            )

    async def _drain_then_exit(self) -> None:
        state: ServerState | None = getattr(self.app.state, "server", None)
        try:
            if state is not None:
                await state.drain(self.server_config.graceful_shutdown_s)
        finally:
            self.should_exit = True


def _not_cancelled(record: logging.LogRecord) -> bool:
    """Drop uvicorn's report of the lifespan's start failing by a cancellation (and its
    traceback)."""
    message = record.getMessage().rstrip()
    return not (
        message.endswith("CancelledError") or message == "Application startup failed. Exiting."
    )


def _bind(app: FastAPI, config: ServerConfig) -> tuple[uvicorn.Config, socket.socket, str]:
    uv = uvicorn_config(app, config)
    sock = uv.bind_socket()
    sock.listen(uv.backlog)  # clients queue while the model loads, instead of being refused
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    return uv, sock, f"http://{url_host}:{port}"


def run_server(app: FastAPI, config: ServerConfig, start: EngineStart | None = None) -> None:
    """Bind, then serve ``app`` until SIGINT or SIGTERM (blocking); both stop it gracefully.

    With ``start`` (whose `EngineStart.loading` wraps the app's engine start), a signal while
    the engine starts stops the start and returns.

    Raises:
        MStarError: The engine failed to start (the original error).
    """
    uv, sock, url = _bind(app, config)
    log.info("server_bound", url=url)
    # uvicorn handles the signal (graceful shutdown), then raises it again once done: turn
    # that into a normal return rather than death by signal.
    previous = (
        _on_sigterm(_exit_quietly)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    server = DrainingServer(uv, config, app, start)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:
        if server.is_start_cancelled:  # stopped by a signal while starting
            log.info("server_stopped_while_starting", url=url)
            return
        error = getattr(app.state, "startup_error", None)
        if error is not None:
            raise error from None
        if exc.code not in (0, None):
            raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sock.close()
    log.info("server_stopped", url=url)


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _on_sigterm(handler: Callable[[int, object], None]) -> Any:
    return signal.signal(signal.SIGTERM, handler)
