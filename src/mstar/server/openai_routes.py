"""OpenAI-compatible `GET /v1/models`, `POST /v1/audio/speech`, `POST /v1/images/generations`."""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
import torch
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from mstar.errors import APIRequestError, MStarError
from mstar.runtime.model import Request
from mstar.server.audio import pcm16_bytes, wav_header
from mstar.server.encoding import sse
from mstar.server.images import png_bytes
from mstar.server.protocol import ImageGenerationRequest, SpeechRequest
from mstar.server.session import (
    EngineStreamingResponse,
    RequestStream,
    open_stream,
    run_to_end,
)
from mstar.server.state import ServerState

__all__ = ["router"]

log = structlog.get_logger(__name__)

router = APIRouter()

_AUDIO_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}


def _state(http: HttpRequest) -> ServerState:
    state: ServerState = http.app.state.server
    return state


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "mstar", "tasks": list(state.tasks)}


@router.get("/v1/models")
async def list_models(http: HttpRequest) -> dict[str, Any]:
    """List the one served model."""
    state = _state(http)
    return {"object": "list", "data": [_model_card(state, state.name)]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, http: HttpRequest) -> dict[str, Any]:
    """Describe the served model (404 for any other name)."""
    state = _state(http)
    state.check_model(name)
    return _model_card(state, name)


# --- speech ------------------------------------------------------------------------------


@router.post("/v1/audio/speech")
async def speech(body: SpeechRequest, http: HttpRequest) -> Response:
    """Speak `input`: a whole WAV/PCM file, or (`stream`) audio sent as it is produced."""
    state = _state(http)
    state.check_model(body.model)
    state.check_task("speech")
    rate = state.sample_rate
    if rate is None:
        raise MStarError(f"model {state.name!r} has a speech task but no audio_sample_rate")
    request = Request("speech", body.model_data(), f"speech-{uuid.uuid4().hex}")
    headers = {"X-Sample-Rate": str(rate)}
    if not body.is_streamed:
        (outputs,) = await run_to_end(state, http, [request], sample_rate=rate)
        pcm = b"".join(pcm16_bytes(o.data) for o in outputs if o.modality == "audio")
        if body.response_format == "wav":
            pcm = wav_header(rate, num_data_bytes=len(pcm)) + pcm
        return Response(pcm, media_type=_AUDIO_TYPES[body.response_format], headers=headers)
    stream = await open_stream(state, http, request, sample_rate=rate)
    if body.stream_format == "sse":
        content = _speech_events(stream, body.response_format, rate)
        return EngineStreamingResponse(content, stream, media_type="text/event-stream", headers=headers)
    content = _audio_bytes(stream, body.response_format, rate)
    return EngineStreamingResponse(content, stream, media_type=_AUDIO_TYPES[body.response_format], headers=headers)


async def _pcm_chunks(stream: RequestStream) -> AsyncIterator[bytes]:
    """Yield PCM16 of each audio output as it comes."""
    async with contextlib.aclosing(stream.outputs()) as outputs:
        async for out in outputs:
            if out.modality == "audio":
                pcm = pcm16_bytes(out.data)
                if pcm:
                    yield pcm


async def _audio_bytes(stream: RequestStream, response_format: str, rate: int) -> AsyncIterator[bytes]:
    """Yield a streaming WAV header (for wav), then the audio as it is produced.

    A failure mid-stream propagates: the connection closes without the final chunk, so the
    client sees a truncated transfer rather than audio that silently ends.
    """
    if response_format == "wav":
        yield wav_header(rate)
    async for pcm in _pcm_chunks(stream):
        yield pcm


async def _speech_events(stream: RequestStream, response_format: str, rate: int) -> AsyncIterator[bytes]:
    """Yield `speech.audio.delta` events (base64 audio), then `speech.audio.done`."""

    def delta(data: bytes) -> bytes:
        return sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})

    num_samples = 0
    try:
        if response_format == "wav":
            yield delta(wav_header(rate))
        async for pcm in _pcm_chunks(stream):
            num_samples += len(pcm) // 2
            yield delta(pcm)
        yield sse({"type": "speech.audio.done", "usage": {"num_samples": num_samples, "sample_rate": rate}})
    except (MStarError, ValueError) as exc:
        log.warning("stream_failed", error=str(exc), error_type=type(exc).__name__)
        yield sse({"type": "error", "error": {"message": str(exc), "type": "server_error"}})


# --- images ------------------------------------------------------------------------------


@router.post("/v1/images/generations")
async def image_generations(body: ImageGenerationRequest, http: HttpRequest) -> JSONResponse:
    """Generate `n` images for `prompt`, answered as base64 PNG."""
    state = _state(http)
    state.check_model(body.model)
    state.check_task("image")
    size = body.dimensions
    requests = []
    for i in range(body.n):
        data: dict[str, Any] = {"text": body.prompt}
        if body.seed is not None:
            data["seed"] = body.seed + i
        if size is not None:
            data["width"], data["height"] = size
        requests.append(Request("image", data, f"image-{uuid.uuid4().hex}"))
    results = await run_to_end(state, http, requests)
    images = []
    for outputs in results:
        pictures = [o.data for o in outputs if o.modality == "image"]
        if not pictures:
            raise MStarError(f"model {state.name!r} finished an image request without an image")
        picture = pictures[-1]
        shape = tuple(torch.as_tensor(picture).shape)
        if size is not None and (shape[1], shape[0]) != size:
            raise APIRequestError(
                f"model {state.name!r} makes {shape[1]}x{shape[0]} images, not {size[0]}x{size[1]}: "
                "omit size or send 'auto'",
                param="size",
            )
        images.append({"b64_json": base64.b64encode(png_bytes(picture)).decode("ascii"), "revised_prompt": None})
    return JSONResponse({"created": int(time.time()), "data": images})
