"""Native `POST /generate`: any task of the model, outputs streamed as NDJSON.

Request body: ``{"task": ..., "data": {...}, ...}``; top-level fields other than `model`,
`task`, `data`, `stream` and `audio_data` are request data too (so ``{"task": "speech",
"text": "hi"}`` works). A `prompt` becomes `text` for tasks other than "generate". Without
`task`, a model with one task runs that one. JSON has no images: a ``data:image/png;base64,``
(or JPEG) string anywhere in the data reaches the model as a uint8 RGB ``[H, W, 3]`` array
(what `mstar.client.image_url` makes of an array or PIL image).

Response (``application/x-ndjson``), one object per line (see `output_line`), in the order
produced; then ``{"usage": {"completion_tokens": n}, "finished": true}``; or, if the request
fails after the first line, ``{"error": {...}}``. With ``"stream": false`` the same lines
arrive in one body when the request ends.

A `text` or `prompt` longer than `ServerConfig.max_text_chars` (16,384 by default) is
refused with 400 naming the field. So is a request that cannot fit the model's KV cache
(prompt and ``max_tokens`` together; the cache may hold less than the model's own length),
with code ``context_length_exceeded`` and `param` ``max_tokens`` (``data.max_tokens`` when
sent in `data`) or the prompt's field, as on the OpenAI routes: checked before the request
runs, as far as the server can count the prompt, and again by the model and its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response

from mstar.errors import APIRequestError, MStarError
from mstar.runtime.model import Request
from mstar.server.detokenize import IncrementalDetokenizer
from mstar.server.encoding import error_body, ndjson, output_line
from mstar.server.protocol import GenerateRequest, decode_image_url
from mstar.server.session import (
    EngineStreamingResponse,
    RequestStream,
    cancel_on_disconnect,
    open_stream,
)
from mstar.server.state import ServerState

__all__ = ["router"]

log = structlog.get_logger(__name__)

router = APIRouter()

NDJSON = "application/x-ndjson"
# Request data fields holding text for the model (capped by `ServerConfig.max_text_chars`).
_TEXT_FIELDS = frozenset({"text", "prompt"})
# Request data strings that are images (decoded to arrays before the model sees them); the
# text fields are text, whatever they start with.
_IMAGE_URL = re.compile(r"data:image/[a-z0-9.+-]+;base64,", re.IGNORECASE)
# Request data fields holding a prompt, in the order a model reads them.
_PROMPT_FIELDS = ("prompt_token_ids", "messages", "prompt", "text")


def _task(state: ServerState, body: GenerateRequest) -> str:
    if body.task is not None:
        state.check_task(body.task, param="task")
        return body.task
    if len(state.tasks) == 1:
        return state.tasks[0]
    raise APIRequestError(f"send a task: one of {', '.join(state.tasks)}", param="task")


async def _lines(
    stream: RequestStream, state: ServerState, with_audio: bool
) -> AsyncIterator[bytes]:
    text_model = state.text_model
    detokenizer = None if text_model is None else IncrementalDetokenizer(text_model.detokenize)
    num_tokens = 0
    try:
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for out in outputs:
                line = output_line(out, sample_rate=state.sample_rate, with_audio=with_audio)
                if out.modality == "text":
                    num_tokens += line["num_tokens"]
                    if detokenizer is not None:
                        line["text"] = detokenizer.add(line["token_ids"])
                yield ndjson(line)
        if detokenizer is not None and (tail := detokenizer.flush()):
            yield ndjson({"modality": "text", "text": tail, "token_ids": [], "num_tokens": 0})
        yield ndjson({"usage": {"completion_tokens": num_tokens}, "finished": True})
    except (MStarError, ValueError) as exc:
        log.warning("stream_failed", error=str(exc), error_type=type(exc).__name__)
        kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
        yield ndjson(error_body(str(exc), kind, exc=exc))


def _check_text(body: GenerateRequest, limit: int) -> None:
    """Refuse a text longer than ``limit`` characters, naming the field it came in."""
    data = body.data
    inner = data if isinstance(data, dict) else (data.model_extra or {})
    fields = [(f"data.{k}", v) for k, v in inner.items()] + list((body.model_extra or {}).items())
    for name, value in fields:
        if (
            name.rpartition(".")[2] in _TEXT_FIELDS
            and isinstance(value, str)
            and len(value) > limit
        ):
            raise APIRequestError(
                f"{name} is {len(value)} characters long; at most {limit} are accepted",
                param=name,
                code="text_too_long",
            )


async def _check_length(state: ServerState, body: GenerateRequest, data: dict[str, Any]) -> str:
    """Refuse a request that cannot fit the model's length before it runs; return the name of
    its ``max_tokens`` field (``data.max_tokens`` when sent in `data`), for later refusals.

    The prompt's field is named when the prompt alone is too long, as far as the server can
    count it (token ids, or a text its tokenizer reads).
    """
    inner = set(body.data.given())

    def name(key: str) -> str:
        return f"data.{key}" if key in inner else key

    prompt_key = next((k for k in _PROMPT_FIELDS if k in data), None)
    await state.check_length(
        data.get("max_tokens"),
        param=name("max_tokens"),
        num_prompt=_prompt_length(state, data),
        prompt_param=None if prompt_key is None else name(prompt_key),
    )
    return name("max_tokens")


def _has_image_url(value: Any) -> bool:
    if isinstance(value, str):
        return _IMAGE_URL.match(value) is not None
    if isinstance(value, dict):
        return any(_has_image_url(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_image_url(v) for v in value)
    return False


def _decode_images(data: dict[str, Any], inner: set[str]) -> dict[str, Any]:
    """Return request data with its image data URLs decoded (``inner``: the keys sent in `data`)."""
    return {
        k: v if k in _TEXT_FIELDS else _decode_image_urls(v, f"data.{k}" if k in inner else k)
        for k, v in data.items()
    }


def _decode_image_urls(value: Any, name: str) -> Any:
    """Return ``value`` with every ``data:image/...;base64,`` string decoded to a uint8 RGB
    array."""
    if isinstance(value, str) and _IMAGE_URL.match(value) is not None:
        try:
            return decode_image_url(value)
        except ValueError as exc:
            raise APIRequestError(f"{name}: {exc}", param=name) from None
    if isinstance(value, dict):
        return {k: _decode_image_urls(v, f"{name}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_image_urls(v, f"{name}.{i}") for i, v in enumerate(value)]
    return value


def _prompt_length(state: ServerState, data: dict[str, Any]) -> int | None:
    """Count the prompt's tokens where the server can (token ids, or at least the tokens of a
    text)."""
    ids = data.get("prompt_token_ids")
    if isinstance(ids, list):
        return len(ids)
    text = data.get("prompt", data.get("text"))
    return state.count_prompt(text) if isinstance(text, str) else None


@router.post("/generate")
async def generate(body: GenerateRequest, http: HttpRequest) -> Response:
    """Run any task; stream its outputs as NDJSON."""
    state: ServerState = http.app.state.server
    state.check_model(body.model)
    task = _task(state, body)
    _check_text(body, state.config.max_text_chars)
    data: dict[str, Any] = body.request_data()
    length_param = await _check_length(state, body, data)
    if any(_has_image_url(v) for k, v in data.items() if k not in _TEXT_FIELDS):
        # slow: off the loop
        data = await asyncio.to_thread(_decode_images, data, set(body.data.given()))
    if task != "generate" and "prompt" in data and "text" not in data:
        data["text"] = data.pop("prompt")
    request = Request(task, data, f"gen-{uuid.uuid4().hex}")
    stream = await open_stream(
        state, http, request, sample_rate=state.sample_rate, length_param=length_param
    )
    lines = _lines(stream, state, body.audio_data)
    if body.stream:
        return EngineStreamingResponse(lines, stream, media_type=NDJSON)

    async def collect() -> bytes:
        return b"".join([line async for line in lines])

    try:
        content = await cancel_on_disconnect(http, collect())
    finally:
        await stream.aclose()
    return Response(content, media_type=NDJSON)
