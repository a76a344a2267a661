"""`GET /v1/realtime`: OpenAI's Realtime API, a WebSocket conversation that hears and speaks.

The events are the ones the official `openai` client speaks (``client.realtime.connect``),
with the beta names accepted where they differ (``modalities``, ``voice``,
``input_audio_format``, ``max_response_output_tokens`` at the top of ``session.update``).

- ``session.update``: ``instructions``, ``output_modalities`` (``["text"]`` or ``["audio"]``:
  speech with its transcript), the voice, ``max_output_tokens``, audio formats (PCM16 at
  24 kHz in and out, ``{"type": "audio/pcm", "rate": 24000}`` or the beta ``"pcm16"``) and
  ``turn_detection``: null (the client commits turns and asks for responses) or
  ``server_vad`` (silero-vad hears the input: ``speech_started`` / ``speech_stopped``, the
  turn committed and answered; speech over an answer cancels it), with OpenAI's
  ``threshold``, ``prefix_padding_ms``, ``silence_duration_ms``, ``create_response`` and
  ``interrupt_response``.
- ``input_audio_buffer.append`` / ``commit`` / ``clear``; ``conversation.item.create`` (text or
  audio content), ``conversation.item.delete``, ``conversation.item.truncate`` (a spoken
  answer cut where the client stopped playing it: the rest of its audio and its transcript
  leave the conversation); ``response.create``, ``response.cancel``.

Which models: one that answers (a ``generate`` task and a tokenizer) answers the
conversation; a text-to-speech model (a ``speech`` task and audio output, no ``generate``)
speaks the latest user text turn, its transcript that text; any other is refused with HTTP
400. Audio input (the buffer, ``input_audio`` parts, server VAD) takes a model that hears
(`SupportsAudioInput`); elsewhere it is an ``error`` event naming the missing audio encoder.

A response runs the conversation (the instructions as its system turn, every item after) as
one request of the model's ``generate`` task, streaming ``response.output_text.delta`` or
``response.output_audio.delta`` (base64 PCM16, 24 kHz) with
``response.output_audio_transcript.delta``, then ``response.done`` with its usage. A cancel
stops it within an engine step and frees what it held (the request is aborted); the answer so
far stays in the conversation. A bad event gets an ``error`` event naming it (its
``event_id``) and the field; the session goes on. The server's limits (sessions at once, a
session's idle time with no response running, the largest event) end a session with an
``error`` event, then the close.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import soxr
import structlog
import torch
from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from mstar.errors import APIRequestError
from mstar.runtime.model import Output, Request, supports_audio_input
from mstar.server.audio import PcmResampler
from mstar.server.middleware import websocket_authorized
from mstar.server.protocol import AUDIO_INPUT_RATE
from mstar.server.session import RequestStream
from mstar.server.state import ServerState
from mstar.server.text_routes import Piece, TextGeneration, chat_prompt

__all__ = ["REALTIME_RATE", "RealtimeSession", "TurnDetector", "router"]

log = structlog.get_logger(__name__)

router = APIRouter()

REALTIME_RATE = 24_000
"""Sample rate of the PCM16 audio in and out (OpenAI's ``audio/pcm``)."""
_NORMAL = 1000
_POLICY_VIOLATION = 1008
_TOO_BIG = 1009
_TRY_AGAIN_LATER = 1013
_MAX_BUFFER_BYTES = 15 * 2**20  # OpenAI's cap on one append
_MIN_COMMIT_MS = 100


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def _pcm16(data: Any, param: str) -> bytes:
    """Decode base64 PCM16 (little-endian mono), or raise naming ``param``."""
    if not isinstance(data, str):
        raise APIRequestError("audio must be a base64 string of PCM16 samples", param=param)
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise APIRequestError(f"audio is not base64: {exc}", param=param) from None
    if len(raw) % 2:
        raise APIRequestError("PCM16 audio has an even number of bytes", param=param)
    return raw


def _speech_input(pcm: bytes) -> np.ndarray:
    """PCM16 at `REALTIME_RATE` -> float32 at the rate speech encoders read."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    return soxr.resample(samples, REALTIME_RATE, AUDIO_INPUT_RATE).astype(np.float32)


def _check_format(value: Any, param: str) -> None:
    """Accept PCM16 at 24 kHz: ``{"type": "audio/pcm", "rate": 24000}`` or the beta ``"pcm16"``."""
    if value in ("pcm16", None):
        return
    is_pcm = isinstance(value, dict) and value.get("type") == "audio/pcm"
    if is_pcm and value.get("rate", REALTIME_RATE) == REALTIME_RATE:
        return
    raise APIRequestError(f"only PCM16 at {REALTIME_RATE} Hz is served, got {value!r}", param=param)


class TurnDetector:
    """Server VAD: silero-vad over 16 kHz frames of 32 ms, with OpenAI's ``server_vad`` settings.

    Speech starts at the first frame whose probability reaches ``threshold`` (reported
    ``prefix_padding_ms`` earlier); it stops after ``silence_duration_ms`` of frames below it.
    """

    FRAME = 512  # samples at 16 kHz: the frame silero-vad reads

    def __init__(
        self,
        threshold: float = 0.5,
        prefix_padding_ms: int = 300,
        silence_duration_ms: int = 500,
        create_response: bool = True,
        interrupt_response: bool = True,
    ) -> None:
        from silero_vad import load_silero_vad

        self.threshold, self.prefix_padding_ms = threshold, prefix_padding_ms
        self.silence_duration_ms = silence_duration_ms
        self.create_response, self.interrupt_response = create_response, interrupt_response
        self.model = load_silero_vad(onnx=True)  # its own recurrent state, for this session
        self.resampler = soxr.ResampleStream(REALTIME_RATE, AUDIO_INPUT_RATE, 1, dtype="float32")
        self.pending = np.zeros(0, dtype=np.float32)
        self.num_frames = 0
        self.is_speaking = False
        self.silent_ms = 0

    @classmethod
    def of(cls, value: Any, param: str) -> TurnDetector:
        """Build one from a ``turn_detection`` object, or raise naming the bad field."""
        if not isinstance(value, dict) or value.get("type", "server_vad") != "server_vad":
            kind = value.get("type") if isinstance(value, dict) else value
            raise APIRequestError(
                f"turn_detection serves type 'server_vad' (or null), got {kind!r}",
                param=f"{param}.type",
            )
        settings: dict[str, Any] = {}
        for key, kind, lo, hi in (
            ("threshold", float, 0.0, 1.0),
            ("prefix_padding_ms", int, 0, 10_000),
            ("silence_duration_ms", int, 0, 10_000),
        ):
            given = value.get(key)
            if given is None:
                continue
            if (
                isinstance(given, bool)
                or not isinstance(given, int | float)
                or not lo <= given <= hi
            ):
                raise APIRequestError(
                    f"{key} must be in [{lo}, {hi}], got {given!r}", param=f"{param}.{key}"
                )
            settings[key] = kind(given)
        for key in ("create_response", "interrupt_response"):
            if key in value and not isinstance(value[key], bool):
                raise APIRequestError(f"{key} must be true or false", param=f"{param}.{key}")
            if key in value:
                settings[key] = value[key]
        return cls(**settings)

    def config(self) -> dict[str, Any]:
        """Return the settings as the session shows them."""
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }

    def feed(self, pcm: bytes) -> list[tuple[str, int]]:
        """Hear PCM16 at `REALTIME_RATE`; return ``("started" | "stopped", ms)`` in stream time."""
        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        self.pending = np.concatenate([self.pending, self.resampler.resample_chunk(samples)])
        events: list[tuple[str, int]] = []
        frame_ms = self.FRAME * 1000 // AUDIO_INPUT_RATE
        while self.pending.size >= self.FRAME:
            frame, self.pending = self.pending[: self.FRAME], self.pending[self.FRAME :]
            start_ms = self.num_frames * frame_ms
            self.num_frames += 1
            prob = float(
                self.model(torch.from_numpy(np.ascontiguousarray(frame)), AUDIO_INPUT_RATE)
            )
            if prob >= self.threshold:
                self.silent_ms = 0
                if not self.is_speaking:
                    self.is_speaking = True
                    events.append(("started", max(0, start_ms - self.prefix_padding_ms)))
            elif self.is_speaking:
                self.silent_ms += frame_ms
                if self.silent_ms >= self.silence_duration_ms:
                    self.is_speaking = False
                    events.append(("stopped", start_ms + frame_ms))
        return events


class RealtimeSession:
    """One client's conversation over its WebSocket (see the module docstring)."""

    def __init__(
        self, state: ServerState, websocket: WebSocket, *, reads_aloud: bool = False
    ) -> None:
        self.state = state
        self.websocket = websocket
        self.reads_aloud = reads_aloud  # a text-to-speech model: it speaks the user's text
        self.hears = supports_audio_input(state.model)
        speaks = state.sample_rate is not None
        self.id = _new_id("sess")
        self.instructions = ""
        self.output_modalities = ["audio"] if speaks else ["text"]
        self.voice: str | None = None
        self.max_output_tokens: int | None = None
        self.items: list[dict[str, Any]] = []  # the conversation, as the client sees it
        self.audio: dict[str, np.ndarray] = {}  # item id -> its input audio, as the model reads it
        self.spoken_ms: dict[str, int] = {}  # assistant item id -> the audio it sent, in ms
        self.buffer = bytearray()
        self.detector: TurnDetector | None = None  # server VAD, when the session asks for it
        self.speech_item: str | None = None  # the item the speech being heard will become
        self.response: asyncio.Task[None] | None = None
        self._cancel_reason = "client_cancelled"
        self._send_lock = asyncio.Lock()
        self._handlers: dict[str, Callable[[dict[str, Any]], Coroutine[Any, Any, None]]] = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
            "conversation.item.create": self._item_create,
            "conversation.item.delete": self._item_delete,
            "conversation.item.truncate": self._item_truncate,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
        }

    # -- the wire ----------------------------------------------------------------------------

    async def send(self, event: dict[str, Any]) -> None:
        """Send one server event (a closed socket drops it)."""
        event = {"event_id": _new_id("event"), **event}
        async with self._send_lock:
            if self.websocket.client_state is not WebSocketState.CONNECTED:
                return
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                await self.websocket.send_text(json.dumps(event, separators=(",", ":")))

    async def error(
        self,
        message: str,
        *,
        param: str | None = None,
        event_id: Any = None,
        code: str | None = None,
    ) -> None:
        """Send an ``error`` event about the client's event ``event_id``."""
        error = {"type": "invalid_request_error", "code": code, "message": message, "param": param}
        await self.send({"type": "error", "error": {**error, "event_id": event_id}})

    async def run(self) -> None:
        """Serve the session until the client leaves, idles past the server's timeout or sends
        an event past its size limit; then stop its response."""
        config = self.state.config
        await self.send({"type": "session.created", "session": self.session()})
        try:
            while True:
                try:
                    async with asyncio.timeout(config.realtime_idle_timeout_s):
                        message = await self.websocket.receive()
                except TimeoutError:
                    if self.response is not None and not self.response.done():
                        continue  # the client listens to an answer: not idle
                    await self.error(
                        f"no event for {config.realtime_idle_timeout_s:g} s: the session ends",
                        code="session_idle_timeout",
                    )
                    await self._close(_NORMAL, "idle timeout")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                size = len(text.encode()) if text is not None else len(message.get("bytes") or b"")
                if size > config.max_realtime_event_bytes:
                    await self.error(
                        f"the event has {size} bytes, more than this server's "
                        f"{config.max_realtime_event_bytes}: send audio in smaller appends",
                        code="event_too_large",
                    )
                    await self._close(_TOO_BIG, "event too large")
                    return
                await self.handle(text)
        except WebSocketDisconnect:
            return
        finally:
            await self._stop_response()

    async def _close(self, code: int, reason: str) -> None:
        async with self._send_lock:
            if self.websocket.client_state is WebSocketState.CONNECTED:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await self.websocket.close(code=code, reason=reason)

    async def handle(self, text: str | None) -> None:
        """Dispatch one client event; a bad one gets an ``error`` event, the session goes on."""
        try:
            event = json.loads(text) if text is not None else None
        except json.JSONDecodeError as exc:
            await self.error(f"an event is a JSON object: {exc}", code="invalid_json")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            await self.error("an event is a JSON object with a string 'type'", param="type")
            return
        handler = self._handlers.get(event["type"])
        event_id = event.get("event_id")
        if handler is None:
            known = ", ".join(sorted(self._handlers))
            await self.error(
                f"unknown event type {event['type']!r} (served: {known})",
                param="type",
                event_id=event_id,
                code="unknown_event",
            )
            return
        try:
            await handler(event)
        except APIRequestError as exc:
            await self.error(str(exc), param=exc.param, event_id=event_id, code=exc.code)
        except ValueError as exc:
            await self.error(str(exc), event_id=event_id)

    # -- the session -------------------------------------------------------------------------

    def session(self) -> dict[str, Any]:
        """Return the session's configuration, as ``session.created`` shows it."""
        pcm = {"type": "audio/pcm", "rate": REALTIME_RATE}
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.state.name,
            "instructions": self.instructions,
            "output_modalities": list(self.output_modalities),
            "max_output_tokens": "inf"
            if self.max_output_tokens is None
            else self.max_output_tokens,
            "audio": {
                "input": {
                    "format": pcm,
                    "turn_detection": None if self.detector is None else self.detector.config(),
                },
                "output": {"format": pcm, "voice": self.voice or "default"},
            },
        }

    async def _session_update(self, event: dict[str, Any]) -> None:
        session = event.get("session")
        if not isinstance(session, dict):
            raise APIRequestError("session.update needs a 'session' object", param="session")
        instructions = session.get("instructions", self.instructions)
        if not isinstance(instructions, str):
            raise APIRequestError("instructions must be a string", param="session.instructions")
        key = "output_modalities" if "output_modalities" in session else "modalities"
        modalities = self._modalities(session.get(key, self.output_modalities), f"session.{key}")
        audio = session.get("audio") or {}
        if not isinstance(audio, dict):
            raise APIRequestError("audio must be an object", param="session.audio")
        inputs, outputs = audio.get("input") or {}, audio.get("output") or {}
        _check_format(inputs.get("format"), "session.audio.input.format")
        _check_format(session.get("input_audio_format"), "session.input_audio_format")
        _check_format(outputs.get("format"), "session.audio.output.format")
        _check_format(session.get("output_audio_format"), "session.output_audio_format")
        where = "session.audio.input.turn_detection"
        if "turn_detection" in session:  # the beta name
            where, inputs = "session.turn_detection", {"turn_detection": session["turn_detection"]}
        detector = self.detector
        if "turn_detection" in inputs:
            detection = inputs["turn_detection"]
            if detection is not None:
                self._check_hears(where)
            detector = None if detection is None else TurnDetector.of(detection, where)
        voice = outputs.get("voice", session.get("voice", self.voice))
        if voice is not None and not isinstance(voice, str):
            raise APIRequestError("voice must be a string", param="session.audio.output.voice")
        key = (
            "max_output_tokens" if "max_output_tokens" in session else "max_response_output_tokens"
        )
        limit = self._max_tokens(session.get(key, self.max_output_tokens), f"session.{key}")
        self.instructions, self.output_modalities = instructions, modalities
        self.detector = detector
        self.voice, self.max_output_tokens = voice, limit
        await self.send({"type": "session.updated", "session": self.session()})

    def _modalities(self, value: Any, param: str) -> list[str]:
        if not isinstance(value, list) or not value or not set(value) <= {"text", "audio"}:
            raise APIRequestError(
                f'output_modalities must be ["text"] or ["audio"], got {value!r}', param=param
            )
        if "audio" in value and self.state.sample_rate is None:
            raise APIRequestError(f"model {self.state.name!r} does not speak", param=param)
        if "audio" not in value and self.reads_aloud:
            raise APIRequestError(
                f'model {self.state.name!r} reads text aloud: output_modalities must be ["audio"]',
                param=param,
            )
        return ["audio"] if "audio" in value else ["text"]

    def _check_hears(self, param: str) -> None:
        if not self.hears:
            raise APIRequestError(
                f"model {self.state.name!r} has no audio encoder: it takes text turns "
                "(input_text) only",
                param=param,
                code="audio_input_not_supported",
            )

    @staticmethod
    def _max_tokens(value: Any, param: str) -> int | None:
        if value is None or value == "inf":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            raise APIRequestError(
                f"max output tokens must be 1 to 4096 or 'inf', got {value!r}", param=param
            )
        return value

    # -- the input audio buffer --------------------------------------------------------------

    async def _append(self, event: dict[str, Any]) -> None:
        self._check_hears("audio")
        pcm = _pcm16(event.get("audio"), "audio")
        if len(self.buffer) + len(pcm) > _MAX_BUFFER_BYTES:
            raise APIRequestError(
                "the input audio buffer holds 15 MiB at most: commit or clear it", param="audio"
            )
        self.buffer += pcm
        if self.detector is None:
            return
        for kind, ms in self.detector.feed(pcm):
            if kind == "started":
                self.speech_item = _new_id("item")
                await self.send(
                    {
                        "type": "input_audio_buffer.speech_started",
                        "audio_start_ms": ms,
                        "item_id": self.speech_item,
                    }
                )
                if self.detector.interrupt_response and self.response is not None:
                    await self._stop_response("turn_detected")  # the user speaks over the answer
                continue
            await self.send(
                {
                    "type": "input_audio_buffer.speech_stopped",
                    "audio_end_ms": ms,
                    "item_id": self.speech_item,
                }
            )
            await self._commit({})
            if self.detector.create_response:
                await self._response_create({})

    async def _commit(self, event: dict[str, Any]) -> None:
        ms = len(self.buffer) // 2 * 1000 // REALTIME_RATE
        if ms < _MIN_COMMIT_MS:
            raise APIRequestError(
                f"the input audio buffer holds {ms} ms; commit needs {_MIN_COMMIT_MS} ms at least",
                code="input_audio_buffer_commit_empty",
            )
        pcm, self.buffer = bytes(self.buffer), bytearray()
        item_id, self.speech_item = self.speech_item or _new_id("item"), None
        item = {
            "id": item_id,
            "type": "message",
            "role": "user",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        self.audio[item_id] = _speech_input(pcm)
        previous = self.items[-1]["id"] if self.items else None
        await self.send(
            {
                "type": "input_audio_buffer.committed",
                "previous_item_id": previous,
                "item_id": item["id"],
            }
        )
        await self._add_item(item)

    async def _clear(self, event: dict[str, Any]) -> None:
        self.buffer = bytearray()
        await self.send({"type": "input_audio_buffer.cleared"})

    # -- the conversation --------------------------------------------------------------------

    async def _item_create(self, event: dict[str, Any]) -> None:
        item = event.get("item")
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise APIRequestError("items are messages: {'type': 'message', ...}", param="item.type")
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise APIRequestError(
                f"role must be user, assistant or system, got {role!r}", param="item.role"
            )
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise APIRequestError("content must be a list of parts", param="item.content")
        parts: list[dict[str, Any]] = []
        audio: list[np.ndarray] = []
        for i, part in enumerate(content):
            where = f"item.content.{i}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
                parts.append({"type": kind, "text": part["text"]})
            elif kind == "input_audio" and role == "user":
                self._check_hears(f"{where}.type")
                audio.append(_speech_input(_pcm16(part.get("audio"), f"{where}.audio")))
                parts.append({"type": "input_audio", "transcript": part.get("transcript")})
            else:
                raise APIRequestError(
                    f"content part {kind!r} is not served here: send input_text (or "
                    "input_audio in a user turn)",
                    param=f"{where}.type",
                )
        stored = {"id": item.get("id") or _new_id("item"), "type": "message", "role": role}
        stored["content"] = parts
        if any(i["id"] == stored["id"] for i in self.items):
            raise APIRequestError(f"item {stored['id']!r} exists", param="item.id")
        if audio:
            self.audio[stored["id"]] = np.concatenate(audio)
        await self._add_item(stored)

    async def _add_item(self, item: dict[str, Any]) -> None:
        previous = self.items[-1]["id"] if self.items else None
        self.items.append(item)
        shown = {**item, "object": "realtime.item", "status": "completed"}
        await self.send(
            {"type": "conversation.item.added", "previous_item_id": previous, "item": shown}
        )
        await self.send(
            {"type": "conversation.item.done", "previous_item_id": previous, "item": shown}
        )

    async def _item_delete(self, event: dict[str, Any]) -> None:
        item_id = event.get("item_id")
        if not any(i["id"] == item_id for i in self.items):
            raise APIRequestError(f"no item {item_id!r} in the conversation", param="item_id")
        self.items = [i for i in self.items if i["id"] != item_id]
        self.audio.pop(item_id, None)  # type: ignore[arg-type]
        self.spoken_ms.pop(item_id, None)  # type: ignore[arg-type]
        await self.send({"type": "conversation.item.deleted", "item_id": item_id})

    async def _item_truncate(self, event: dict[str, Any]) -> None:
        """Cut an assistant's spoken answer where the client stopped playing it: the rest of its
        audio and its transcript leave the conversation (as OpenAI's server does, the text
        the user may not have heard goes)."""
        item_id = event.get("item_id")
        item = next((i for i in self.items if i["id"] == item_id), None)
        if item is None:
            raise APIRequestError(f"no item {item_id!r} in the conversation", param="item_id")
        if item["role"] != "assistant" or item_id not in self.spoken_ms:
            raise APIRequestError(
                f"item {item_id!r} is not a spoken assistant answer: only those are truncated",
                param="item_id",
            )
        if event.get("content_index", 0) != 0:
            raise APIRequestError(
                "an answer has one content part: content_index must be 0", param="content_index"
            )
        end = event.get("audio_end_ms")
        spoken = self.spoken_ms[item_id]
        if not isinstance(end, int) or isinstance(end, bool) or not 0 <= end <= spoken:
            raise APIRequestError(
                f"audio_end_ms must be an integer in [0, {spoken}] (the answer's audio), "
                f"got {end!r}",
                param="audio_end_ms",
            )
        self.spoken_ms[item_id] = end
        item["content"] = [{"type": "output_audio", "transcript": ""}]
        await self.send(
            {
                "type": "conversation.item.truncated",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": end,
            }
        )

    def messages(self, instructions: str) -> list[dict[str, Any]]:
        """Return the conversation as the model's messages (audio as float samples)."""
        out: list[dict[str, Any]] = []
        if instructions:
            out.append({"role": "system", "content": instructions})
        for item in self.items:
            parts: list[dict[str, Any]] = []
            for part in item["content"]:
                if part["type"] == "input_audio":
                    parts.append({"type": "audio", "audio": self.audio[item["id"]]})
                elif part.get("text") or part.get("transcript"):
                    parts.append({"type": "text", "text": part.get("text") or part["transcript"]})
            if item["role"] != "user" or not any(p["type"] == "audio" for p in parts):
                parts = [{"type": "text", "text": "".join(p.get("text", "") for p in parts)}]
                out.append({"role": item["role"], "content": parts[0]["text"]})
            else:
                out.append({"role": item["role"], "content": parts})
        return out

    # -- responses ---------------------------------------------------------------------------

    async def _response_create(self, event: dict[str, Any]) -> None:
        if self.response is not None and not self.response.done():
            raise APIRequestError(
                "the conversation has an active response: cancel it or wait for response.done",
                code="conversation_already_has_active_response",
            )
        options = event.get("response") or {}
        if not isinstance(options, dict):
            raise APIRequestError("response must be an object", param="response")
        key = "output_modalities" if "output_modalities" in options else "modalities"
        modalities = self._modalities(options.get(key, self.output_modalities), f"response.{key}")
        instructions = options.get("instructions", self.instructions)
        if not isinstance(instructions, str):
            raise APIRequestError("instructions must be a string", param="response.instructions")
        key = (
            "max_output_tokens" if "max_output_tokens" in options else "max_response_output_tokens"
        )
        limit = self._max_tokens(options.get(key, self.max_output_tokens), f"response.{key}")
        if not any(i["role"] == "user" for i in self.items):
            raise APIRequestError("the conversation has no user turn to answer", param="response")
        state = self.state
        if self.reads_aloud:
            await self._read_aloud(modalities)
            return
        await state.check_length(limit, param=f"response.{key}")  # the model's published length
        text_model = state.text_model
        if text_model is None:
            raise APIRequestError(f"model {state.name!r} has no tokenizer to answer with text")
        speaks = modalities == ["audio"]
        data: dict[str, Any] = {}
        messages = self.messages(instructions)
        if state.sample_rate is not None or self.audio:  # the model takes messages with media
            data["messages"] = messages
            data["modalities"] = ["text", "audio"] if speaks else ["text"]
        else:
            data["prompt_token_ids"] = chat_prompt(text_model, messages)
        num_prompt = len(data.get("prompt_token_ids", ()))
        if self.voice is not None and speaks:
            data["voice"] = self.voice
        if limit is not None:
            data["max_tokens"] = limit
        resampler = (
            PcmResampler(state.sample_rate, REALTIME_RATE) if speaks and state.sample_rate else None
        )
        gen = TextGeneration(text_model, num_prompt, [], limit, 0, resampler)
        self.response = asyncio.create_task(self._respond("generate", data, gen, modalities))

    async def _read_aloud(self, modalities: list[str]) -> None:
        """Speak the latest user text turn (a text-to-speech model's response)."""
        text = next(
            (
                "".join(p.get("text") or "" for p in item["content"])
                for item in reversed(self.items)
                if item["role"] == "user"
            ),
            "",
        )
        if not text.strip():
            raise APIRequestError(
                f"model {self.state.name!r} reads the latest user turn aloud: it has no text",
                param="response",
            )
        data: dict[str, Any] = {"text": text}
        if self.voice is not None:
            data["voice"] = self.voice
        assert self.state.sample_rate is not None
        reader = _ReadAloud(text, PcmResampler(self.state.sample_rate, REALTIME_RATE))
        self.response = asyncio.create_task(self._respond("speech", data, reader, modalities))

    async def _response_cancel(self, event: dict[str, Any]) -> None:
        if self.response is None or self.response.done():
            raise APIRequestError(
                "there is no active response to cancel", code="response_cancel_not_active"
            )
        await self._stop_response()

    async def _stop_response(self, reason: str = "client_cancelled") -> None:
        task, self.response = self.response, None
        if task is not None and not task.done():
            self._cancel_reason = reason
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _respond(
        self,
        task: str,
        data: dict[str, Any],
        gen: TextGeneration | _ReadAloud,
        modalities: list[str],
    ) -> None:
        """Run one response: stream its deltas, then ``response.done`` (also when cancelled)."""
        state = self.state
        speaks = modalities == ["audio"]
        response_id, item_id = _new_id("resp"), _new_id("item")
        base = {
            "response_id": response_id,
            "item_id": item_id,
            "output_index": 0,
            "content_index": 0,
        }
        response: dict[str, Any] = {
            "object": "realtime.response",
            "id": response_id,
            "status": "in_progress",
            "output_modalities": modalities,
            "output": [],
            "usage": None,
        }
        item: dict[str, Any] = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        part: dict[str, Any] = (
            {"type": "output_audio", "transcript": ""}
            if speaks
            else {"type": "output_text", "text": ""}
        )
        await self.send({"type": "response.created", "response": response})
        await self.send(
            {
                "type": "response.output_item.added",
                "response_id": response_id,
                "output_index": 0,
                "item": item,
            }
        )
        await self.send({"type": "response.content_part.added", **base, "part": part})
        text_event = "response.output_audio_transcript" if speaks else "response.output_text"
        texts: list[str] = []
        spoken_bytes = 0
        status = "completed"
        details: dict[str, Any] | None = None
        stream = RequestStream(
            state,
            Request(task, data, f"realtime-{response_id}"),
            sample_rate=state.sample_rate,
        )
        try:
            await stream.start()
            async for out in stream.outputs():
                piece = gen.feed(out)
                spoken_bytes += len(piece.pcm)
                await self._deltas(piece.text, piece.pcm, base, text_event, texts)
            piece = gen.finish()
            spoken_bytes += len(piece.pcm)
            await self._deltas(piece.text, piece.pcm, base, text_event, texts)
        except asyncio.CancelledError:
            status, details = "cancelled", {"type": "cancelled", "reason": self._cancel_reason}
        except Exception as exc:  # the request failed: the session goes on
            status = "failed"
            details = {"type": "failed", "error": {"type": "server_error", "message": str(exc)}}
            log.warning("realtime_response_failed", error=str(exc), error_type=type(exc).__name__)
            await self.error(
                str(exc), param=exc.param if isinstance(exc, APIRequestError) else None
            )
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose("aborted" if status == "cancelled" else None)
        text = "".join(texts)
        if speaks:
            await self.send({"type": "response.output_audio.done", **base})
            await self.send(
                {"type": "response.output_audio_transcript.done", **base, "transcript": text}
            )
            part = {"type": "output_audio", "transcript": text}
        else:
            await self.send({"type": "response.output_text.done", **base, "text": text})
            part = {"type": "output_text", "text": text}
        await self.send({"type": "response.content_part.done", **base, "part": part})
        item = {
            **item,
            "status": "completed" if status == "completed" else "incomplete",
            "content": [part],
        }
        await self.send(
            {
                "type": "response.output_item.done",
                "response_id": response_id,
                "output_index": 0,
                "item": item,
            }
        )
        # The answer (as far as it got) is the conversation's next turn.
        self.items.append(
            {"id": item_id, "type": "message", "role": "assistant", "content": [part]}
        )
        if speaks:
            self.spoken_ms[item_id] = spoken_bytes * 1000 // (2 * REALTIME_RATE)
        # Input tokens are counted where the server made the prompt (a text model's chat
        # template); a model that takes the messages itself counts its own.
        usage = {"output_tokens": gen.num_tokens, "total_tokens": gen.num_tokens}
        if isinstance(gen, TextGeneration) and gen.prompt_tokens:
            usage["input_tokens"] = gen.prompt_tokens
            usage["total_tokens"] += gen.prompt_tokens
        response = {
            **response,
            "status": status,
            "status_details": details,
            "output": [item],
            "usage": usage,
        }
        await self.send({"type": "response.done", "response": response})

    async def _deltas(
        self, text: str, pcm: bytes, base: dict[str, Any], text_event: str, texts: list[str]
    ) -> None:
        if pcm:
            delta = base64.b64encode(pcm).decode("ascii")
            await self.send({"type": "response.output_audio.delta", **base, "delta": delta})
        if text:
            texts.append(text)
            await self.send({"type": f"{text_event}.delta", **base, "delta": text})


class _ReadAloud:
    """A read-aloud response's pieces, as `TextGeneration` gives an answer's: the text itself
    as the transcript (at once), then its speech."""

    num_tokens = 0  # no text is generated

    def __init__(self, text: str, audio: PcmResampler) -> None:
        self._text, self._audio = text, audio

    def feed(self, out: Output) -> Piece:
        text, self._text = self._text, ""
        return Piece(text, pcm=self._audio.feed(out.data) if out.modality == "audio" else b"")

    def finish(self) -> Piece:
        text, self._text = self._text, ""
        return Piece(text, pcm=self._audio.finish())


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket, model: str | None = None) -> None:
    """Serve one Realtime session (see the module docstring).

    Without the server's key the upgrade is refused (HTTP 403); a model or task this server
    does not serve gets an ``error`` event naming ``model``, then the socket closes (1008);
    a session past `ServerConfig.max_realtime_sessions` gets one too, then close 1013.
    """
    state: ServerState = websocket.app.state.server
    if not websocket_authorized(websocket, state.config.api_key, schemes=("bearer",)):
        await websocket.close(code=_POLICY_VIOLATION, reason="missing or invalid API key")
        return
    answers = "generate" in state.tasks and state.text_model is not None
    reads_aloud = not answers and "speech" in state.tasks and state.sample_rate is not None
    if not (answers or reads_aloud):
        message = (
            f"model {state.name!r} neither answers (a generate task with text output) nor "
            "speaks text (a speech task with audio output): /v1/realtime does not serve it"
        )
        error = {"message": message, "type": "invalid_request_error", "code": "unsupported_model"}
        with contextlib.suppress(RuntimeError):  # a server without denial responses: 403
            await websocket.send_denial_response(JSONResponse({"error": error}, status_code=400))
            return
        await websocket.close(code=_POLICY_VIOLATION, reason=message[:120])
        return
    await websocket.accept()
    session = RealtimeSession(state, websocket, reads_aloud=reads_aloud)
    try:
        state.check_model(model)
    except APIRequestError as exc:
        await session.error(str(exc), param="model", code=exc.code)
        await websocket.close(code=_POLICY_VIOLATION, reason=str(exc)[:120])
        return
    if state.num_realtime_sessions >= state.config.max_realtime_sessions:
        limit = state.config.max_realtime_sessions
        await session.error(
            f"this server holds {limit} realtime sessions at most: retry later",
            code="session_limit_reached",
        )
        await websocket.close(code=_TRY_AGAIN_LATER, reason="session limit reached")
        return
    state.num_realtime_sessions += 1
    log.info("realtime_session_opened", model=state.name, session=session.id)
    try:
        await session.run()
    finally:
        state.num_realtime_sessions -= 1
