"""Request bodies of the HTTP API (OpenAI-compatible, plus the native `/generate`).

Validation errors name the offending field (pydantic's location, e.g. ``messages.0.role``);
the server answers them with status 400 in OpenAI's error shape. Unknown fields are ignored,
as OpenAI's API does, except by `/generate`, which passes them to the model as request data.

Numbers are checked as JSON numbers (no strings, booleans, NaN or infinities; seeds fit in
64 bits), and no text anywhere in a body may hold a lone UTF-16 surrogate (``"\\ud800"`` is
valid JSON but no valid text, and no tokenizer can read it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from mstar.engines.sampling_params import MAX_LOGPROBS, SEED_RANGE
from mstar.errors import APIRequestError

__all__ = [
    "MAX_CHOICES",
    "ChatAudio",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerateRequest",
    "ImageEditRequest",
    "ImageGenerationRequest",
    "SpeechRequest",
    "StreamOptions",
    "decode_image_url",
]

_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")

MAX_CHOICES = 16
"""The most choices (`n`) one chat or completion request may ask for."""

Seed = Annotated[int, Field(strict=True, ge=SEED_RANGE[0], lt=SEED_RANGE[1])]
Real = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Count = Annotated[int, Field(strict=True)]

_NATIVE_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "ignore_eos",
)


def _surrogates(value: Any, loc: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Yield the location of every string (or key) in a JSON value that holds a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            yield loc
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _surrogates(key, (*loc, str(key)))
            yield from _surrogates(item, (*loc, str(key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _surrogates(item, (*loc, i))


def _field_error(cls: type[BaseModel], loc: tuple[str | int, ...], message: str) -> ValidationError:
    """Return a validation error of the field at ``loc``."""
    error = PydanticCustomError("invalid_field", message)
    return ValidationError.from_exception_data(
        cls.__name__, [InitErrorDetails(type=error, loc=loc, input=None)]
    )


def _check_text(cls: type[BaseModel], data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
    """Reject a body holding invalid text (with the field's location), then validate it."""
    bad = list(_surrogates(data))
    if bad:
        error = PydanticCustomError(
            "invalid_text", "text holds a lone surrogate (\\ud800-\\udfff): send valid Unicode"
        )
        raise ValidationError.from_exception_data(
            cls.__name__, [InitErrorDetails(type=error, loc=loc, input=None) for loc in bad]
        )
    return handler(data)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _valid_text(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        return _check_text(cls, data, handler)


class StreamOptions(BaseModel):
    """`stream_options`: whether the last event of a stream carries `usage`."""

    include_usage: bool = False


class _Sampling(_Body):
    """Sampling fields shared by chat and completions (vLLM's extensions included).

    ``seed`` null means no seed, as OpenAI's schema allows.
    """

    max_tokens: Count | None = Field(None, ge=1)
    temperature: Real | None = Field(None, ge=0.0, le=2.0)
    top_p: Real | None = Field(None, gt=0.0, le=1.0)
    top_k: Count | None = Field(None, ge=0)
    repetition_penalty: Real | None = Field(None, gt=0.0)
    seed: Seed | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    n: Count = Field(1, ge=1, le=MAX_CHOICES)
    frequency_penalty: Real = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: Real = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop strings")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        """Return the stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Return whether a stream ends with a usage event."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        """Return how many alternatives to report per token (None: no log-probabilities)."""
        return None

    def sampling_data(self, max_tokens: int | None, choice: int = 0) -> dict[str, Any]:
        """Return the model's sampling keys for choice number ``choice`` (its own seed)."""
        data: dict[str, Any] = {} if max_tokens is None else {"max_tokens": max_tokens}
        for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
            value = getattr(self, key)
            if value is not None:
                data[key] = value
        for key in ("presence_penalty", "frequency_penalty"):
            if getattr(self, key):
                data[key] = getattr(self, key)
        if self.seed is not None:
            # Each choice draws from its own stream: seed, seed + 1, ... (wrapping within 64 bits).
            low, high = SEED_RANGE
            data["seed"] = (self.seed + choice - low) % (high - low) + low
        if self.num_logprobs is not None:
            data["logprobs"] = self.num_logprobs
        if self.ignore_eos:
            data["ignore_eos"] = True
        return data


class ChatMessage(BaseModel):
    """One chat message; content is text or a list of content parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, where: str) -> str:
        """Return the message's text (its text parts joined; media parts are left out).

        Raises:
            APIRequestError: A part is neither text nor media.
        """
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for i, part in enumerate(self.content):
            if part.get("type") in _MEDIA_PARTS:
                continue
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIRequestError(
                    f"content part of type {part.get('type')!r} is not supported: send text, "
                    "input_audio or image_url parts",
                    param=f"{where}.content.{i}",
                )
            texts.append(part["text"])
        return "".join(texts)

    @property
    def has_media(self) -> bool:
        """Return whether the message holds audio or image parts."""
        return isinstance(self.content, list) and any(
            p.get("type") in _MEDIA_PARTS for p in self.content
        )

    def parts(self, where: str) -> list[dict[str, Any]]:
        """Return the content as model parts: text, audio (float32 16 kHz mono) and image (uint8 H x
        W x 3).

        ``input_audio`` takes ``{"data": base64 WAV, "format": "wav"}``; ``image_url`` takes a
        ``data:image/...;base64,`` URL (nothing is fetched).

        Raises:
            APIRequestError: A part cannot be decoded (naming it).
        """
        if self.content is None or isinstance(self.content, str):
            return [{"type": "text", "text": self.content or ""}]
        out: list[dict[str, Any]] = []
        for i, part in enumerate(self.content):
            param = f"{where}.content.{i}"
            kind = part.get("type")
            try:
                if kind == "input_audio":
                    out.append({"type": "audio", "audio": _decode_audio(part.get("input_audio"))})
                elif kind == "image_url":
                    out.append({"type": "image", "image": decode_image_url(part.get("image_url"))})
                else:
                    out.append({"type": "text", "text": part.get("text", "")})
            except ValueError as exc:
                raise APIRequestError(
                    f"content part {kind!r} cannot be read: {exc}", param=param
                ) from None
        self.text(where)  # checks the other parts
        return out


class ChatAudio(BaseModel):
    """`audio`: how a chat answer with ``modalities: ["text", "audio"]`` is spoken.

    ``pcm16`` is little-endian 16-bit mono at 24 kHz, the rate OpenAI clients play (the
    model's audio resampled; each audio delta names it as ``sample_rate``); streams send ``pcm16``
    only, as
    OpenAI's API does. The voice is the model's own (the assistant has one).
    """

    model_config = ConfigDict(extra="ignore")

    voice: str | None = None
    format: Literal["wav", "pcm16"] = "pcm16"


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Count | None = Field(None, ge=0, le=MAX_LOGPROBS)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudio | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _field_error(type(self), ("top_logprobs",), "top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _check_audio(self) -> ChatCompletionRequest:
        if self.modalities is not None and "text" not in self.modalities:
            raise _field_error(type(self), ("modalities",), 'modalities must include "text"')
        if not self.with_audio:
            return self
        if self.n > 1:
            raise _field_error(
                type(self), ("n",), "an answer with audio has one choice: n must be 1"
            )
        if self.stream and self.audio_format != "pcm16":
            raise _field_error(
                type(self), ("audio", "format"), 'a stream carries audio as "pcm16" only'
            )
        return self

    @property
    def with_audio(self) -> bool:
        """Return whether the answer is spoken too (``modalities`` holds "audio")."""
        return self.modalities is not None and "audio" in self.modalities

    @property
    def audio_format(self) -> str:
        """Return the spoken answer's format: ``audio.format``, or pcm16."""
        return self.audio.format if self.audio is not None else "pcm16"

    @property
    def num_logprobs(self) -> int | None:
        """Return how many alternatives to report per token (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, str]]:
        """Return the messages as plain role/content dicts (for a chat template)."""
        return [
            {"role": m.role, "content": m.text(f"messages.{i}")}
            for i, m in enumerate(self.messages)
        ]

    def media_messages(self) -> list[dict[str, Any]] | None:
        """Return the messages with decoded media parts, or None when every message is text."""
        if not any(m.has_media for m in self.messages):
            return None
        return [
            {"role": m.role, "content": m.parts(f"messages.{i}")}
            for i, m in enumerate(self.messages)
        ]

    def limit(self) -> int | None:
        """Return the requested completion length."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: one prompt, text or token ids."""

    prompt: str | list[Count] | list[str] = Field(min_length=1)
    echo: Literal[False] | None = None  # not supported
    logprobs: Count | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        """Return how many alternatives to report per token (None: no log-probabilities)."""
        return self.logprobs

    def prompt_data(self) -> dict[str, Any]:
        """Return the prompt as the model's request data.

        Raises:
            APIRequestError: More than one prompt.
        """
        if isinstance(self.prompt, str):
            return {"prompt": self.prompt}
        if all(isinstance(p, str) for p in self.prompt):
            if len(self.prompt) != 1:
                raise APIRequestError("send one prompt per request", param="prompt")
            return {"prompt": self.prompt[0]}
        return {"prompt_token_ids": list(self.prompt)}


class SpeechRequest(_Body):
    """`POST /v1/audio/speech`."""

    input: str = Field(min_length=1, max_length=16_384)
    voice: str | None = None
    instructions: str | None = None
    response_format: Literal["wav", "pcm"] = "wav"
    speed: float = 1.0
    stream: bool = False
    stream_format: Literal["audio", "sse"] | None = None
    # Sampling of the speech model's token generation (extensions, as vLLM's).
    max_tokens: Count | None = Field(None, ge=1)
    temperature: Real | None = Field(None, ge=0.0, le=2.0)
    top_p: Real | None = Field(None, gt=0.0, le=1.0)
    top_k: Count | None = Field(None, ge=0)
    repetition_penalty: Real | None = Field(None, gt=0.0)
    seed: Seed | None = None
    ignore_eos: bool | None = None

    def model_data(self) -> dict[str, Any]:
        """Return the speech model's request data: text, voice, instructions, sampling."""
        data: dict[str, Any] = {"text": self.input}
        for key in (
            "voice",
            "instructions",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "repetition_penalty",
            "seed",
            "ignore_eos",
        ):
            value = getattr(self, key)
            if value is not None:
                data[key] = value
        # the model's option where its speech task declares one (the route checks)
        if self.speed != 1.0:
            data["speed"] = self.speed
        return data

    @field_validator("speed")
    @classmethod
    def _check_speed(cls, speed: float) -> float:
        if not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be in [0.25, 4.0] (OpenAI's range), got {speed}")
        return speed

    @property
    def is_streamed(self) -> bool:
        """Return whether audio goes out as it is produced."""
        return self.stream or self.stream_format is not None


class ImageGenerationRequest(_Body):
    """`POST /v1/images/generations`."""

    prompt: str = Field(min_length=1, max_length=16_384)
    n: int = Field(1, ge=1, le=8)
    size: str | None = None
    response_format: Literal["b64_json"] = "b64_json"
    seed: Annotated[int, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1] - 2 * MAX_CHOICES)] | None = (
        None  # form fields are text
    )
    # Diffusion settings of models that have them (sent as request data only when given):
    # flow steps, the guidance scale(s) (a model says how many it takes) and think mode.
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | list[float] | None = None
    think: bool | None = None

    @field_validator("size")
    @classmethod
    def _check_size(cls, size: str | None) -> str | None:
        if size is not None and size != "auto" and not _SIZE.match(size):
            raise ValueError("size must be 'auto' or WIDTHxHEIGHT, e.g. 512x512")
        return size

    @property
    def dimensions(self) -> tuple[int, int] | None:
        """Return the requested (width, height), or None for the model's own."""
        match = _SIZE.match(self.size or "")
        return (int(match[1]), int(match[2])) if match else None


class ImageEditRequest(ImageGenerationRequest):
    """The form fields of `POST /v1/images/edits` (the images travel as files beside them)."""

    output_format: Literal["png"] | None = None


class _NativeSampling(BaseModel):
    """The sampling fields of `/generate`, checked wherever they are sent (top level or in `data`).

    Left out, a field takes the model's default; null is not a value for any of them.
    """

    model_config = ConfigDict(extra="allow")

    max_tokens: Count | None = Field(None, ge=1)
    temperature: Real | None = Field(None, ge=0.0)
    top_p: Real | None = Field(None, gt=0.0, le=1.0)
    top_k: Count | None = Field(None, ge=0)
    repetition_penalty: Real | None = Field(None, gt=0.0)
    presence_penalty: Real | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Real | None = Field(None, ge=-2.0, le=2.0)
    seed: Seed | None = None
    logprobs: Count | None = Field(None, ge=0, le=MAX_LOGPROBS)
    ignore_eos: bool | None = None

    @field_validator(*_NATIVE_SAMPLING, mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        if value is None:
            raise ValueError(
                "null is not a value here: send one, or leave the field out for the model's default"
            )
        return value

    def given(self) -> dict[str, Any]:
        """Return the fields that were sent (sampling fields and any others)."""
        return self.model_dump(exclude_unset=True)


class GenerateRequest(_NativeSampling):
    """Native `POST /generate`: any task; fields other than these become request data."""

    model: str | None = None
    task: str | None = None
    data: _NativeSampling = Field(default_factory=lambda: _NativeSampling.model_validate({}))
    stream: bool = True
    audio_data: bool = Field(
        True, description="send audio samples (base64 PCM16), not only their count"
    )

    @model_validator(mode="wrap")
    @classmethod
    def _valid_text(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        return _check_text(cls, data, handler)

    def request_data(self) -> dict[str, Any]:
        """Return the model's request data: `data` plus every other top-level field."""
        own = {"model", "task", "data", "stream", "audio_data"}
        top = {k: v for k, v in self.given().items() if k not in own}
        return {**top, **self.data.given()}


_MEDIA_PARTS = frozenset({"input_audio", "image_url"})
AUDIO_INPUT_RATE = 16_000
"""Sample rate audio parts are resampled to (what speech encoders read)."""


def _decode_audio(value: Any) -> Any:
    """Decode an ``input_audio`` object (base64 WAV, PCM16 or float) to float32 mono at 16 kHz."""
    import base64
    import binascii
    import io
    import wave

    import numpy as np

    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise ValueError('input_audio must be {"data": base64, "format": "wav"}')
    if value.get("format", "wav") != "wav":
        raise ValueError("only wav input_audio is supported")
    try:
        raw = base64.b64decode(value["data"], validate=True)
        with wave.open(io.BytesIO(raw)) as wav:
            rate, channels, width = wav.getframerate(), wav.getnchannels(), wav.getsampwidth()
            frames = wav.readframes(wav.getnframes())
    except (binascii.Error, wave.Error, EOFError) as exc:
        raise ValueError(f"not a base64 WAV file ({exc})") from None
    if width != 2:
        raise ValueError(f"WAV samples must be 16-bit, got {8 * width}-bit")
    samples = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    samples = samples.reshape(-1, channels).mean(axis=1)
    if rate != AUDIO_INPUT_RATE and samples.size:
        times = np.arange(int(samples.size * AUDIO_INPUT_RATE / rate)) * (rate / AUDIO_INPUT_RATE)
        samples = np.interp(times, np.arange(samples.size), samples).astype(np.float32)
    return samples


def decode_image_url(value: Any) -> Any:
    """Decode an ``image_url`` data URL (or ``{"url": ...}``) to uint8 RGB ``[H, W, 3]``.

    Raises:
        ValueError: Not a ``data:image/...;base64,`` URL of a PNG or JPEG image.
    """
    import base64
    import binascii

    import numpy as np

    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise ValueError(
            "image_url must be a data:image/...;base64, URL (remote URLs are not fetched)"
        )
    from mstar.server.images import decode_image

    try:
        data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except binascii.Error as exc:
        raise ValueError(f"bad base64 ({exc})") from None
    image = decode_image(data)
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    return np.ascontiguousarray(image[:, :, :3])
