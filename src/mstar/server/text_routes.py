"""`POST /v1/chat/completions` and `POST /v1/completions` over a model's "generate" task.

As in vLLM, the server applies the chat template and tokenizes the prompt (so `usage` is
exact), sends the token ids to the engine, and turns the sampled ids back into text
incrementally, emitting only complete characters.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from mstar.errors import APIRequestError, MStarError
from mstar.runtime.model import Output, Request, SupportsTextOutput
from mstar.server.detokenize import IncrementalDetokenizer, StopStringMatcher
from mstar.server.encoding import SSE_DONE, error_body, sse, token_ids
from mstar.server.protocol import ChatCompletionRequest, CompletionRequest
from mstar.server.session import (
    EngineStreamingResponse,
    RequestStream,
    cancel_on_disconnect,
    open_stream,
)
from mstar.server.state import ServerState

__all__ = ["TextGeneration", "router"]

log = structlog.get_logger(__name__)

router = APIRouter()


class TextGeneration:
    """Follow one request's text outputs: text deltas, stop strings, finish reason, usage."""

    def __init__(self, model: SupportsTextOutput, prompt_tokens: int, stops: list[str], max_tokens: int | None) -> None:
        self.detokenizer = IncrementalDetokenizer(model.detokenize)
        self.stopper = StopStringMatcher(stops)
        self.eos_ids = frozenset(model.eos_token_ids)
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.num_tokens = 0
        self.last_token: int | None = None

    @property
    def is_stopped(self) -> bool:
        """Return whether a stop string ended the text."""
        return self.stopper.is_stopped

    def feed(self, out: Output) -> str:
        """Take one output; return the text it adds (empty for other modalities)."""
        if out.modality != "text" or self.is_stopped:
            return ""
        ids = token_ids(out.data)
        self.num_tokens += len(ids)
        if ids:
            self.last_token = ids[-1]
        return self.stopper.feed(self.detokenizer.add(ids))

    def finish(self) -> str:
        """Return the text held back at the end."""
        if self.is_stopped:
            return ""
        return self.stopper.feed(self.detokenizer.flush()) + self.stopper.flush()

    @property
    def finish_reason(self) -> str:
        """Return "stop" (end of turn or a stop string) or "length" (token limit)."""
        if self.is_stopped or self.last_token in self.eos_ids:
            return "stop"
        if self.max_tokens is not None and self.num_tokens < self.max_tokens:
            return "stop"
        return "length"

    def usage(self) -> dict[str, int]:
        """Return OpenAI's usage object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.num_tokens,
            "total_tokens": self.prompt_tokens + self.num_tokens,
        }


def _state(http: HttpRequest) -> ServerState:
    state: ServerState = http.app.state.server
    return state


def _text_model(state: ServerState) -> SupportsTextOutput:
    state.check_task("generate")
    text_model = state.text_model
    if text_model is None:
        raise APIRequestError(
            f"model {state.name!r} has no tokenizer: send token ids to the native /generate endpoint",
            code="no_tokenizer",
        )
    return text_model


def _chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template rejects the conversation (e.g. role order)
        raise APIRequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc
    return [int(i) for i in tokenizer(rendered, add_special_tokens=False)["input_ids"]]


async def _run(
    http: HttpRequest,
    state: ServerState,
    text_model: SupportsTextOutput,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    kind: str,
) -> Response:
    request_id = f"{kind}-{uuid.uuid4().hex}"
    data = {"prompt_token_ids": prompt_ids, **body.sampling_data(max_tokens)}
    gen = TextGeneration(text_model, len(prompt_ids), body.stop_strings, max_tokens)
    stream = await open_stream(state, http, Request("generate", data, request_id))
    meta = {"id": request_id, "created": int(time.time()), "model": state.name}
    if body.stream:
        events = _chat_events if kind == "chatcmpl" else _completion_events
        return EngineStreamingResponse(
            events(stream, gen, meta, body.include_usage), stream, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        text = await cancel_on_disconnect(http, _collect(stream, gen))
    finally:
        await stream.aclose()
    choice: dict[str, Any] = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
    if kind == "chatcmpl":
        choice["message"] = {"role": "assistant", "content": text}
        obj = "chat.completion"
    else:
        choice["text"] = text
        obj = "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": [choice], "usage": gen.usage()})


async def _collect(stream: RequestStream, gen: TextGeneration) -> str:
    parts: list[str] = []
    async with contextlib.aclosing(stream.outputs()) as outputs:
        async for out in outputs:
            parts.append(gen.feed(out))
            if gen.is_stopped:
                stream.complete()
                break
    parts.append(gen.finish())
    return "".join(parts)


async def _text_deltas(stream: RequestStream, gen: TextGeneration) -> AsyncIterator[str]:
    async with contextlib.aclosing(stream.outputs()) as outputs:
        async for out in outputs:
            text = gen.feed(out)
            if text:
                yield text
            if gen.is_stopped:
                stream.complete()
                break
    tail = gen.finish()
    if tail:
        yield tail


def _stream_error(exc: Exception) -> bytes:
    log.warning("stream_failed", error=str(exc), error_type=type(exc).__name__)
    kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
    return sse(error_body(str(exc), kind, code=500 if kind == "server_error" else 400))


async def _chat_events(
    stream: RequestStream, gen: TextGeneration, meta: dict[str, Any], include_usage: bool
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return sse({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for text in _text_deltas(stream, gen):
            yield chunk({"content": text})
        yield chunk({}, gen.finish_reason)
        if include_usage:
            yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": gen.usage()})
    except (MStarError, ValueError) as exc:
        yield _stream_error(exc)
    yield SSE_DONE


async def _completion_events(
    stream: RequestStream, gen: TextGeneration, meta: dict[str, Any], include_usage: bool
) -> AsyncIterator[bytes]:
    def chunk(text: str, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return sse({**meta, "object": "text_completion", "choices": [choice]})

    try:
        async for text in _text_deltas(stream, gen):
            yield chunk(text)
        yield chunk("", gen.finish_reason)
        if include_usage:
            yield sse({**meta, "object": "text_completion", "choices": [], "usage": gen.usage()})
    except (MStarError, ValueError) as exc:
        yield _stream_error(exc)
    yield SSE_DONE


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HttpRequest) -> Response:
    """Answer a chat; with `stream`, as server-sent events."""
    state = _state(http)
    state.check_model(body.model)
    text_model = _text_model(state)
    prompt_ids = _chat_prompt(text_model.tokenizer, body.chat())
    return await _run(http, state, text_model, body, prompt_ids, body.limit(), "chatcmpl")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
    """Continue a prompt (text or token ids); with `stream`, as server-sent events."""
    state = _state(http)
    state.check_model(body.model)
    text_model = _text_model(state)
    prompt = body.prompt_data()
    if "prompt_token_ids" in prompt:
        prompt_ids = list(prompt["prompt_token_ids"])
    else:
        prompt_ids = [int(i) for i in text_model.tokenizer(prompt["prompt"])["input_ids"]]
    return await _run(http, state, text_model, body, prompt_ids, body.max_tokens, "cmpl")
