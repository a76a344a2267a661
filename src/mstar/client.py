"""A Python client for the native `/generate` API: typed outputs, the server's own errors.

    from mstar.client import Client

    with Client("http://127.0.0.1:8000") as client:
        for out in client.generate("speech", text="Hello"):
            if isinstance(out, AudioOutput):
                play(out.samples, out.sample_rate)      # float32 numpy samples

    async with AsyncClient(url) as client:
        async for out in client.generate("generate", prompt="Once upon", max_tokens=16):
            print(out.text, end="")

`generate` streams the NDJSON lines of `/generate` (see `mstar.server.encoding.output_line`)
as `TextOutput`, `AudioOutput`, `ImageOutput`, `ActionOutput`, `LatentOutput`, `TensorOutput`
(any other tensor, e.g. video frames) or `ValueOutput`; the stream's `usage` is set once it
ended. `run` collects a whole request. A request the server refuses, or that fails while it
runs, raises the `mstar.errors` type the server raised (`APIRequestError` with its status,
field and code for a bad request; `OverloadedError` with its retry delay;
`WorkerUnavailableError` with the rank that is down and its retry delay; `WalkExecutionError`
when a node failed, ...), `MStarError` when the server names no type. Leaving a stream early
(closing it, or leaving its ``with`` block) aborts the request on the server.

Request data goes as JSON: numpy arrays as nested lists, images (PIL images, or arrays wrapped
in `image_url`) as PNG data URLs, which the model receives as uint8 RGB arrays.
"""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
import numpy as np

from mstar import errors
from mstar.errors import (
    APIRequestError,
    MStarError,
    OverloadedError,
    WalkExecutionError,
    WorkerUnavailableError,
)

__all__ = [
    "ActionOutput",
    "AsyncClient",
    "AsyncOutputStream",
    "AudioOutput",
    "Client",
    "GenerateOutput",
    "ImageOutput",
    "LatentOutput",
    "OutputStream",
    "TensorOutput",
    "TextOutput",
    "ValueOutput",
    "error_from_body",
    "image_url",
    "parse_output",
]

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class GenerateOutput:
    """What every output says of itself: its modality, and the graph node and walk that made it."""

    modality: str
    name: str = ""
    node: str = ""
    walk: str = ""


@dataclass(frozen=True)
class TextOutput(GenerateOutput):
    """Tokens and the text they complete (empty while a character is incomplete).

    ``logprobs`` holds one ``{"token_id", "logprob", "top_token_ids", "top_logprobs"}`` dict per
    token when the request asked for log-probabilities.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class AudioOutput(GenerateOutput):
    """Mono audio: float32 samples in [-1, 1] (None when the request sent ``audio_data: false``)."""

    samples: np.ndarray | None = None
    sample_rate: int | None = None
    num_samples: int = 0


@dataclass(frozen=True)
class ImageOutput(GenerateOutput):
    """An image as a uint8 RGB ``[height, width, 3]`` array (``[height, width, 4]``, RGBA, when
    the model's image has transparency); grey images are expanded to RGB."""

    image: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 3), np.uint8))

    @property
    def width(self) -> int:
        """Return the image's width in pixels."""
        return int(self.image.shape[1])

    @property
    def height(self) -> int:
        """Return the image's height in pixels."""
        return int(self.image.shape[0])


@dataclass(frozen=True)
class TensorOutput(GenerateOutput):
    """Any other tensor (video frames, ...), as a numpy array of its dtype and shape."""

    array: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass(frozen=True)
class ActionOutput(TensorOutput):
    """An action chunk (a robot policy's, a world model's plan)."""


@dataclass(frozen=True)
class LatentOutput(TensorOutput):
    """A latent (embeddings, predicted frame features, ...)."""


@dataclass(frozen=True)
class ValueOutput(GenerateOutput):
    """An output that is no tensor: a number, string or JSON object, or bytes."""

    value: Any = None


_TENSOR_TYPES: dict[str, type[TensorOutput]] = {"action": ActionOutput, "latent": LatentOutput}


