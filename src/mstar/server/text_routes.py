"""`POST /v1/chat/completions` and `POST /v1/completions` over a model's "generate" task.

As in vLLM, the server applies the chat template and tokenizes the prompt (so `usage` is
exact), checks that the prompt and `max_tokens` fit the model's length (a 400 before any
token is generated; without `max_tokens`, the rest of the length), sends the token ids to the
engine, and turns the sampled ids back into text incrementally, emitting only complete
characters.

Each of the `n` choices is an engine request of its own, in a task of its own; the choices
of one prompt share its KV blocks (the engine forks them, see `KVTurn.prefix_group`), and
choice i with a `seed` draws from seed + i. A stream interleaves the choices' chunks.

A chat with ``modalities: ["text", "audio"]`` to a model with audio outputs (the assistant,
Qwen3-Omni) is answered as OpenAI's audio-output API answers: the text is the audio's
``transcript``, and the speech comes base64-encoded in ``audio.data`` (``pcm16`` chunks as
they are spoken in a stream, each delta also naming its ``sample_rate``; a whole ``wav`` or
``pcm16`` file otherwise), at 24 kHz whatever the model's own rate (`PcmResampler`). Models with
audio outputs get ``modalities`` in the request data,
so a text-only chat does not run their voice.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mstar.engines.sampler import TokenLogprobs
from mstar.errors import APIRequestError, MStarError
from mstar.runtime.model import Output, Request, SupportsTextOutput
from mstar.server.audio import OPENAI_SAMPLE_RATE, PcmResampler, wav_header
from mstar.server.detokenize import IncrementalDetokenizer, StopStringMatcher, TokenTexts
from mstar.server.encoding import SSE_DONE, error_body, sse, token_ids, token_logprobs
from mstar.server.protocol import ChatCompletionRequest, CompletionRequest
from mstar.server.session import RequestStream, cancel_on_disconnect, status_of
from mstar.server.state import ServerState

__all__ = ["TextGeneration", "router"]

log = structlog.get_logger(__name__)

router = APIRouter()


@dataclass
class Piece:
    """What one output adds to a choice: text, the log-probabilities of its tokens, or speech."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each token's offset in the choice's text
    pcm: bytes = b""  # 16-bit mono samples of an audio output

    def __bool__(self) -> bool:
        return bool(self.text or self.logprobs or self.pcm)


class TextGeneration:
    """Follow one choice's text outputs: text deltas, stop strings, log-probabilities, finish
    reason."""

    def __init__(
        self,
        model: SupportsTextOutput,
        prompt_tokens: int,
        stops: list[str],
        max_tokens: int | None,
        index: int = 0,
        audio: PcmResampler | None = None,
    ) -> None:
        self.index = index
        self.audio = audio  # a spoken answer's speech, at the served rate
        self.detokenizer = IncrementalDetokenizer(model.detokenize)
        self.stopper = StopStringMatcher(stops)
        self.eos_ids = frozenset(model.eos_token_ids)
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.num_tokens = 0
        self.last_token: int | None = None
        self.text_len = 0  # characters emitted so far

    @property
    def is_stopped(self) -> bool:
        """Return whether a stop string ended the text."""
        return self.stopper.is_stopped

    def feed(self, out: Output) -> Piece:
        """Take one output; return what it adds (nothing for other modalities)."""
        if out.modality == "audio" and not self.is_stopped and self.audio is not None:
            return Piece(pcm=self.audio.feed(out.data))
        if out.modality != "text" or self.is_stopped:
            return Piece()
        ids = token_ids(out.data)
        self.num_tokens += len(ids)
        if ids:
            self.last_token = ids[-1]
        logprobs = token_logprobs(out.data)
        offset = self.text_len
        text = self._emit(self.stopper.feed(self.detokenizer.add(ids)))
        if logprobs is None or (self.is_stopped and not text):
            return Piece(text)
        return Piece(text, [logprobs], [offset])

    def finish(self) -> Piece:
        """Return the text (and speech) held back at the end."""
        pcm = b"" if self.audio is None else self.audio.finish()
        if self.is_stopped:
            return Piece(pcm=pcm)
        return Piece(
            self._emit(self.stopper.feed(self.detokenizer.flush()) + self.stopper.flush()), pcm=pcm
        )

    def _emit(self, text: str) -> str:
        self.text_len += len(text)
        return text

    @property
    def finish_reason(self) -> str:
        """Return "stop" (end of turn or a stop string) or "length" (token limit)."""
        if self.is_stopped or self.last_token in self.eos_ids:
            return "stop"
        if self.max_tokens is not None and self.num_tokens < self.max_tokens:
            return "stop"
        return "length"


