"""OpenAI-compatible `GET /v1/models`, `POST /v1/audio/speech`, `POST /v1/images/generations`
and `POST /v1/images/edits`."""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from mstar.errors import APIRequestError, MStarError
from mstar.runtime.model import Request
from mstar.server.audio import OPENAI_SAMPLE_RATE, PcmResampler, wav_header
from mstar.server.encoding import error_body, sse
from mstar.server.images import decode_image, encode_image
from mstar.server.protocol import ImageEditRequest, ImageGenerationRequest, SpeechRequest
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
MAX_EDIT_IMAGES = 16
_IMAGE_FIELDS = ("image", "image[]")  # one file, or several as the openai client sends them


def _state(http: HttpRequest) -> ServerState:
    state: ServerState = http.app.state.server
    return state


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "mstar",
        "tasks": list(state.tasks),
    }


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
    """Speak `input`: a whole WAV/PCM file, or (`stream`) audio sent as it is produced.

    The audio is served at `OPENAI_SAMPLE_RATE` whatever the model's own rate (resampled
    continuously when they differ); the ``X-Sample-Rate`` header names it.
    """
    state = _state(http)
    state.check_model(body.model)
    state.check_task("speech")
    native = state.sample_rate
    if native is None:
        raise MStarError(f"model {state.name!r} has a speech task but no audio_sample_rate")
    rate = OPENAI_SAMPLE_RATE
    if body.speed != 1.0 and "speed" not in state.option_names("speech"):
        raise APIRequestError(f"model {state.name!r} speaks at speed 1.0 only", param="speed")
    await state.check_length(
        body.max_tokens, num_prompt=state.count_prompt(body.input), prompt_param="input"
    )
    request = Request("speech", body.model_data(), f"speech-{uuid.uuid4().hex}")
    headers = {"X-Sample-Rate": str(rate)}
    if not body.is_streamed:
        (outputs,) = await run_to_end(state, http, [request], sample_rate=native)
        resampler = PcmResampler(native, rate)
        pcm = (
            b"".join(resampler.feed(o.data) for o in outputs if o.modality == "audio")
            + resampler.finish()
        )
        if body.response_format == "wav":
            pcm = wav_header(rate, num_data_bytes=len(pcm)) + pcm
        return Response(pcm, media_type=_AUDIO_TYPES[body.response_format], headers=headers)
    stream = await open_stream(state, http, request, sample_rate=native)
    chunks = _pcm_chunks(stream, PcmResampler(native, rate))
    if body.stream_format == "sse":
        content = _speech_events(chunks, body.response_format, rate)
        return EngineStreamingResponse(
            content, stream, media_type="text/event-stream", headers=headers
        )
    content = _audio_bytes(chunks, body.response_format, rate)
    return EngineStreamingResponse(
        content, stream, media_type=_AUDIO_TYPES[body.response_format], headers=headers
    )


async def _pcm_chunks(stream: RequestStream, resampler: PcmResampler) -> AsyncIterator[bytes]:
    """Yield PCM16 at the served rate of each audio output as it comes, then the resampler's
    tail."""
    async with contextlib.aclosing(stream.outputs()) as outputs:
        async for out in outputs:
            if out.modality == "audio":
                pcm = resampler.feed(out.data)
                if pcm:
                    yield pcm
    tail = resampler.finish()
    if tail:
        yield tail


async def _audio_bytes(
    chunks: AsyncIterator[bytes], response_format: str, rate: int
) -> AsyncIterator[bytes]:
    """Yield a streaming WAV header (for wav), then the audio as it is produced.

    A failure mid-stream propagates: the connection closes without the final chunk, so the
    client sees a truncated transfer rather than audio that silently ends.
    """
    if response_format == "wav":
        yield wav_header(rate)
    async for pcm in chunks:
        yield pcm


async def _speech_events(
    chunks: AsyncIterator[bytes], response_format: str, rate: int
) -> AsyncIterator[bytes]:
    """Yield `speech.audio.delta` events (base64 audio), then `speech.audio.done`."""

    def delta(data: bytes) -> bytes:
        return sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})

    num_samples = 0
    try:
        if response_format == "wav":
            yield delta(wav_header(rate))
        async for pcm in chunks:
            num_samples += len(pcm) // 2
            yield delta(pcm)
        yield sse(
            {
                "type": "speech.audio.done",
                "usage": {"num_samples": num_samples, "sample_rate": rate},
            }
        )
    except (MStarError, ValueError) as exc:
        log.warning("stream_failed", error=str(exc), error_type=type(exc).__name__)
        kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
        # names the mstar error, for clients
        yield sse({"type": "error", **error_body(str(exc), kind, exc=exc)})


