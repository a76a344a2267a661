"""What every route needs: the engine, the served names, admission and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mstar.errors import APIRequestError
from mstar.runtime.async_engine import AsyncEngine
from mstar.runtime.model import Model
from mstar.server.admission import AdmissionQueue
from mstar.server.config import ServerConfig
from mstar.server.metrics import ServerMetrics

__all__ = ["ServerState"]


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
    """

    engine: AsyncEngine
    config: ServerConfig
    names: tuple[str, ...]
    admission: AdmissionQueue
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))

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
        rate = getattr(self.model, "audio_sample_rate", None)
        return int(rate) if rate else None

    @property
    def tokenizer(self) -> Any:
        """Return the model's tokenizer, or None."""
        return getattr(self.model, "tokenizer", None)

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
                f"model {self.name!r} cannot do task {task!r} (its tasks: {', '.join(self.tasks) or 'none'})",
                param=param,
                code="unsupported_task",
            )
