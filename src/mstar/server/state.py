"""What every route needs: the engine, the served names, admission and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from mstar.errors import APIRequestError
from mstar.runtime.async_engine import AsyncEngine
from mstar.runtime.model import (
    Model,
    SupportsTextOutput,
    supports_audio_output,
    supports_text_output,
)
from mstar.server.admission import AdmissionQueue
from mstar.server.config import ServerConfig
from mstar.server.metrics import ServerMetrics

__all__ = ["MAX_COUNT", "ServerState"]

log = structlog.get_logger(__name__)

MAX_COUNT = 2**63 - 1
"""The largest token count a request may name (a signed 64-bit integer, as tensors hold it)."""

# How long streams get, once aborted at shutdown, to send their error event and close.
_END_STREAMS_S = 5.0


@dataclass
class ServerState:
    """The running server's shared objects (one model per server).

    Attributes:
        engine: The engine serving the model.
        config: The server settings.
        names: Model names clients may send; the first is the one `/v1/models` lists.
        admission: Running and waiting slots.
        metrics: Prometheus families.
        created: Unix time the model was loaded.
        is_draining: The server is shutting down: new requests get 503, running ones may
            finish within the grace period (`drain`).
        running: Engine ids of the requests admitted and not yet ended.
    """

    engine: AsyncEngine
    config: ServerConfig
    names: tuple[str, ...]
    admission: AdmissionQueue
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    is_draining: bool = False
    running: set[str] = field(default_factory=set)  # engine ids of the admitted requests
    num_realtime_sessions: int = 0  # `/v1/realtime` sessions open
    _idle: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    @property
    def model(self) -> Model:
        """Return the served model."""
        return self.engine.model

    @property
    def name(self) -> str:
        """Return the model's public name."""
        return self.names[0]

    @property
    def tasks(self) -> tuple[str, ...]:
        """Return the tasks the model accepts."""
        return tuple(self.model.tasks())

    @property
    def sample_rate(self) -> int | None:
        """Return the sample rate of the model's audio outputs, if it makes audio."""
        model = self.model
        return int(model.audio_sample_rate) if supports_audio_output(model) else None

    @property
    def text_model(self) -> SupportsTextOutput | None:
        """Return the model if the server can turn its token ids into text, else None.

        That takes a model declaring `SupportsTextOutput` whose checkpoint has a tokenizer.
        """
        model = self.model
        return model if supports_text_output(model) and model.tokenizer is not None else None

    @property
    def tokenizer(self) -> Any:
        """Return the model's tokenizer if the server can turn its token ids into text, or None."""
        text_model = self.text_model
        return None if text_model is None else text_model.tokenizer

    @property
    def max_seq_len(self) -> int | None:
        """Return the longest sequence (prompt and generated tokens) every KV cache of the model
        takes, as the engines published it at start (`AsyncEngine.limits`); None when the model
        has no KV-cache node."""
        return self.engine.limits.max_seq_len

    async def check_length(
        self,
        max_tokens: int | None,
        *,
        param: str = "max_tokens",
        num_prompt: int | None = None,
        prompt_param: str | None = None,
    ) -> None:
        """Refuse, before it runs, a request that can never fit the model's length.

        Every route calls this at its edge, so that an impossible ``max_tokens`` (1e9, 2**63 or
        more) is the client's 400, never a node's failure mid-walk or an integer overflow
        further in. The length is `max_seq_len`; a prompt counts ``num_prompt`` tokens where
        the route can count them, else at least one (no KV-cache node takes an empty prompt).
        A model without a KV cache has no length, but no count exceeds a signed 64-bit one.

        Raises:
            APIRequestError: 400 ``context_length_exceeded``, naming ``prompt_param`` when the
                prompt alone is too long, else ``param``.
        """
        limit = self.max_seq_len
        if (
            limit is not None
            and num_prompt is not None
            and prompt_param is not None
            and num_prompt >= limit
        ):
            raise APIRequestError(
                f"the prompt has {num_prompt} tokens but the model holds {limit} tokens, "
                "prompt and "
                "completion together (its length, or a smaller KV cache): shorten it",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return
        if limit is None:
            if max_tokens > MAX_COUNT:
                raise APIRequestError(
                    f"{param} is {max_tokens}; at most {MAX_COUNT} tokens can be counted",
                    param=param,
                    code="context_length_exceeded",
                )
            return
        counted = 1 if num_prompt is None else num_prompt
        if counted + max_tokens > limit:
            prompt = "at least 1 token" if num_prompt is None else f"{num_prompt} tokens"
            fix = "less the prompt's tokens" if num_prompt is None else "or shorten the prompt"
            raise APIRequestError(
                f"{param} is {max_tokens} and the prompt has {prompt}, but the model holds "
                f"{limit} tokens, "
                "prompt and completion together (its length, or a smaller KV cache): lower "
                f"{param} to "
                f"at most {limit - counted} {fix}",
                param=param,
                code="context_length_exceeded",
            )

    def count_prompt(self, text: str) -> int | None:
        """Return how many tokens ``text`` is at least, by the model's tokenizer (None without one).

        Special tokens are left out, so the count is a floor of any prompt made of the text.
        """
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        try:
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception:  # a tokenizer of another shape: the count is only a floor, leave it out
            return None

    def add_running(self, request_id: str) -> None:
        """Count a request admitted into the engine."""
        self.running.add(request_id)
        self._idle.clear()

    def discard_running(self, request_id: str) -> None:
        """Forget a request that ended."""
        self.running.discard(request_id)
        if not self.running:
            self._idle.set()

    async def drain(self, grace_s: float) -> None:
        """Stop admitting requests (503); give running ones ``grace_s`` seconds, then end them.

        Requests still running then fail with `RequestAbortedError` ("the server is shutting
        down"), so every stream ends with an error event rather than being cut.
        """
        self.is_draining = True
        log.info("server_draining", running=len(self.running), grace_s=grace_s)
        if not self.running:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        if not self.running:
            return
        log.warning("aborting_requests_at_shutdown", running=len(self.running))
        for request_id in list(self.running):
            await self.engine.abort(request_id, reason="the server is shutting down")
        # Their streams send the error event and close; bounded, in case a client reads slowly.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), _END_STREAMS_S)

    def option_names(self, task: str) -> tuple[str, ...]:
        """Return the options the model declares for ``task`` (`Model.task_options`)."""
        options = self.model.task_options(task)
        return () if options is None else tuple(options.__struct_fields__)

    def check_model(self, name: str | None) -> None:
        """Check the `model` field of a request.

        Raises:
            APIRequestError: 404, this server does not serve ``name``.
        """
        if name is not None and name not in self.names:
            raise APIRequestError(
                f"model {name!r} does not exist here: this server serves {self.name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def check_task(self, task: str, *, param: str | None = None) -> None:
        """Check that the model can do ``task``.

        Raises:
            APIRequestError: 400, the model has no such task.
        """
        if task not in self.tasks:
            raise APIRequestError(
                f"model {self.name!r} cannot do task {task!r} (its tasks: "
                f"{', '.join(self.tasks) or 'none'})",
                param=param,
                code="unsupported_task",
            )