def parse_output(line: Mapping[str, Any]) -> GenerateOutput:
    """Return the typed output of one `/generate` output line."""
    modality = str(line.get("modality", ""))
    meta = {
        "modality": modality,
        "name": line.get("name") or "",
        "node": line.get("node") or "",
        "walk": line.get("walk") or "",
    }
    if modality == "text":
        logprobs = line.get("logprobs")
        return TextOutput(
            **meta,
            text=str(line.get("text", "")),
            token_ids=[int(t) for t in line.get("token_ids", ())],
            logprobs=None if logprobs is None else [logprobs],
        )
    if modality == "audio" and "num_samples" in line:
        samples = None
        if "data" in line:
            pcm = np.frombuffer(base64.b64decode(line["data"]), dtype="<i2")
            samples = (pcm.astype(np.float32) / 32767.0).clip(-1.0, 1.0)
        rate = line.get("sample_rate")
        return AudioOutput(
            **meta,
            samples=samples,
            sample_rate=None if rate is None else int(rate),
            num_samples=int(line["num_samples"]),
        )
    if modality == "image" and line.get("format") == "png":
        return ImageOutput(**meta, image=_decode_png(base64.b64decode(line["data"])))
    if "shape" in line and "dtype" in line:
        dtype = np.dtype(str(line["dtype"])).newbyteorder("<")
        array = np.frombuffer(base64.b64decode(line["data"]), dtype=dtype).reshape(line["shape"])
        return _TENSOR_TYPES.get(modality, TensorOutput)(
            **meta, array=array.astype(dtype.newbyteorder("="), copy=True)
        )
    if line.get("encoding") == "base64":
        return ValueOutput(**meta, value=base64.b64decode(line["data"]))
    return ValueOutput(**meta, value=line.get("value"))


def _decode_png(png: bytes) -> np.ndarray:
    """Decode an image line's PNG to uint8 RGB ``[H, W, 3]`` (RGBA ``[H, W, 4]`` if it has
    alpha)."""
    from PIL import Image

    with Image.open(io.BytesIO(png), formats=("PNG",)) as picture:
        has_alpha = "A" in picture.getbands() or "transparency" in picture.info
        mode = "RGBA" if has_alpha else "RGB"
        return np.array(picture if picture.mode == mode else picture.convert(mode))


# --- errors ---------------------------------------------------------------------------------

_ERROR_CLASSES: dict[str, type[MStarError]] = {
    name: cls
    for name in errors.__all__
    if isinstance(cls := getattr(errors, name), type) and issubclass(cls, MStarError)
}
_WALK_PLACE = re.compile(
    r"^(?P<reason>.*) \(node '(?P<node>[^']*)', walk '(?P<walk>[^']*)', request "
    r"'(?P<request>[^']*)'\)$",
    re.S,
)


def error_from_body(
    body: Any, *, status: int | None = None, retry_after: str | None = None
) -> MStarError:
    """Return the `mstar.errors` exception that an error body (HTTP answer or stream line) stands
    for."""
    error = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(error, Mapping):
        return MStarError(
            f"the server answered {status}: {body!r}" if status else f"the server failed: {body!r}"
        )
    message = str(error.get("message", ""))
    kind = str(error.get("type") or "")
    code = error.get("code")
    name = error.get("mstar_error")
    if name == "WorkerUnavailableError":  # a rank down: retryable, names the rank
        rank, retry_s = error.get("rank"), error.get("retry_after_s")
        if retry_after and retry_after.isdigit():
            retry_s = int(retry_after)
        return WorkerUnavailableError(
            message,
            rank=rank if isinstance(rank, int) else None,
            retry_after_s=retry_s if isinstance(retry_s, int) else 1,
        )
    if status == 503 or kind == "overloaded_error":
        return OverloadedError(
            message, retry_after_s=int(retry_after) if retry_after and retry_after.isdigit() else 1
        )
    if kind in ("invalid_request_error", "authentication_error", "permission_error") or (
        status is not None and 400 <= status < 500
    ):
        return APIRequestError(
            message,
            status=status or (code if isinstance(code, int) else 400),
            param=error.get("param"),
            code=code if isinstance(code, str) else None,
            error_type=kind or "invalid_request_error",
        )
    cls = _ERROR_CLASSES.get(name) if isinstance(name, str) else None
    if cls is WalkExecutionError:
        place = _WALK_PLACE.match(message)
        if place is not None:
            return WalkExecutionError(
                place["reason"], node=place["node"], walk=place["walk"], request_id=place["request"]
            )
    if cls is not None and cls not in (APIRequestError, OverloadedError):
        try:
            return cls(message)
        except TypeError:  # a constructor that needs more than a message
            pass
    return MStarError(message)


