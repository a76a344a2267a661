"""Native `POST /generate`: any task of the model, outputs streamed as NDJSON.

Request body: ``{"task": ..., "data": {...}, ...}``; top-level fields other than `model`,
`task`, `data`, `stream` and `audio_data` are request data too (so ``{"task": "speech",
"text": "hi"}`` works). A `prompt` becomes `text` for tasks other than "generate". Without
`task`, a model with one task runs that one.

Response (``application/x-ndjson``), one object per line (see `output_line`), in the order
produced; then ``{"usage": {"completion_tokens": n}, "finished": true}``; or, if the request
fails after the first line, ``{"error": {...}}``. With ``"stream": false`` the same lines
arrive in one body when the request ends.

A `text` or `prompt` longer than `ServerConfig.max_text_chars` (16,384 by default) is
refused with 400 naming the field. So is a request that cannot fit the model's KV cache
(prompt and ``max_tokens`` together; the cache may hold less than the model's own length),
with code ``context_length_exceeded``, as on the OpenAI routes.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response

from mstar.errors import APIRequestError, KVCacheCapacityError, MStarError, WalkExecutionError
from mstar.runtime.model import Request
from mstar.server.detokenize import IncrementalDetokenizer
from mstar.server.encoding import error_body, ndjson, output_line
from mstar.server.protocol import GenerateRequest
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
# Request data fields holding a prompt, in the order a model reads them.
_PROMPT_FIELDS = ("prompt_token_ids", "messages", "prompt", "text")


def _task(state: ServerState, body: GenerateRequest) -> str:
    if body.task is not None:
        state.check_task(body.task, param="task")
        return body.task
    if len(state.tasks) == 1:
        return state.tasks[0]
    raise APIRequestError(f"send a task: one of {', '.join(state.tasks)}", param="task")


async def _lines(stream: RequestStream, state: ServerState, with_audio: bool) -> AsyncIterator[bytes]:
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
        if name.rpartition(".")[2] in _TEXT_FIELDS and isinstance(value, str) and len(value) > limit:
            raise APIRequestError(
                f"{name} is {len(value)} characters long; at most {limit} are accepted", param=name, code="text_too_long"
            )


async def _does_not_fit(
    state: ServerState, body: GenerateRequest, data: dict[str, Any], exc: WalkExecutionError
) -> APIRequestError:
    """Describe a request its KV cache cannot hold as a 400 naming the field to change.

    The prompt's field when the prompt alone is too long (as far as the server can count it),
    else ``max_tokens`` (sent, or left to the model's default).
    """
    limit = await state.max_seq_len()
    inner = set(body.data.given())

    def name(key: str) -> str:
        return f"data.{key}" if key in inner else key

    num_prompt = _prompt_length(state, data)
    prompt_key = next((k for k in _PROMPT_FIELDS if k in data), None)
    reason = exc.reason.removeprefix(f"node raised {KVCacheCapacityError.__name__}: ")
    if prompt_key is not None and num_prompt is not None and limit is not None and num_prompt >= limit:
        param, fix = name(prompt_key), "shorten the prompt"
    else:
        param = name("max_tokens")
        room = f" to at most {limit - num_prompt}" if num_prompt is not None and limit is not None else ""
        fix = f"send max_tokens{room}" if "max_tokens" not in data else f"lower max_tokens{room}"
    holds = f"the KV cache holds {limit} tokens, prompt and completion together" if limit is not None else "the KV cache is full"
    return APIRequestError(f"{reason} ({holds}): {fix}", param=param, code="context_length_exceeded")


def _prompt_length(state: ServerState, data: dict[str, Any]) -> int | None:
    """Count the prompt's tokens where the server can (token ids, or a text its tokenizer reads)."""
    ids = data.get("prompt_token_ids")
    if isinstance(ids, list):
        return len(ids)
    tokenizer = state.tokenizer
    text = data.get("prompt", data.get("text"))
    if tokenizer is None or not isinstance(text, str):
        return None
    try:
        return len(tokenizer(text)["input_ids"])
    except Exception:  # a tokenizer of another shape: the count is only a hint
        return None


@router.post("/generate")
async def generate(body: GenerateRequest, http: HttpRequest) -> Response:
    """Run any task; stream its outputs as NDJSON."""
    state: ServerState = http.app.state.server
    state.check_model(body.model)
    task = _task(state, body)
    _check_text(body, state.config.max_text_chars)
    data: dict[str, Any] = body.request_data()
    if task != "generate" and "prompt" in data and "text" not in data:
        data["text"] = data.pop("prompt")
    request = Request(task, data, f"gen-{uuid.uuid4().hex}")
    try:
        stream = await open_stream(state, http, request, sample_rate=state.sample_rate)
    except WalkExecutionError as exc:
        if exc.cause != KVCacheCapacityError.__name__:
            raise
        raise await _does_not_fit(state, body, data, exc) from exc
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
