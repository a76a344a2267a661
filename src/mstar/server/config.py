"""Server settings, checked on construction: secure by default."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from mstar.errors import ServerConfigError
from mstar.server.admission import AdmissionLimits

__all__ = ["ServerConfig", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Return whether binding ``host`` keeps the server reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server runs.

    Attributes:
        host: Address to bind; loopback (127.0.0.1) by default.
        port: TCP port (0 picks a free one).
        api_key: Required as ``Authorization: Bearer <key>`` on every API route when set;
            mandatory when `host` is not a loopback address.
        served_model_name: The model name clients send (default: the name the model was
            served under).
        max_body_bytes: Largest request body accepted (larger ones get 413).
        max_text_chars: Longest text (`text`, `prompt`) a native `/generate` request may
            carry (longer ones get 400), as `/v1/audio/speech` caps its `input`.
        admission: Running and waiting limits (beyond them, 503 with Retry-After).
        graceful_shutdown_s: On SIGTERM or SIGINT, how long requests still running may take
            to finish (new ones get 503 meanwhile); those left then end with an error event.
        keep_alive_timeout_s: How long an idle keep-alive connection stays open.
        header_timeout_s: How long a connection may take to send a request's headers.
        max_realtime_sessions: `/v1/realtime` sessions open at once; one more gets an
            ``error`` event (``session_limit_reached``) and the socket closes (1013).
        realtime_idle_timeout_s: How long a `/v1/realtime` session may go without a client
            event while no response runs; then it gets an ``error`` event
            (``session_idle_timeout``) and the socket closes (1000).
        max_realtime_event_bytes: Largest client event of a `/v1/realtime` session (the
            default holds a 15 MiB audio append, base64-encoded); a larger one gets an
            ``error`` event (``event_too_large``) and the socket closes (1009). Frames over
            twice this size are refused by the WebSocket layer itself (close 1009, no event).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    served_model_name: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_text_chars: int = 16_384
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    graceful_shutdown_s: float = 10.0
    keep_alive_timeout_s: float = 5.0
    header_timeout_s: float = 10.0
    max_realtime_sessions: int = 64
    realtime_idle_timeout_s: float = 600.0
    max_realtime_event_bytes: int = 24 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.realtime_idle_timeout_s > 0:
            raise ServerConfigError(
                f"realtime_idle_timeout_s must be > 0 s, got {self.realtime_idle_timeout_s}"
            )
        if self.max_realtime_event_bytes < 1024:
            raise ServerConfigError(
                f"max_realtime_event_bytes must be >= 1024, got {self.max_realtime_event_bytes}"
            )
        if not 0 <= self.port <= 65535:
            raise ServerConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1:
            raise ServerConfigError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.graceful_shutdown_s < 0:
            raise ServerConfigError(
                f"the shutdown grace must be >= 0 s, got {self.graceful_shutdown_s}"
            )
        if self.keep_alive_timeout_s <= 0 or self.header_timeout_s <= 0:
            raise ServerConfigError(
                f"connection timeouts must be > 0 s, got keep-alive {self.keep_alive_timeout_s}, "
                f"headers {self.header_timeout_s}"
            )
        if self.max_realtime_sessions < 0:
            raise ServerConfigError(
                f"max_realtime_sessions must be >= 0, got {self.max_realtime_sessions}"
            )
        if self.max_text_chars < 1:
            raise ServerConfigError(f"max_text_chars must be >= 1, got {self.max_text_chars}")
        if self.api_key is not None and not self.api_key.strip():
            raise ServerConfigError("the API key is empty: pass a non-empty --api-key")
        if not is_loopback(self.host) and self.api_key is None:
            raise ServerConfigError(
                f"binding {self.host!r} exposes the server beyond this machine: pass --api-key "
                "(or set MSTAR_API_KEY), or bind 127.0.0.1"
            )
