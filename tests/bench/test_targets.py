"""In-process targets: engine outputs adapted to events, misuse reported, generators closed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mstar.bench.records import BenchRequest, OutputEvent, Usage
from mstar.bench.runner import time_request
from mstar.bench.targets import CallableTarget, Target, as_target


@dataclass
class EngineOutput:
    """Stands for an engine's own output type (e.g. what `AsyncEngine.generate` yields)."""

    modality: str
    payload_len: int


def to_events(output: EngineOutput) -> list[OutputEvent | Usage]:
    if output.modality == "audio":
        return [OutputEvent("audio", num_samples=output.payload_len, sample_rate=24_000)]
    return [OutputEvent("text", num_tokens=output.payload_len)]


async def test_engine_outputs_are_adapted_to_events() -> None:
    async def engine(request: BenchRequest) -> AsyncIterator[EngineOutput]:
        yield EngineOutput("text", 2)
        yield EngineOutput("audio", 4800)

    target = CallableTarget(engine, name="engine", to_events=to_events)
    record = await time_request(target, BenchRequest("r", "p"), time.perf_counter())
    assert record.error is None
    assert [(e.modality, e.num_tokens, e.num_samples) for e in record.events] == [
        ("text", 2, 0),
        ("audio", 0, 4800),
    ]
    assert all(e.time_s > 0 for e in record.events)  # stamped on arrival by the client


async def test_an_abandoned_generator_is_closed_before_the_record_is_filed() -> None:
    closed: list[str] = []

    async def engine(request: BenchRequest) -> AsyncIterator[EngineOutput]:
        try:
            yield EngineOutput("text", 1)
            yield EngineOutput("smell", 1)  # the adapter below rejects it
            yield EngineOutput("text", 1)
        finally:
            closed.append(request.request_id)

    def strict(output: EngineOutput) -> list[OutputEvent]:
        return [OutputEvent(output.modality, num_tokens=1)]

    target = CallableTarget(engine, name="engine", to_events=strict)
    record = await time_request(target, BenchRequest("r7", "p"), time.perf_counter())
    assert record.error is not None and "unknown output modality 'smell'" in record.error
    assert len(record.events) == 1
    assert closed == ["r7"]


async def test_a_plain_function_is_reported_not_crashed() -> None:
    def not_async(request: BenchRequest) -> list[int]:
        return [1]

    target = as_target("sync", not_async)  # type: ignore[arg-type]
    assert isinstance(target, Target)
    record = await time_request(target, BenchRequest("r", "p"), time.perf_counter())
    assert record.error is not None and "not an async iterator" in record.error
