"""A small real HTTP server streaming synthetic outputs of known size, for the HTTP targets.

It speaks the four APIs the harness measures. Request bodies steer it (`test_*` fields), and
every body it receives is kept in `received` so tests can check what the client sent.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

FIRST_DELAY_S = 0.05  # before the first output of every stream
GAP_S = 0.005  # between outputs
IMAGE_BYTES = b"\x89PNG\r\n\x1a\n" + bytes(range(64))


def wav_header(
    sample_rate: int, channels: int = 1, bits: int = 16, data_size: int = 0xFFFFFFFF
) -> bytes:
    """Return a canonical 44-byte WAV header; the default data size means 'unknown'."""
    block = channels * bits // 8
    riff_size = 0xFFFFFFFF if data_size == 0xFFFFFFFF else 36 + data_size
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
        + b"data"
        + struct.pack("<I", data_size)
    )


async def _paced(pieces: list[bytes]) -> AsyncIterator[bytes]:
    await asyncio.sleep(FIRST_DELAY_S)  # synthetic compute time of the server
    for i, piece in enumerate(pieces):
        if i:
            await asyncio.sleep(GAP_S)
        yield piece


async def _speech(request: Request) -> Response:
    body = await request.json()
    request.app.state.received.append(("speech", body))
    chunks: list[int] = body.get("test_chunks", [2400, 4800, 2400])
    pcm = [bytes(2 * n) for n in chunks]
    if body.get("response_format") == "wav":
        pieces = [wav_header(body.get("test_wav_rate", 16_000)), *pcm]
    else:
        pieces = pcm
    if body.get("test_split"):
        # Cut every piece off-frame: the client must carry the odd bytes over.
        joined = b"".join(pieces)
        pieces = [joined[i : i + 333] for i in range(0, len(joined), 333)]
    if body.get("test_truncate"):
        pieces.append(b"\x00")  # half a frame at the end
    return StreamingResponse(_paced(pieces), media_type="audio/pcm")


async def _chat(request: Request) -> Response:
    body = await request.json()
    request.app.state.received.append(("chat", body))
    if body.get("test_status"):
        return JSONResponse({"error": {"message": "overloaded"}}, status_code=body["test_status"])
    num_tokens = body.get("max_tokens") or 4
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        *({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]} for i in range(num_tokens)),
    ]
    if body.get("test_stream_error"):
        events.append({"error": {"message": "engine died"}})
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {
            "prompt_tokens": 7,
            "completion_tokens": num_tokens,
            "total_tokens": 7 + num_tokens,
        }
        events.append({"choices": [], "usage": usage})
    pieces = [f"data: {json.dumps(e)}\n\n".encode() for e in events]
    if not body.get("test_no_done"):
        pieces.append(b"data: [DONE]\n\n")
    return StreamingResponse(_paced(pieces), media_type="text/event-stream")


async def _images(request: Request) -> Response:
    body = await request.json()
    request.app.state.received.append(("images", body))
    await asyncio.sleep(FIRST_DELAY_S)
    encoded = base64.b64encode(IMAGE_BYTES).decode()
    return JSONResponse({"created": 0, "data": [{"b64_json": encoded}] * body.get("n", 1)})


async def _generate(request: Request) -> Response:
    body = await request.json()
    request.app.state.received.append(("generate", body))
    audio = base64.b64encode(bytes(2 * 800)).decode()
    lines = [
        {"modality": "text", "text": "hi", "token_ids": [1, 2, 3]},
        {"modality": "audio", "num_samples": 1600, "sample_rate": 16_000},
        {"modality": "audio", "data": audio, "sample_rate": 16_000},
        {"modality": "action", "shape": [50, 7]},
        {"modality": "action", "shape": [50, 7]},
        {"usage": {"completion_tokens": 5}},
        {"finished": True},
    ]
    pieces = [(json.dumps(line) + "\n").encode() for line in lines]
    return StreamingResponse(_paced(pieces), media_type="application/x-ndjson")


def make_app() -> Starlette:
    """Return the synthetic server's application."""
    app = Starlette(
        routes=[
            Route("/v1/audio/speech", _speech, methods=["POST"]),
            Route("/v1/chat/completions", _chat, methods=["POST"]),
            Route("/v1/images/generations", _images, methods=["POST"]),
            Route("/generate", _generate, methods=["POST"]),
        ]
    )
    app.state.received = []
    return app


@contextmanager
def serve() -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """Serve the app on 127.0.0.1 in a thread; yield its base URL and the received bodies."""
    app = make_app()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    # Listening before uvicorn starts: early connections wait in the backlog, so no
    # start-up wait is needed.
    sock.listen(128)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", loop="asyncio", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", app.state.received
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
