"""`mstar serve MODEL`: serve one model over HTTP until interrupted.

    mstar serve toy-composite                       # http://127.0.0.1:8000
    mstar serve smollm2-135m --port 9000
    mstar serve ./my-llama --host 0.0.0.0 --api-key-file key.txt   # a key is required off loopback
    mstar serve ./Qwen3-Omni-30B-A3B-Instruct --dtype bfloat16     # any zoo family's checkpoint

The API key is best given as ``$MSTAR_API_KEY`` or ``--api-key-file``: ``--api-key KEY`` shows
in the process list. On SIGTERM or SIGINT the server drains: new requests get 503, running
ones get ``--shutdown-grace`` seconds to finish, then end with an error event.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI

from mstar.errors import MStarError, ServerConfigError
from mstar.progress import progress
from mstar.runtime.async_engine import EngineConfig
from mstar.runtime.model import ModelSpec
from mstar.runtime.placement import Placement
from mstar.runtime.trust import check_model_factory
from mstar.server.admission import AdmissionLimits
from mstar.server.app import make_app
from mstar.server.config import ServerConfig
from mstar.server.http_protocol import timed_h11
from mstar.server.logging import configure_logging
from mstar.server.model_args import add_model_arguments, model_kwargs
from mstar.server.state import ServerState

__all__ = [
    "DrainingServer",
    "EngineStart",
    "add_serve_arguments",
    "loading_display",
    "resolve_api_key",
    "run_server",
    "serve_command",
    "uvicorn_config",
]

log = structlog.get_logger(__name__)

API_KEY_ENV = "MSTAR_API_KEY"
WS_PING_INTERVAL_S = 20.0
WS_PING_TIMEOUT_S = 20.0
EXIT_USAGE = 2


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `mstar serve` to ``parser``."""
    parser.add_argument(
        "model", metavar="MODEL",
        help="a zoo model name (see `mstar models`) or a checkpoint's path (a directory, or V-JEPA 2's "
        ".pt file), whose family and sizes are read from its files; an action policy (pi0.5) also "
        "serves openpi's robot protocol (see below)",
    )
    parser.epilog = (
        "Robot clients: an action policy (pi05-*) also serves openpi's WebSocket policy protocol "
        "at ws://HOST:PORT/ on the same port (no extra option), so openpi_client's "
        "WebsocketClientPolicy(HOST, PORT) connects unchanged (with --api-key, it passes "
        "api_key=KEY); GET /healthz answers OK. A malformed observation gets its error as a text "
        "frame, then close code 1011."
    )
    parser.add_argument("--config", type=str, default=None, metavar="PLACEMENT.yaml", help="placement file (default: everything on one device)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs --api-key)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    parser.add_argument(
        "--api-key", default=None,
        help=f"require 'Authorization: Bearer KEY' (visible in the process list: prefer ${API_KEY_ENV} or --api-key-file)",
    )
    parser.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file")
    parser.add_argument(
        "--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
        help="on SIGTERM, how long running requests may take to finish (default 10)",
    )
    parser.add_argument(
        "--request-stall-timeout", type=float, default=600.0, metavar="SECONDS",
        help="fail a request that made no progress for this long, e.g. a message lost on the way "
        "(RequestStalledError; default 600, 0 never)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    parser.add_argument("--worker-processes", action="store_true", help="run each rank's worker in a process of its own")
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="run each rank's worker as a Ray actor on this cluster (auto, ray://head:10001), on the node "
        "its placement's ray_resources name; the HTTP server and the conductor stay here",
    )
    parser.add_argument(
        "--ray-num-cpus", type=float, default=1.0, help="CPUs each rank's Ray actor reserves (default 1)"
    )
    parser.add_argument(
        "--allow-model-factory",
        action="append",
        default=[],
        metavar="MODULE[:CALLABLE]",
        help="let workers build models from this module or factory besides the zoo's (repeatable); "
        "MODEL may then be package.module:callable",
    )
    parser.add_argument("--device", default=None, help="torch device of every rank, e.g. cuda:0 (default cpu)")
    parser.add_argument("--max-running", type=int, default=64, help="requests in the engine at once (default 64)")
    parser.add_argument("--max-waiting", type=int, default=256, help="requests queued beyond that; more get 503 (default 256)")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024, help="largest request body (default 16 MiB)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--log-format", default="auto", choices=("auto", "json", "console"), help="auto: JSON unless on a terminal")
    add_model_arguments(parser)


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

    def __init__(self, display: Callable[[str], contextlib.AbstractContextManager[Any]] = loading_display) -> None:
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
        self, config: uvicorn.Config, server_config: ServerConfig, app: FastAPI, start: EngineStart | None = None
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
        if not self.is_start_cancelled and starting is not None and loop is not None and not loop.is_closed():
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
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit(), name="mstar-drain")

    async def _drain_then_exit(self) -> None:
        state: ServerState | None = getattr(self.app.state, "server", None)
        try:
            if state is not None:
                await state.drain(self.server_config.graceful_shutdown_s)
        finally:
            self.should_exit = True


