"""openpi's WebSocket policy protocol, so existing robot clients (`openpi-client`) connect
unchanged.

On a model that declares `SupportsActionPolicy` (pi0.5), the server answers:

- ``GET /healthz``: ``OK``;
- a WebSocket at ``/``: first the policy's metadata (one binary msgpack frame), then for each
  binary msgpack observation frame one reply ``{"actions": ndarray, "policy_timing":
  {"infer_ms"}, "server_timing": {"infer_ms", "prev_total_ms"}}``. A request that fails
  (a text frame, bytes that are not msgpack, msgpack that is not a map, an observation the
  model rejects) gets its error as a text frame and the connection closes with code 1011, as
  openpi's server does; the other robots' connections go on. With an API key, the handshake needs
  ``Authorization: Api-Key <key>`` (openpi-client's header) or ``Bearer <key>``.

Unlike openpi's server (one robot at a time), every connection's requests go to the engine at
once, where the robots' flow steps share each step's batch.

ndarrays travel as openpi's msgpack extension: a map ``{b"__ndarray__": True, b"data": raw
bytes, b"dtype": dtype.str, b"shape": [...]}`` (numpy scalars: ``{b"__npgeneric__": True,
b"data": item, b"dtype": str}``).
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import msgpack
import numpy as np
import structlog
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi import Request as HttpRequest
from fastapi.responses import PlainTextResponse
from starlette.types import Message

from mstar.errors import MStarError
from mstar.runtime.model import Request, supports_action_policy
from mstar.server.middleware import websocket_authorized
from mstar.server.session import RequestStream, status_of
from mstar.server.state import ServerState

__all__ = ["pack", "router", "unpack"]

log = structlog.get_logger(__name__)

router = APIRouter()

# openpi's WebSocket close code for a failed request.
INTERNAL_ERROR = 1011
POLICY_VIOLATION = 1008


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "VOc":
            raise ValueError(f"unsupported array dtype {obj.dtype}")
        return {
            b"__ndarray__": True,
            b"data": np.ascontiguousarray(obj).tobytes(),
            b"dtype": obj.dtype.str,
            b"shape": list(obj.shape),
        }
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _decode(obj: dict[Any, Any]) -> Any:
    if b"__ndarray__" in obj:
        dtype = np.dtype(obj[b"dtype"])
        if dtype.kind in "VOc":
            raise ValueError(f"unsupported array dtype {dtype}")
        shape = tuple(int(n) for n in obj[b"shape"])
        data = obj[b"data"]
        if len(data) != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(
                f"an array of shape {list(shape)} and dtype {dtype} needs "
                f"{dtype.itemsize * int(np.prod(shape))} bytes, got {len(data)}"
            )
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()  # writable, owned
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


def pack(obj: Any) -> bytes:
    """Encode a message (dicts, lists, numbers, strings, numpy arrays) as openpi does."""
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Decode a message; arrays come back as writable numpy arrays.

    Raises:
        ValueError: Not a msgpack message of the expected kind.
    """
    try:
        return msgpack.unpackb(data, object_hook=_decode, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"not an openpi msgpack message: {exc}") from None


@router.get("/healthz")
async def healthz(http: HttpRequest) -> PlainTextResponse:
    """Answer openpi's health check."""
    state: ServerState | None = getattr(http.app.state, "server", None)
    if state is None:
        return PlainTextResponse("starting\n", status_code=503)
    return PlainTextResponse("OK\n")


@router.websocket("/")
async def policy(websocket: WebSocket) -> None:
    """Serve one robot: metadata, then an action chunk per observation."""
    state: ServerState = websocket.app.state.server
    model = state.engine.model
    if not websocket_authorized(websocket, state.config.api_key, schemes=("api-key", "bearer")):
        await websocket.close(code=POLICY_VIOLATION, reason="missing or invalid API key")
        return
    if not supports_action_policy(model):
        await websocket.close(
            code=POLICY_VIOLATION, reason=f"model {state.name!r} is not an action policy"
        )
        return
    await websocket.accept()
    await websocket.send_bytes(pack(model.policy_metadata()))
    prev_total_ms: float | None = None
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return  # the robot left
        start = time.perf_counter()
        try:
            obs = _observation(message)
            infer_start = time.perf_counter()
            actions = await _act(state, obs, model.policy_task, model.policy_output)
            infer_ms = (time.perf_counter() - infer_start) * 1e3
            reply: dict[str, Any] = {
                "actions": actions,
                "policy_timing": {"infer_ms": infer_ms},
                "server_timing": {"infer_ms": infer_ms},
            }
            if prev_total_ms is not None:
                reply["server_timing"]["prev_total_ms"] = prev_total_ms
            await websocket.send_bytes(pack(reply))
        except WebSocketDisconnect:
            return
        except Exception as exc:  # the request's failure ends this robot's session only
            await _fail(websocket, exc)
            return
        prev_total_ms = (time.perf_counter() - start) * 1e3


def _observation(message: Message) -> dict[str, Any]:
    """Parse one received frame into an observation with string keys.

    Raises:
        ValueError: A text frame, not msgpack, or not a map.
    """
    data = message.get("bytes")
    if data is None:
        raise ValueError("an observation is a binary msgpack frame, got a text frame")
    obs = unpack(data)
    if not isinstance(obs, dict):
        raise ValueError(f"an observation is a msgpack map, got {type(obs).__name__}")
    # openpi sends string keys; a client sending bytes keys gets them decoded.
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obs.items()}


async def _fail(websocket: WebSocket, exc: Exception) -> None:
    """Answer a failed request as openpi's server does: the error as text, then close 1011."""
    log.warning("policy_request_failed", error=str(exc), error_type=type(exc).__name__)
    if isinstance(exc, ValueError | MStarError):  # the client's mistake: its message says it all
        detail = "".join(traceback.format_exception_only(type(exc), exc))
    else:
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        await websocket.send_text(detail)
        await websocket.close(
            code=INTERNAL_ERROR,
            reason="Internal server error. Traceback included in previous frame.",
        )
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the robot already left


async def _act(state: ServerState, obs: dict[str, Any], task: str, output: str) -> np.ndarray:
    """Run one observation through the engine (admission control and metrics included)."""
    stream = RequestStream(state, Request(task, obs))
    try:
        await stream.start()
        result: np.ndarray | None = None
        async for out in stream.outputs():
            if out.name == output:
                result = np.asarray(out.data)
    except BaseException as exc:
        await stream.aclose(status_of(exc))
        raise
    await stream.aclose()
    if result is None:
        raise MStarError(f"the model produced no {output!r}")
    return result
