"""Request bodies of the HTTP API (OpenAI-compatible, plus the native `/generate`).

Validation errors name the offending field (pydantic's location, e.g. ``messages.0.role``);
the server answers them with status 400 in OpenAI's error shape. Unknown fields are ignored,
as OpenAI's API does, except by `/generate`, which passes them to the model as request data.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mstar.errors import APIRequestError

__all__ = [
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


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None


class StreamOptions(BaseModel):
    """`stream_options`: whether the last event of a stream carries `usage`."""

    include_usage: bool = False


class _Sampling(_Body):
    """Sampling fields shared by chat and completions (vLLM's extensions included)."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _check_n(cls, n: int) -> int:
        if n != 1:
            raise ValueError("this server returns one choice per request: send n = 1")
        return n

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _check_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("not supported: use repetition_penalty, or leave this at 0")
        return value

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

    def sampling_data(self, max_tokens: int | None = None) -> dict[str, Any]:
        """Return the model's sampling keys that were given."""
        data: dict[str, Any] = {}
        for key in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
            value = getattr(self, key)
            if value is not None:
                data[key] = value
        limit = max_tokens if max_tokens is not None else self.max_tokens
        if limit is not None:
            data["max_tokens"] = limit
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


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None  # not supported

    def chat(self) -> list[dict[str, str]]:
        """Return the messages as plain role/content dicts (for a chat template)."""
        return [{"role": m.role, "content": m.text(f"messages.{i}")} for i, m in enumerate(self.messages)]

    def limit(self) -> int | None:
        """Return the requested completion length."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: one prompt, text or token ids."""

    prompt: str | list[int] | list[str] = Field(min_length=1)
    echo: Literal[False] | None = None  # not supported

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
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = None
    ignore_eos: bool | None = None

    def model_data(self) -> dict[str, Any]:
        """Return the speech model's request data: text, voice, instructions, sampling."""
        data: dict[str, Any] = {"text": self.input}
        for key in (
            "voice", "instructions", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed",
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
    seed: int | None = None

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


class GenerateRequest(BaseModel):
    """Native `POST /generate`: any task; fields other than these become request data."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    task: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)
    stream: bool = True
    audio_data: bool = Field(True, description="send audio samples (base64 PCM16), not only their count")

    def request_data(self) -> dict[str, Any]:
        """Return the model's request data: `data` plus every other top-level field."""
        return {**(self.model_extra or {}), **self.data}
