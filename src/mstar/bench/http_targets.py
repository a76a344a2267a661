"""HTTP targets: OpenAI speech / chat / images, and the native NDJSON `/generate`.

Each target owns one `httpx.AsyncClient` (no connection limit, so the load generator, not
the pool, sets concurrency) and maps a `BenchRequest` to its endpoint's JSON body:
base fields, then the target's `extra_body`, then the request's `params` (later wins).
A non-2xx answer, an `error` object in a stream, or malformed bytes fail the request with
`BenchTargetError`.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, Self

import httpx

from mstar.bench.audio import AudioFormat, PcmFrameCounter, WavStreamReader
from mstar.bench.records import BenchRequest, OutputEvent, Usage
from mstar.bench.targets import TargetItem
from mstar.errors import BenchConfigError, BenchTargetError

__all__ = [
    "ChatTarget",
    "GenerateTarget",
    "HttpTarget",
    "ImagesTarget",
    "SpeechTarget",
]


class HttpTarget:
    """Shared plumbing of the HTTP targets: client lifetime, request bodies, status checks."""

    path = "/"

    def __init__(
        self,
        base_url: str,
        *,
        name: str = "server",
        model: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise BenchConfigError(f"base URL {base_url!r} must start with http:// or https://")
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.extra_body = dict(extra_body or {})
        self._headers = dict(headers or {})
        self._timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Self:
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=self._headers,
            timeout=httpx.Timeout(self._timeout_s, connect=min(self._timeout_s, 30.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        """The open client; raises if the target is used outside `async with`."""
        if self._client is None:
            raise BenchTargetError(f"target {self.name!r} is not open; use `async with target:`")
        return self._client

    def body(self, request: BenchRequest) -> dict[str, Any]:
        """Return the JSON body for `request`."""
        body = self.base_body(request)
        if self.model is not None:
            body.setdefault("model", self.model)
        if request.max_tokens is not None:
            body.setdefault("max_tokens", request.max_tokens)
        if request.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        body.update(request.params)
        return body

    def base_body(self, request: BenchRequest) -> dict[str, Any]:
        """Return the endpoint's own fields for `request` (overridden per endpoint)."""
        return {"prompt": request.prompt}

    async def stream(self, request: BenchRequest) -> AsyncIterator[TargetItem]:
        """Send `request`; yield output events as the response arrives."""
        async with self.client.stream("POST", self.path, json=self.body(request)) as response:
            await _raise_for_status(response)
            async for item in self.parse(response):
                yield item

    def parse(self, response: httpx.Response) -> AsyncIterator[TargetItem]:
        """Turn a successful streaming response into events (overridden per endpoint)."""
        raise NotImplementedError


async def _raise_for_status(response: httpx.Response) -> None:
    if response.is_success:
        return
    text = (await response.aread()).decode("utf-8", "replace")
    raise BenchTargetError(f"HTTP {response.status_code} from {response.url}: {text[:300]}")


def _json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise BenchTargetError(f"malformed JSON from {where}: {line[:200]!r}") from exc


def _check_error(obj: Any, where: str) -> None:
    if isinstance(obj, dict) and obj.get("error"):
        raise BenchTargetError(f"error from {where}: {obj['error']}")


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BenchTargetError(f"malformed base64 from {where}") from exc


class SpeechTarget(HttpTarget):
    """`POST /v1/audio/speech`, streaming raw PCM16 or WAV; counts frames from the bytes.

    Args:
        voice: The `voice` field.
        response_format: "pcm" (raw little-endian PCM16, mono unless `channels` says
            otherwise, at `sample_rate`) or "wav" (the header's format wins).
        sample_rate: Frames per second of raw PCM; 24 kHz by default.
        channels: Channels of raw PCM.
        stream: Send `"stream": true` (a server that streams by default ignores it).
    """

    path = "/v1/audio/speech"

    def __init__(
        self,
        base_url: str,
        *,
        voice: str = "default",
        response_format: str = "pcm",
        sample_rate: int = 24_000,
        channels: int = 1,
        stream: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(base_url, **kwargs)
        if response_format not in ("pcm", "wav"):
            raise BenchConfigError(
                f"speech response_format {response_format!r}: use 'pcm' or 'wav' "
                "(compressed formats cannot be counted in samples while streaming)"
            )
        self.voice = voice
        self.response_format = response_format
        self.pcm_format = AudioFormat(sample_rate=sample_rate, channels=channels)
        self.stream_flag = stream

    def base_body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input": request.prompt,
            "voice": self.voice,
            "response_format": self.response_format,
        }
        if self.stream_flag:
            body["stream"] = True
        return body

    async def parse(self, response: httpx.Response) -> AsyncIterator[TargetItem]:
        if self.response_format == "pcm":
            counter = PcmFrameCounter(self.pcm_format)
            async for data in response.aiter_bytes():
                frames = counter.feed(data)
                if frames:
                    yield OutputEvent(
                        "audio",
                        num_samples=frames,
                        sample_rate=self.pcm_format.sample_rate,
                        num_bytes=len(data),
                    )
            counter.finish()
            return
        reader = WavStreamReader()
        async for data in response.aiter_bytes():
            frames = reader.feed(data)
            if frames:
                assert reader.format is not None
                yield OutputEvent(
                    "audio",
                    num_samples=frames,
                    sample_rate=reader.format.sample_rate,
                    num_bytes=len(data),
                )
        reader.finish()


