"""The FastAPI application: one model, OpenAI-compatible and native routes, health, metrics.

    app = make_app(resolve_model("toy-composite"), ServerConfig(), names=("toy-composite",))
    uvicorn.run(app, host="127.0.0.1", port=8000)

The engine starts in the application's lifespan (before the first request is accepted)
and shuts down with it, failing any request still running.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from mstar.errors import (
    APIRequestError,
    ClientDisconnectedError,
    InvalidRequestError,
    MStarError,
    OverloadedError,
    WorkerUnavailableError,
)
from mstar.runtime.async_engine import AsyncEngine
from mstar.runtime.engine_config import EngineConfig
from mstar.runtime.model import Model, ModelSpec
from mstar.runtime.placement import Placement
from mstar.server import native, openai_routes, openpi, realtime, text_routes
from mstar.server.admission import AdmissionQueue
from mstar.server.config import ServerConfig
from mstar.server.encoding import error_body
from mstar.server.metrics import ServerMetrics
from mstar.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from mstar.server.state import ServerState

__all__ = ["make_app"]

log = structlog.get_logger(__name__)

# OpenAI's error types by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "overloaded_error",
}


def make_app(
    model: ModelSpec | Model,
    config: ServerConfig | None = None,
    *,
    names: Sequence[str] = (),
    placement: Placement | str | Path | None = None,
    engine_config: EngineConfig | None = None,
    loading: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
) -> FastAPI:
    """Return the server's application for one model.

    Args:
        model: The model, or a spec to build it from (needed for worker processes).
        config: Server settings.
        names: Model names clients may send (default: the model's own name); the first is
            the one listed by `/v1/models` (unless `config.served_model_name` is set).
        placement: A placement, a placement YAML file, or None for one device.
        engine_config: How the engine runs.
        loading: Wraps the engine start (e.g. a progress display); gets the model's name.
    """
    config = config or ServerConfig()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        label = names[0] if names else model.name if isinstance(model, Model) else model.factory
        try:
            with loading(label) if loading is not None else contextlib.nullcontext():
                engine = await AsyncEngine.start(model, placement, engine_config)
        except Exception as exc:
            app.state.startup_error = exc  # the server's runner reports it after uvicorn exits
            raise
        try:
            served = tuple(
                dict.fromkeys(n for n in (config.served_model_name, *names, engine.model.name) if n)
            )
            metrics = ServerMetrics(served[0])
            admission = AdmissionQueue(config.admission)
            metrics.watch_admission(lambda: admission.num_running, lambda: admission.num_waiting)
            app.state.server = ServerState(engine, config, served, admission, metrics)
            log.info("model_ready", model=served[0], tasks=list(engine.model.tasks()))
            yield
        finally:
            log.info("engine_stopping")
            await engine.shutdown()

    app = FastAPI(
        title="mstar", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json"
    )
    app.include_router(openai_routes.router)
    app.include_router(text_routes.router)
    app.include_router(native.router)
    app.include_router(openpi.router)
    app.include_router(realtime.router)
    _add_operational_routes(app)
    _add_error_handlers(app)
    # Starlette runs the last-added middleware first: context, then auth, then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestContextMiddleware)
    return app


def _add_operational_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(http: HttpRequest) -> Response:
        """Answer 200 while the engine serves; 503 while it starts, stops, or misses a worker.

        The answer names the model and whether it serves deterministically.
        """
        state: ServerState | None = getattr(http.app.state, "server", None)
        if state is None or state.engine.conductor is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        if state.is_draining:
            return JSONResponse({"status": "stopping", "model": state.name}, status_code=503)
        down = [rank for rank, is_up in state.engine.ranks_up().items() if not is_up]
        if down:
            return JSONResponse(
                {"status": "degraded", "model": state.name, "ranks_down": down}, status_code=503
            )
        return JSONResponse(
            {
                "status": "ok",
                "model": state.name,
                "deterministic": state.engine.config.deterministic,
            }
        )

    @app.get("/metrics")
    async def metrics(http: HttpRequest) -> Response:
        """Return the Prometheus metrics (a lost worker is reported, not waited for)."""
        state: ServerState = http.app.state.server
        stats = await state.engine.engine_stats()
        ranks_up = state.engine.ranks_up()
        state.metrics.set_ranks_up(
            {rank: is_up and rank not in stats.missing_ranks for rank, is_up in ranks_up.items()}
        )
        state.metrics.set_engine_stats(stats)
        return Response(
            state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )


def _field(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "body"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(http: HttpRequest, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return JSONResponse(
                error_body("the body is not valid JSON", "invalid_request_error", code=400), 400
            )
        field = _field(first.get("loc", ()))
        message = "; ".join(f"{_field(e.get('loc', ()))}: {e.get('msg')}" for e in errors)
        return JSONResponse(
            error_body(message, "invalid_request_error", param=field, code=400), 400
        )

    @app.exception_handler(APIRequestError)
    async def api_error(http: HttpRequest, exc: APIRequestError) -> Response:
        body = error_body(str(exc), exc.error_type, param=exc.param, code=exc.code or exc.status)
        return JSONResponse(body, exc.status)

    @app.exception_handler(InvalidRequestError)
    async def invalid_field(http: HttpRequest, exc: InvalidRequestError) -> Response:
        return JSONResponse(
            error_body(str(exc), "invalid_request_error", param=exc.param, code=400, exc=exc), 400
        )

    @app.exception_handler(OverloadedError)
    async def overloaded(http: HttpRequest, exc: OverloadedError) -> Response:
        body = error_body(str(exc), "overloaded_error", code=503)
        return JSONResponse(body, 503, headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(WorkerUnavailableError)
    async def worker_unavailable(http: HttpRequest, exc: WorkerUnavailableError) -> Response:
        # Retryable: the rank is being restarted (a client may also try another replica).
        log.warning("request_failed", error=str(exc), error_type=type(exc).__name__, rank=exc.rank)
        body = error_body(str(exc), "overloaded_error", code=503, exc=exc)
        body["error"] |= {"rank": exc.rank, "retry_after_s": exc.retry_after_s}
        return JSONResponse(body, 503, headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(ClientDisconnectedError)
    async def client_gone(http: HttpRequest, exc: ClientDisconnectedError) -> Response:
        # Nobody reads this answer; 499 is nginx's "client closed request", for the logs.
        return Response(status_code=499)

    @app.exception_handler(MStarError)
    async def engine_error(http: HttpRequest, exc: MStarError) -> Response:
        log.error("request_failed", error=str(exc), error_type=type(exc).__name__)
        return JSONResponse(error_body(str(exc), "server_error", code=500, exc=exc), 500)

    @app.exception_handler(HTTPException)
    async def http_error(http: HttpRequest, exc: HTTPException) -> Response:
        kind = _ERROR_TYPES.get(
            exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error"
        )
        return JSONResponse(
            error_body(str(exc.detail), kind, code=exc.status_code),
            exc.status_code,
            headers=exc.headers,
        )