def _raise_for(response: httpx.Response, body: bytes) -> None:
    if response.status_code < 400:
        return
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = body.decode("utf-8", errors="replace")
    raise error_from_body(
        parsed, status=response.status_code, retry_after=response.headers.get("retry-after")
    )


# --- requests -------------------------------------------------------------------------------


def image_url(image: Any) -> str:
    """Return an image as a ``data:image/png;base64,`` URL, the form `/generate` takes images in.

    The server hands it to the model as a uint8 RGB ``[H, W, 3]`` array (a nested list would
    lose the dtype). PIL images in request data are sent this way without asking.

    Args:
        image: A PIL image, or a uint8 array ``[H, W]`` (grey), ``[H, W, 3]`` or ``[H, W, 4]``.

    Raises:
        ValueError: An array of another dtype or shape.
    """
    from PIL import Image

    if not isinstance(image, Image.Image):
        array = np.asarray(image)
        if array.dtype != np.uint8 or not (
            array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))
        ):
            raise ValueError(
                f"an image must be uint8 [H, W], [H, W, 3] or [H, W, 4], got {array.dtype} "
                f"{list(array.shape)}"
            )
        image = Image.fromarray(np.ascontiguousarray(array))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    from PIL import Image

    if isinstance(value, Image.Image):
        return image_url(value)
    tolist = getattr(value, "tolist", None)  # a torch tensor, without importing torch here
    if callable(tolist):
        return tolist()
    raise TypeError(
        f"{type(value).__name__} is not JSON: send numbers, strings, lists, dicts or arrays"
    )


def _body(
    task: str | None,
    data: Mapping[str, Any] | None,
    fields: Mapping[str, Any],
    model: str | None,
    audio_data: bool,
) -> bytes:
    body: dict[str, Any] = {
        "data": {**(data or {}), **fields},
        "stream": True,
        "audio_data": audio_data,
    }
    if task is not None:
        body["task"] = task
    if model is not None:
        body["model"] = model
    return json.dumps(body, default=_json_default).encode()


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "application/x-ndjson"}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