class ChatTarget(HttpTarget):
    """`POST /v1/chat/completions` with `stream: true`; reads the server-sent events.

    Each non-empty `delta.content` is one text chunk counted as one token; the final `usage`
    (requested with `stream_options.include_usage`) gives the exact token count when the
    server sends it. `delta.audio.data` (base64 PCM16 at `sample_rate`) becomes audio.
    """

    path = "/v1/chat/completions"

    def __init__(self, base_url: str, *, sample_rate: int = 24_000, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.audio_format = AudioFormat(sample_rate=sample_rate)

    def base_body(self, request: BenchRequest) -> dict[str, Any]:
        return {
            "messages": [{"role": "user", "content": request.prompt}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def parse(self, response: httpx.Response) -> AsyncIterator[TargetItem]:
        where = str(response.url)
        data_lines: list[str] = []
        done = False
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                data_lines.append(line[5:].removeprefix(" "))
                continue
            if line or not data_lines:
                continue  # comments, other fields, keep-alive blank lines
            payload = "\n".join(data_lines)
            data_lines = []
            if payload == "[DONE]":
                done = True
                break
            for item in self._events(_json_line(payload, where), where):
                yield item
        if not done and data_lines and data_lines[-1] == "[DONE]":
            done = True
        if not done:
            raise BenchTargetError(f"chat stream from {where} ended without `data: [DONE]`")

    def _events(self, obj: Any, where: str) -> list[TargetItem]:
        _check_error(obj, where)
        items: list[TargetItem] = []
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                items.append(
                    OutputEvent("text", num_tokens=1, num_bytes=len(content.encode("utf-8")))
                )
            audio = delta.get("audio") or {}
            if audio.get("data"):
                pcm = _b64(audio["data"], where)
                counter = PcmFrameCounter(self.audio_format)
                frames = counter.feed(pcm)
                counter.finish()
                items.append(
                    OutputEvent(
                        "audio",
                        num_samples=frames,
                        sample_rate=self.audio_format.sample_rate,
                        num_bytes=len(pcm),
                    )
                )
        usage = obj.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            items.append(Usage(int(usage["completion_tokens"]), usage.get("prompt_tokens")))
        return items


class ImagesTarget(HttpTarget):
    """`POST /v1/images/generations`; each image of the answer is one image event.

    The answer arrives whole, so every image of a request gets the time the body completed.
    """

    path = "/v1/images/generations"

    def __init__(
        self, base_url: str, *, n: int = 1, size: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(base_url, **kwargs)
        if n < 1:
            raise BenchConfigError(f"images per request must be >= 1, got {n}")
        self.n = n
        self.size = size

    def base_body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": request.prompt,
            "n": self.n,
            "response_format": "b64_json",
        }
        if self.size is not None:
            body["size"] = self.size
        return body

    async def parse(self, response: httpx.Response) -> AsyncIterator[TargetItem]:
        where = str(response.url)
        obj = _json_line((await response.aread()).decode("utf-8", "replace"), where)
        _check_error(obj, where)
        images = obj.get("data") if isinstance(obj, dict) else None
        if not isinstance(images, list) or not images:
            raise BenchTargetError(f"images answer from {where} has no `data` list")
        for image in images:
            if image.get("b64_json"):
                num_bytes = len(_b64(image["b64_json"], where))
            elif image.get("url"):
                num_bytes = 0
            else:
                raise BenchTargetError(f"image from {where} has neither `b64_json` nor `url`")
            yield OutputEvent("image", num_images=1, num_bytes=num_bytes)


class GenerateTarget(HttpTarget):
    """Native `POST /generate`, answered with NDJSON: one JSON object per line.

    Fields read from each line:

    - `error`: fails the request;
    - `usage`: `{"completion_tokens": n}` (or `num_output_tokens`) sets the token count;
    - `modality`: one of text/audio/image/video/action/latent; lines without it (e.g. a
      final `{"finished": true}`) carry no output;
    - text: `num_tokens`, else `len(token_ids)`, else 1 token per line;
    - audio: `num_samples` and `sample_rate`, or base64 PCM16 `data` with `sample_rate`
      (the target's `sample_rate` by default);
    - image: `num_images` (default 1); video/action/latent: one output per line.
    """

    path = "/generate"

    def __init__(self, base_url: str, *, sample_rate: int = 24_000, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.sample_rate = sample_rate

    async def parse(self, response: httpx.Response) -> AsyncIterator[TargetItem]:
        where = str(response.url)
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            obj = _json_line(line, where)
            if not isinstance(obj, dict):
                raise BenchTargetError(f"NDJSON line from {where} is not an object: {line[:200]!r}")
            _check_error(obj, where)
            usage = obj.get("usage")
            if isinstance(usage, dict):
                count = usage.get("completion_tokens", usage.get("num_output_tokens"))
                if count is not None:
                    yield Usage(int(count), usage.get("prompt_tokens"))
            if "modality" in obj:
                yield self._event(obj, len(line.encode("utf-8")), where)

    def _event(self, obj: dict[str, Any], num_bytes: int, where: str) -> OutputEvent:
        modality = obj["modality"]
        if modality == "text":
            tokens = obj.get("num_tokens")
            if tokens is None:
                tokens = len(obj["token_ids"]) if "token_ids" in obj else 1
            return OutputEvent("text", num_tokens=int(tokens), num_bytes=num_bytes)
        if modality == "audio":
            rate = int(obj.get("sample_rate", self.sample_rate))
            if "num_samples" in obj:
                samples = int(obj["num_samples"])
            elif "data" in obj:
                counter = PcmFrameCounter(AudioFormat(sample_rate=rate))
                samples = counter.feed(_b64(obj["data"], where))
                counter.finish()
            else:
                raise BenchTargetError(f"audio line from {where} has neither num_samples nor data")
            return OutputEvent("audio", num_samples=samples, sample_rate=rate, num_bytes=num_bytes)
        if modality == "image":
            return OutputEvent(
                "image", num_images=int(obj.get("num_images", 1)), num_bytes=num_bytes
            )
        return OutputEvent(modality, num_bytes=num_bytes)