def _not_cancelled(record: logging.LogRecord) -> bool:
    """Drop uvicorn's report of the lifespan's start failing by a cancellation (and its traceback)."""
    message = record.getMessage().rstrip()
    return not (message.endswith("CancelledError") or message == "Application startup failed. Exiting.")


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
    previous = _on_sigterm(_exit_quietly) if threading.current_thread() is threading.main_thread() else None
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


def resolve_api_key(given: str | None, path: str | None) -> str | None:
    """Return the API key from ``--api-key``, else ``--api-key-file``, else ``$MSTAR_API_KEY``.

    Raises:
        ServerConfigError: Both options were given, or the file cannot be read.
    """
    if given is not None and path is not None:
        raise ServerConfigError("pass --api-key or --api-key-file, not both")
    if path is not None:
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            raise ServerConfigError(f"cannot read the API key file {path}: {exc}") from exc
        if not key:
            raise ServerConfigError(f"the API key file {path} is empty")
        return key
    if given is not None:
        return given
    return os.environ.get(API_KEY_ENV) or None


def _model_spec(model: str, allowed: list[str], kwargs: dict[str, Any]) -> ModelSpec:
    """Return the spec of MODEL: a zoo name, a checkpoint's path, or an allow-listed factory."""
    from mstar.zoo import resolve_model

    if ":" in model and not Path(model).exists():
        check_model_factory(model, allowed)
        return ModelSpec(model, kwargs)
    return resolve_model(model, **kwargs)


def serve_command(args: argparse.Namespace) -> int:
    """Run `mstar serve`."""
    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file)
        config = ServerConfig(
            host=args.host,
            port=args.port,
            api_key=api_key,
            served_model_name=args.served_model_name,
            max_body_bytes=args.max_body_bytes,
            admission=AdmissionLimits(args.max_running, args.max_waiting),
            graceful_shutdown_s=args.shutdown_grace,
        )
        spec = _model_spec(args.model, args.allow_model_factory, model_kwargs(args))
        placement = Placement.from_yaml(args.config) if args.config else None
        if args.request_stall_timeout < 0:
            raise ServerConfigError(f"--request-stall-timeout must be >= 0 seconds, got {args.request_stall_timeout}")
    except (MStarError, OSError) as exc:
        print(f"mstar serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    json_logs = None if args.log_format == "auto" else args.log_format == "json"
    configure_logging(args.log_level, json=json_logs, secrets=[api_key] if api_key else [])
    devices = {r: args.device for r in (placement.ranks if placement else (0,))} if args.device else {}
    engine_config = EngineConfig(
        worker_processes=args.worker_processes,
        devices=devices,
        freeze_gc=True,
        allowed_model_factories=tuple(args.allow_model_factory),
        ray_address=args.ray_address,
        ray_num_cpus=args.ray_num_cpus,
        request_stall_timeout_s=args.request_stall_timeout or None,
    )
    start = EngineStart()
    app = make_app(
        spec, config, names=(args.model,), placement=placement, engine_config=engine_config, loading=start.loading
    )
    try:
        run_server(app, config, start)
    except (ServerConfigError, ValueError) as exc:  # e.g. a placement that does not fit the model
        print(f"mstar serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MStarError as exc:
        print(f"mstar serve: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the port is taken, or the address cannot be bound
        print(f"mstar serve: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