class _Lines:
    """Turn NDJSON lines into outputs; keep the final usage."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        self.is_finished = False

    def parse(self, raw: str) -> GenerateOutput | None:
        if not raw.strip():
            return None
        line = json.loads(raw)
        if "error" in line:
            raise error_from_body(line)
        if line.get("finished"):
            self.usage = line.get("usage")
            self.is_finished = True
            return None
        return parse_output(line)


class OutputStream:
    """The outputs of one request, as they arrive (iterate it; close it to abort the request)."""

    def __init__(self, client: httpx.Client, content: bytes, headers: dict[str, str]) -> None:
        self._lines = _Lines()
        self._context = client.stream("POST", "/generate", content=content, headers=headers)
        response = self._context.__enter__()
        try:
            if response.status_code >= 400:
                _raise_for(response, response.read())
        except BaseException:
            self.close()
            raise
        self._response = response

    @property
    def usage(self) -> dict[str, Any] | None:
        """Return the request's usage (``completion_tokens``) once the stream ended."""
        return self._lines.usage

    def __iter__(self) -> Iterator[GenerateOutput]:
        try:
            for raw in self._response.iter_lines():
                out = self._lines.parse(raw)
                if out is not None:
                    yield out
            if not self._lines.is_finished:
                raise MStarError("the server ended the stream before the request finished")
        finally:
            self.close()

    def close(self) -> None:
        """End the stream (an unfinished request is aborted on the server)."""
        self._context.__exit__(None, None, None)

    def __enter__(self) -> OutputStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncOutputStream:
    """`OutputStream` for `AsyncClient` (iterate it with ``async for``; `aclose` aborts)."""

    def __init__(self, client: httpx.AsyncClient, content: bytes, headers: dict[str, str]) -> None:
        self._client = client
        self._content = content
        self._headers = headers
        self._lines = _Lines()
        self._context: Any = None
        self._response: httpx.Response | None = None

    async def start(self) -> AsyncOutputStream:
        """Send the request; raise the server's error if it refuses it."""
        self._context = self._client.stream(
            "POST", "/generate", content=self._content, headers=self._headers
        )
        response = await self._context.__aenter__()
        try:
            if response.status_code >= 400:
                _raise_for(response, await response.aread())
        except BaseException:
            await self.aclose()
            raise
        self._response = response
        return self

    @property
    def usage(self) -> dict[str, Any] | None:
        """Return the request's usage (``completion_tokens``) once the stream ended."""
        return self._lines.usage

    async def __aiter__(self) -> AsyncIterator[GenerateOutput]:
        if self._response is None:
            await self.start()
        assert self._response is not None
        try:
            async for raw in self._response.aiter_lines():
                out = self._lines.parse(raw)
                if out is not None:
                    yield out
            if not self._lines.is_finished:
                raise MStarError("the server ended the stream before the request finished")
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """End the stream (an unfinished request is aborted on the server)."""
        if self._context is not None:
            context, self._context = self._context, None
            await context.__aexit__(None, None, None)

    async def __aenter__(self) -> AsyncOutputStream:
        return await self.start() if self._response is None else self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client:
    """A synchronous client of an mstar server's native API.

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        api_key: Sent as a bearer token (servers started with ``--api-key``).
        timeout: Seconds to wait for a connection or for the next bytes of an answer.
    """

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout)
        self._headers = _headers(api_key)

    def generate(
        self,
        task: str | None = None,
        data: Mapping[str, Any] | None = None,
        *,
        model: str | None = None,
        audio_data: bool = True,
        **fields: Any,
    ) -> OutputStream:
        """Start a request of ``task`` (None: the model's only task); return its stream of outputs.

        Request data is ``data`` plus keyword ``fields`` (numpy arrays go as nested lists);
        ``model`` checks the server serves that name; ``audio_data=False`` leaves audio samples
        out (their count only).

        Raises:
            APIRequestError | OverloadedError | MStarError: The server refused the request.
        """
        return OutputStream(self._http, _body(task, data, fields, model, audio_data), self._headers)

    def run(
        self, task: str | None = None, data: Mapping[str, Any] | None = None, **fields: Any
    ) -> list[GenerateOutput]:
        """Run a request to its end; return all its outputs (the arguments are `generate`'s)."""
        with self.generate(task, data, **fields) as stream:
            return list(stream)

    def health(self) -> dict[str, Any]:
        """Return the server's `/health` answer (raises while it is not serving)."""
        response = self._http.get("/health")
        _raise_for(response, response.content)
        result: dict[str, Any] = response.json()
        return result

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClient:
    """The asynchronous `Client` (same arguments; use ``async with``)."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout)
        self._headers = _headers(api_key)

    def generate(
        self,
        task: str | None = None,
        data: Mapping[str, Any] | None = None,
        *,
        model: str | None = None,
        audio_data: bool = True,
        **fields: Any,
    ) -> AsyncOutputStream:
        """Return the stream of a request of ``task``: ``async for`` it, or ``async with`` it first.

        The arguments are `Client.generate`'s. The request is sent when the stream starts;
        its refusal raises there.
        """
        return AsyncOutputStream(
            self._http, _body(task, data, fields, model, audio_data), self._headers
        )

    async def run(
        self, task: str | None = None, data: Mapping[str, Any] | None = None, **fields: Any
    ) -> list[GenerateOutput]:
        """Run a request to its end; return all its outputs (the arguments are
        `Client.generate`'s)."""
        async with self.generate(task, data, **fields) as stream:
            return [out async for out in stream]

    async def health(self) -> dict[str, Any]:
        """Return the server's `/health` answer (raises while it is not serving)."""
        response = await self._http.get("/health")
        _raise_for(response, response.content)
        result: dict[str, Any] = response.json()
        return result

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
