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
        """Return the message's text (its text parts joined).

        Raises:
            APIRequestError: A part is not text (this server's models read text only).
        """
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIRequestError(
                    f"content part of type {part.get('type')!r} is not supported: send text parts",
                    param=f"{where}.content.{i}",
                )
            texts.append(part["text"])
        return "".join(texts)


class ChatAudio(BaseModel):
    """`audio`: how a chat answer with ``modalities: ["text", "audio"]`` is spoken.

    ``pcm16`` is little-endian 16-bit mono at the model's rate (which mstar adds to each
    audio delta as ``sample_rate``; OpenAI's own is 24 kHz); streams send ``pcm16`` only, as
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
            raise _field_error(type(self), ("n",), "an answer with audio has one choice: n must be 1")
        if self.stream and self.audio_format != "pcm16":
            raise _field_error(type(self), ("audio", "format"), 'a stream carries audio as "pcm16" only')
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
        return data

    @field_validator("speed")
    @classmethod
    def _check_speed(cls, speed: float) -> float:
        if speed != 1.0:
            raise ValueError("only speed 1.0 is supported")
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
