"""ASGI middleware: request ids and access logs, API-key checks, request body limits."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Iterable

import structlog
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from mstar.server.encoding import error_body

__all__ = [
    "ApiKeyMiddleware",
    "BodyLimitMiddleware",
    "RequestContextMiddleware",
    "websocket_authorized",
]

log = structlog.get_logger("mstar.server.access")

REQUEST_ID_HEADER = "x-request-id"
_QUIET_PATHS = frozenset({"/health", "/metrics"})


async def _send_error(
    send: Send,
    status: int,
    message: str,
    error_type: str,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    body = json.dumps(error_body(message, error_type, code=status)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestContextMiddleware:
    """Give each request an id (bound to every log line, sent back as `X-Request-Id`) and log it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the request inside its logging context."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        client_id = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER.encode())
        context: dict[str, str] = {"request_id": request_id}
        if client_id:
            context["client_request_id"] = client_id.decode("latin-1")[:128]
        status = 500
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", ()),
                    (REQUEST_ID_HEADER.encode(), request_id.encode()),
                ]
            await send(message)

        # Probes and scrapes arrive every few seconds: log them only at debug level.
        emit = log.debug if scope["path"] in _QUIET_PATHS else log.info
        with structlog.contextvars.bound_contextvars(**context):
            emit("request_started", method=scope["method"], path=scope["path"])
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                emit(
                    "request_finished",
                    method=scope["method"],
                    path=scope["path"],
                    status=status,
                    duration_ms=round(1000 * (time.perf_counter() - start), 3),
                )


def websocket_authorized(
    websocket: WebSocket, api_key: str | None, *, schemes: tuple[str, ...] = ("bearer",)
) -> bool:
    """Whether a WebSocket upgrade carries the server's key (``Authorization: <scheme> <key>``,
    the scheme one of ``schemes``, case-insensitive); any upgrade does without a key."""
    if api_key is None:
        return True
    scheme, _, key = websocket.headers.get("authorization", "").partition(" ")
    return scheme.lower() in schemes and secrets.compare_digest(
        key.strip().encode(), api_key.encode()
    )


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on every path but the open ones."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        open_paths: Iterable[str] = ("/health", "/healthz", "/metrics"),
    ) -> None:
        self.app = app
        self._expected = api_key.encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse requests without the key (401)."""
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, key = given.partition(b" ")
        # The scheme is case-insensitive (RFC 9110 §11.1); the key is compared in constant time.
        is_bearer = scheme.lower() == b"bearer"
        if not (secrets.compare_digest(key.strip(), self._expected) and is_bearer):
            log.warning("unauthorized", path=scope["path"])
            await _send_error(
                send,
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` (413), by declared length or as they stream in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check `Content-Length` up front; count chunked bodies as they arrive."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        too_large = f"the request body is larger than {self.max_bytes} bytes"
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_error(send, 400, "invalid Content-Length", "invalid_request_error")
                return
            if size > self.max_bytes:
                await _send_error(send, 413, too_large, "invalid_request_error")
                return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside body parsing: FastAPI passes HTTPException through.
                    raise HTTPException(413, too_large)
            return message

        await self.app(scope, counted, send)