# --- images ------------------------------------------------------------------------------


@router.post("/v1/images/generations")
async def image_generations(body: ImageGenerationRequest, http: HttpRequest) -> JSONResponse:
    """Generate `n` images for `prompt`, answered as base64 PNG."""
    state = _state(http)
    state.check_model(body.model)
    state.check_task("image")
    return await _run_images(state, http, "image", body, {})


@router.post("/v1/images/edits")
async def image_edits(http: HttpRequest) -> JSONResponse:
    """Edit the uploaded image(s) as `prompt` says; answer `n` results as base64 PNG.

    The body is a multipart form, as OpenAI's: `image` (a PNG or JPEG file; several as
    `image[]`), `prompt`, and optionally `n`, `size`, `response_format` (b64_json), `seed`.
    """
    state = _state(http)
    if not http.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIRequestError(
            "send an image edit as multipart/form-data, with the image as a file field 'image'"
        )
    async with http.form(max_files=MAX_EDIT_IMAGES + 1, max_fields=64) as form:
        items = form.multi_items()
        fields = {k: v for k, v in items if isinstance(v, str) and k not in _IMAGE_FIELDS}
        try:
            body = ImageEditRequest.model_validate(fields)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        state.check_model(body.model)
        state.check_task("image_edit")
        if any(k == "mask" for k, _ in items):
            raise APIRequestError(
                "masks are not supported: the whole image is edited", param="mask"
            )
        uploads = [v for k, v in items if k in _IMAGE_FIELDS]
        if not uploads:
            raise APIRequestError(
                "image is required: attach one or more PNG or JPEG files", param="image"
            )
        if len(uploads) > MAX_EDIT_IMAGES:
            raise APIRequestError(
                f"send at most {MAX_EDIT_IMAGES} images, got {len(uploads)}", param="image"
            )
        images = []
        for i, upload in enumerate(uploads):
            if not isinstance(upload, UploadFile):
                raise APIRequestError(
                    "image must be a file upload (multipart file field), not text", param="image"
                )
            try:
                images.append(decode_image(await upload.read()))
            except ValueError as exc:
                name = f" ({upload.filename!r})" if upload.filename else ""
                raise APIRequestError(f"image {i}{name}: {exc}", param="image") from None
    return await _run_images(state, http, "image_edit", body, {"images": images})


async def _run_images(
    state: ServerState,
    http: HttpRequest,
    task: str,
    body: ImageGenerationRequest,
    extra: dict[str, Any],
) -> JSONResponse:
    """Run `body.n` requests of ``task`` (``extra`` added to their data); answer their images."""
    size = body.dimensions
    requests = []
    for i in range(body.n):
        data: dict[str, Any] = {"text": body.prompt, **extra}
        if body.seed is not None:
            data["seed"] = body.seed + i
        if size is not None:
            data["width"], data["height"] = size
        for field, key in (
            ("num_inference_steps", "num_timesteps"),
            ("guidance_scale", "guidance_scale"),
            ("think", "think"),
        ):
            if getattr(body, field) is not None:
                data[key] = getattr(body, field)
        requests.append(Request(task, data, f"{task}-{uuid.uuid4().hex}"))
    results = await run_to_end(state, http, requests)
    images = []
    for outputs in results:
        pictures = [o.data for o in outputs if o.modality == "image"]
        if not pictures:
            raise MStarError(f"model {state.name!r} finished an image request without an image")
        try:
            picture = encode_image(pictures[-1])  # whatever the model emits: bytes, PIL, tensors
        except ValueError as exc:
            raise MStarError(
                f"model {state.name!r} emitted an image that is no image: {exc}"
            ) from None
        if size is not None and (picture.width, picture.height) != size:
            raise APIRequestError(
                f"model {state.name!r} makes {picture.width}x{picture.height} images, not "
                f"{size[0]}x{size[1]}: "
                "omit size or send 'auto'",
                param="size",
            )
        images.append(
            {"b64_json": base64.b64encode(picture.png).decode("ascii"), "revised_prompt": None}
        )
    return JSONResponse({"created": int(time.time()), "data": images})
