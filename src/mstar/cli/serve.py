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
import os
import sys
from pathlib import Path
from typing import Any

from mstar.cli.model_args import add_model_arguments, model_kwargs
from mstar.errors import MStarError, ServerConfigError
from mstar.runtime.engine_config import EngineConfig
from mstar.runtime.model import ModelSpec
from mstar.runtime.placement import Placement
from mstar.runtime.trust import check_model_factory
from mstar.server.admission import AdmissionLimits
from mstar.server.app import make_app
from mstar.server.config import ServerConfig
from mstar.server.logging import configure_logging
from mstar.server.runner import EngineStart, run_server

__all__ = ["API_KEY_ENV", "EXIT_USAGE", "add_serve_arguments", "resolve_api_key", "serve_command"]

API_KEY_ENV = "MSTAR_API_KEY"
EXIT_USAGE = 2


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `mstar serve` to ``parser``."""
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a zoo model name (see `mstar models`) or a checkpoint's path (a directory, or "
        "V-JEPA 2's "
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
    parser.add_argument(
        "--config",
        type=str,
        default=None,
        metavar="PLACEMENT.yaml",
        help="placement file (default: everything on one device)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; any other needs --api-key)",
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (visible in the process list: prefer "
        f"${API_KEY_ENV} or --api-key-file)",
    )
    parser.add_argument(
        "--api-key-file", default=None, metavar="PATH", help="read the API key from this file"
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running requests may take to finish (default 10)",
    )
    parser.add_argument(
        "--request-stall-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="fail a request that made no progress for this long, e.g. a message lost on the way "
        "(RequestStalledError; default 600, 0 never)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: MODEL)"
    )
    parser.add_argument(
        "--worker-processes",
        action="store_true",
        help="run each rank's worker in a process of its own",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="run each rank's worker as a Ray actor on this cluster (auto, "
        "ray://head:10001), on the node "
        "its placement's ray_resources name; the HTTP server and the conductor stay here",
    )
    parser.add_argument(
        "--ray-num-cpus",
        type=float,
        default=1.0,
        help="CPUs each rank's Ray actor reserves (default 1)",
    )
    parser.add_argument(
        "--allow-model-factory",
        action="append",
        default=[],
        metavar="MODULE[:CALLABLE]",
        help="let workers build models from this module or factory besides the zoo's (repeatable); "
        "MODEL may then be package.module:callable",
    )
    parser.add_argument(
        "--device", default=None, help="torch device of every rank, e.g. cuda:0 (default cpu)"
    )
    parser.add_argument(
        "--max-running", type=int, default=64, help="requests in the engine at once (default 64)"
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests queued beyond that; more get 503 (default 256)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="serve deterministically: a seeded request gives the same bytes whatever else "
        "runs beside it (slower; see the README)",
    )
    parser.add_argument(
        "--max-realtime-sessions",
        type=int,
        default=64,
        help="/v1/realtime sessions open at once; one more is refused (default 64)",
    )
    parser.add_argument(
        "--realtime-idle-timeout",
        type=float,
        default=600.0,
        help="seconds a /v1/realtime session may send nothing (no answer running) before it "
        "is closed (default 600)",
    )
    parser.add_argument(
        "--max-realtime-event-bytes",
        type=int,
        default=24 * 1024 * 1024,
        help="largest /v1/realtime client event (default 24 MiB: a 15 MiB audio append)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="largest request body (default 16 MiB)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument(
        "--log-format",
        default="auto",
        choices=("auto", "json", "console"),
        help="auto: JSON unless on a terminal",
    )
    add_model_arguments(parser)


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
            max_realtime_sessions=args.max_realtime_sessions,
            realtime_idle_timeout_s=args.realtime_idle_timeout,
            max_realtime_event_bytes=args.max_realtime_event_bytes,
        )
        spec = _model_spec(args.model, args.allow_model_factory, model_kwargs(args))
        placement = Placement.from_yaml(args.config) if args.config else None
        if args.request_stall_timeout < 0:
            raise ServerConfigError(
                f"--request-stall-timeout must be >= 0 seconds, got {args.request_stall_timeout}"
            )
    except (MStarError, OSError) as exc:
        print(f"mstar serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    json_logs = None if args.log_format == "auto" else args.log_format == "json"
    configure_logging(args.log_level, json=json_logs, secrets=[api_key] if api_key else [])
    devices = (
        {r: args.device for r in (placement.ranks if placement else (0,))} if args.device else {}
    )
    engine_config = EngineConfig(
        worker_processes=args.worker_processes,
        devices=devices,
        freeze_gc=True,
        allowed_model_factories=tuple(args.allow_model_factory),
        ray_address=args.ray_address,
        ray_num_cpus=args.ray_num_cpus,
        request_stall_timeout_s=args.request_stall_timeout or None,
        deterministic=args.deterministic,
    )
    start = EngineStart()
    app = make_app(
        spec,
        config,
        names=(args.model,),
        placement=placement,
        engine_config=engine_config,
        loading=start.loading,
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
        print(
            f"mstar serve: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 1
    return 0