def _usage(prompt_tokens: int, gens: list[TextGeneration]) -> dict[str, int]:
    """Return OpenAI's usage object (the prompt counted once, every choice's tokens)."""
    completion = sum(g.num_tokens for g in gens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


# --- log-probabilities in OpenAI's two shapes ---------------------------------------------


def _chat_logprobs(texts: TokenTexts, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
    """Return chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, data = texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": data}

    content = []
    for lp in logprobs:
        top = [entry(t, x) for t, x in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
        content.append({**entry(lp.token_id, lp.logprob), "top_logprobs": top})
    return {"content": content}


def _completion_logprobs(
    texts: TokenTexts, logprobs: list[TokenLogprobs], offsets: list[int]
) -> dict[str, Any]:
    """Return legacy completions' ``logprobs``: tokens, token_logprobs, top_logprobs,
    text_offset."""
    top: list[dict[str, float] | None] = []
    for lp in logprobs:
        alternatives: dict[str, float] = {}
        for t, x in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
            alternatives.setdefault(
                texts(t)[0], x
            )  # tokens of one text (broken bytes): the likeliest
        top.append(alternatives or None)
    return {
        "tokens": [texts(lp.token_id)[0] for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": top,
        "text_offset": list(offsets),
    }


# --- running the choices --------------------------------------------------------------------

_END = object()  # a choice's last queue item when it ended cleanly


def _request_error(exc: BaseException) -> BaseException:
    """Return the error to answer: the model's rejection of a request (a ValueError) is a 400."""
    if isinstance(exc, ValueError) and not isinstance(exc, APIRequestError):
        return APIRequestError(str(exc))
    return exc


class _Choices:
    """The engine requests of one chat or completion (one per choice), each followed by a task.

    Each task starts its request (admission, then the first output), feeds its outputs to
    the choice's `TextGeneration` and queues what they add, so a stream can send whichever
    choice has something; a choice that ends or fails queues `_END` or its error.
    """

    def __init__(
        self,
        state: ServerState,
        requests: list[Request],
        gens: list[TextGeneration],
        sample_rate: int | None = None,
    ) -> None:
        self.state = state
        self.gens = gens
        self.sample_rate = sample_rate
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.started = [loop.create_future() for _ in requests]
        self.tasks = [asyncio.ensure_future(self._follow(i, r)) for i, r in enumerate(requests)]

    async def _follow(self, index: int, request: Request) -> None:
        stream = RequestStream(self.state, request, sample_rate=self.sample_rate)
        gen = self.gens[index]
        started = self.started[index]
        try:
            try:
                await stream.start()
            except BaseException as exc:
                await stream.aclose(status_of(exc))
                if isinstance(exc, asyncio.CancelledError):
                    started.cancel()
                    raise
                error = _request_error(exc)
                started.set_exception(error)
                started.exception()  # read here too: the route may be gone already
                raise error from None
            started.set_result(None)
            async with contextlib.aclosing(stream.outputs()) as outputs:
                async for out in outputs:
                    piece = gen.feed(out)
                    if piece:
                        self.queue.put_nowait((index, piece))
                    if gen.is_stopped:
                        stream.complete()
                        break
            tail = gen.finish()
            if tail:
                self.queue.put_nowait((index, tail))
            self.queue.put_nowait((index, _END))
        except Exception as exc:
            error = _request_error(exc)
            self.queue.put_nowait((index, error))
            raise error from exc
        finally:
            await stream.aclose()

    async def wait_started(self) -> None:
        """Wait for the first choice's first output; raise its error if it failed to start."""
        try:
            await asyncio.shield(self.started[0])
        except BaseException:
            await self.aclose()
            raise

    async def collect(self) -> list[Piece]:
        """Run every choice to its end; return each one's whole text and log-probabilities."""
        results = [Piece() for _ in self.gens]
        try:
            await asyncio.gather(*self.tasks)
        finally:
            await self.aclose()
        while not self.queue.empty():
            index, item = self.queue.get_nowait()
            if isinstance(item, Piece):
                whole = results[index]
                whole.text += item.text
                whole.logprobs += item.logprobs
                whole.offsets += item.offsets
                whole.pcm += item.pcm
        return results

    async def pieces(self) -> AsyncIterator[tuple[int, Piece | None]]:
        """Yield ``(choice, piece)`` as the choices produce them, and ``(choice, None)`` as each
        ends.

        Raises:
            MStarError | ValueError: A choice failed.
        """
        num_running = len(self.tasks)
        while num_running:
            index, item = await self.queue.get()
            if isinstance(item, Piece):
                yield index, item
            elif item is _END:
                num_running -= 1
                yield index, None
            else:
                raise item

    async def aclose(self) -> None:
        """Stop every choice still running (its engine request is aborted) and wait for them."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class _ChoicesResponse(StreamingResponse):
    """A streaming response that always ends its choices' engine requests (client gone or not)."""

    def __init__(self, content: AsyncIterator[bytes], choices: _Choices) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.choices.aclose()


# --- the routes -----------------------------------------------------------------------------


def _state(http: HttpRequest) -> ServerState:
    state: ServerState = http.app.state.server
    return state


def _text_model(state: ServerState) -> SupportsTextOutput:
    state.check_task("generate")
    text_model = state.text_model
    if text_model is None:
        raise APIRequestError(
            f"model {state.name!r} has no tokenizer: send token ids to the native /generate "
            "endpoint",
            code="no_tokenizer",
        )
    return text_model


def chat_prompt(text_model: SupportsTextOutput, messages: list[dict[str, str]]) -> list[int]:
    """Return the prompt ids of ``messages`` by the model's chat template (its system prompt
    first)."""
    tokenizer = text_model.tokenizer
    if text_model.system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": text_model.system_prompt}, *messages]
    try:
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # the template rejects the conversation (e.g. role order)
        raise APIRequestError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    return [int(i) for i in tokenizer(rendered, add_special_tokens=False)["input_ids"]]


async def _max_tokens(
    state: ServerState, num_prompt: int, requested: int | None, prompt_param: str, limit_param: str
) -> int | None:
    """Return the completion length: as requested, or the rest of the model's length.

    Raises:
        APIRequestError: The prompt, or the prompt and the requested tokens, exceed the model's
            length.
    """
    limit = state.max_seq_len
    if limit is None:
        return requested
    if num_prompt >= limit:
        raise APIRequestError(
            f"the prompt has {num_prompt} tokens but the model's length is {limit} tokens "
            "(prompt and completion together): shorten it",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return limit - num_prompt
    if num_prompt + requested > limit:
        raise APIRequestError(
            f"the model's length is {limit} tokens, but {num_prompt + requested} were requested "
            f"({num_prompt} in the prompt, {requested} in the completion): lower "
            f"{limit_param} to at most "
            f"{limit - num_prompt} or shorten the prompt",
            param=limit_param,
            code="context_length_exceeded",
        )
    return requested


async def _run(
    http: HttpRequest,
    state: ServerState,
    text_model: SupportsTextOutput,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    kind: str,
    media_messages: list[dict[str, Any]] | None = None,
) -> Response:
    request_id = f"{kind}-{uuid.uuid4().hex}"
    spoken = isinstance(body, ChatCompletionRequest) and body.with_audio
    requests, gens = [], []
    prompt: dict[str, Any] = (
        {"prompt_token_ids": prompt_ids} if media_messages is None else {"messages": media_messages}
    )
    for i in range(body.n):
        data: dict[str, Any] = {**prompt, **body.sampling_data(max_tokens, i)}
        if body.n > 1:
            data["prefix_group"], data["prefix_group_size"] = request_id, body.n
        if state.sample_rate is not None:  # a model that speaks: say whether to
            data["modalities"] = ["text", "audio"] if spoken else ["text"]
        requests.append(
            Request("generate", data, request_id if body.n == 1 else f"{request_id}-{i}")
        )
        audio = (
            PcmResampler(state.sample_rate, OPENAI_SAMPLE_RATE)
            if spoken and state.sample_rate
            else None
        )
        gens.append(
            TextGeneration(text_model, len(prompt_ids), body.stop_strings, max_tokens, i, audio)
        )
    texts = TokenTexts(text_model.tokenizer)
    meta = {"id": request_id, "created": int(time.time()), "model": state.name}
    rate = OPENAI_SAMPLE_RATE if spoken else None  # what the answer's speech is served at
    choices = _Choices(state, requests, gens, sample_rate=state.sample_rate if spoken else None)
    with_logprobs = body.num_logprobs is not None
    if body.stream:
        await cancel_on_disconnect(http, choices.wait_started())
        if spoken:
            assert rate is not None
            content = _spoken_chat_events(
                choices, texts, meta, body.include_usage, with_logprobs, rate
            )
        else:
            events = _chat_events if kind == "chatcmpl" else _completion_events
            content = events(choices, texts, meta, body.include_usage, with_logprobs)
        return _ChoicesResponse(content, choices)
    results = await cancel_on_disconnect(http, choices.collect())
    out = []
    for gen, piece in zip(gens, results, strict=True):
        choice: dict[str, Any] = {
            "index": gen.index,
            "finish_reason": gen.finish_reason,
            "logprobs": None,
        }
        if kind == "chatcmpl":
            choice["message"] = {"role": "assistant", "content": piece.text}
            if spoken:
                assert isinstance(body, ChatCompletionRequest) and rate is not None
                choice["message"] = {
                    "role": "assistant",
                    "content": None,
                    "audio": _spoken_answer(meta, piece, body.audio_format, rate),
                }
            if body.num_logprobs is not None:
                choice["logprobs"] = _chat_logprobs(texts, piece.logprobs)
        else:
            choice["text"] = piece.text
            if body.num_logprobs is not None:
                choice["logprobs"] = _completion_logprobs(texts, piece.logprobs, piece.offsets)
        out.append(choice)
    obj = "chat.completion" if kind == "chatcmpl" else "text_completion"
    return JSONResponse(
        {**meta, "object": obj, "choices": out, "usage": _usage(len(prompt_ids), gens)}
    )


def _stream_error(exc: Exception) -> bytes:
    log.warning("stream_failed", error=str(exc), error_type=type(exc).__name__)
    kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
    return sse(error_body(str(exc), kind, code=500 if kind == "server_error" else 400, exc=exc))


async def _chat_events(
    choices: _Choices,
    texts: TokenTexts,
    meta: dict[str, Any],
    include_usage: bool,
    with_logprobs: bool,
) -> AsyncIterator[bytes]:
    def chunk(
        index: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None
    ) -> bytes:
        choice = {
            "index": index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
        return sse({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    for gen in choices.gens:
        yield chunk(gen.index, {"role": "assistant", "content": ""})
    try:
        async for index, piece in choices.pieces():
            if piece is None:
                yield chunk(index, {}, choices.gens[index].finish_reason)
            else:
                logprobs = _chat_logprobs(texts, piece.logprobs) if with_logprobs else None
                yield chunk(index, {"content": piece.text}, logprobs=logprobs)
        if include_usage:
            usage = _usage(choices.gens[0].prompt_tokens, choices.gens)
            yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    except (MStarError, ValueError) as exc:
        yield _stream_error(exc)
    yield SSE_DONE


def _audio_id(meta: dict[str, Any]) -> str:
    return f"audio_{meta['id']}"


def _spoken_answer(
    meta: dict[str, Any], piece: Piece, audio_format: str, rate: int
) -> dict[str, Any]:
    """Return a whole spoken answer's ``message.audio`` (mstar keeps no audio: it expires at
    once)."""
    data = (
        piece.pcm
        if audio_format == "pcm16"
        else wav_header(rate, num_data_bytes=len(piece.pcm)) + piece.pcm
    )
    return {
        "id": _audio_id(meta),
        "expires_at": meta["created"],
        "data": base64.b64encode(data).decode("ascii"),
        "transcript": piece.text,
        "sample_rate": rate,
    }


async def _spoken_chat_events(
    choices: _Choices,
    texts: TokenTexts,
    meta: dict[str, Any],
    include_usage: bool,
    with_logprobs: bool,
    rate: int,
) -> AsyncIterator[bytes]:
    """Stream a spoken answer (one choice): transcript deltas and pcm16 chunks as they come."""
    audio_id = _audio_id(meta)

    def chunk(
        delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None
    ) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return sse({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    yield chunk({"role": "assistant", "content": None})
    try:
        async for _, piece in choices.pieces():
            if piece is None:
                yield chunk({"audio": {"id": audio_id, "expires_at": meta["created"]}})
                yield chunk({}, choices.gens[0].finish_reason)
                continue
            if piece.text or piece.logprobs:
                logprobs = _chat_logprobs(texts, piece.logprobs) if with_logprobs else None
                yield chunk(
                    {"audio": {"id": audio_id, "transcript": piece.text}}, logprobs=logprobs
                )
            if piece.pcm:
                data = base64.b64encode(piece.pcm).decode("ascii")
                yield chunk({"audio": {"id": audio_id, "data": data, "sample_rate": rate}})
        if include_usage:
            usage = _usage(choices.gens[0].prompt_tokens, choices.gens)
            yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    except (MStarError, ValueError) as exc:
        yield _stream_error(exc)
    yield SSE_DONE


async def _completion_events(
    choices: _Choices,
    texts: TokenTexts,
    meta: dict[str, Any],
    include_usage: bool,
    with_logprobs: bool,
) -> AsyncIterator[bytes]:
    def chunk(
        index: int, text: str, finish_reason: str | None = None, logprobs: Any = None
    ) -> bytes:
        choice = {
            "index": index,
            "text": text,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
        return sse({**meta, "object": "text_completion", "choices": [choice]})

    try:
        async for index, piece in choices.pieces():
            if piece is None:
                yield chunk(index, "", choices.gens[index].finish_reason)
            else:
                logprobs = (
                    _completion_logprobs(texts, piece.logprobs, piece.offsets)
                    if with_logprobs
                    else None
                )
                yield chunk(index, piece.text, logprobs=logprobs)
        if include_usage:
            usage = _usage(choices.gens[0].prompt_tokens, choices.gens)
            yield sse({**meta, "object": "text_completion", "choices": [], "usage": usage})
    except (MStarError, ValueError) as exc:
        yield _stream_error(exc)
    yield SSE_DONE


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HttpRequest) -> Response:
    """Answer a chat; with `stream`, as server-sent events."""
    state = _state(http)
    state.check_model(body.model)
    text_model = _text_model(state)
    if body.with_audio and state.sample_rate is None:
        raise APIRequestError(
            f'model {state.name!r} has no audio output: modalities can only be ["text"]',
            param="modalities",
        )
    prompt_ids = chat_prompt(text_model, body.chat())
    limit_param = (
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    )
    max_tokens = await _max_tokens(state, len(prompt_ids), body.limit(), "messages", limit_param)
    # Audio and image parts go to the model decoded, in their messages (it places and counts
    # their tokens); the prompt length checked and reported is then that of the text alone.
    media = await asyncio.to_thread(body.media_messages)
    return await _run(http, state, text_model, body, prompt_ids, max_tokens, "chatcmpl", media)


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
    max_tokens = await _max_tokens(state, len(prompt_ids), body.max_tokens, "prompt", "max_tokens")
    return await _run(http, state, text_model, body, prompt_ids, max_tokens, "cmpl")
