"""StatelessEngine: batching across requests, limits, aborts, failures, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from mstar.engines.stateless import StatelessEngine, StatelessEngineConfig, batched
from mstar.errors import EngineClosedError, RequestAbortedError


class Recorder:
    """A batched node that stacks its inputs (as a real encoder would) and records batch sizes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.gate: asyncio.Event | None = None

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        self.sizes.append(len(batch))
        x = torch.stack([b["x"] for b in batch])
        y = x * 2 + 1
        return [{"y": row} for row in y]


async def test_concurrent_requests_share_one_step() -> None:
    node = Recorder()
    async with StatelessEngine("enc", node, StatelessEngineConfig(max_batch_size=8)) as engine:
        outs = await asyncio.gather(
            *(engine.submit(f"r{i}", {"x": torch.full((3,), float(i))}) for i in range(20))
        )
    assert [o["y"][0].item() for o in outs] == [2 * i + 1 for i in range(20)]
    assert node.sizes == [8, 8, 4]  # continuous batching under the size cap, arrival order
    assert engine.num_steps == 3


async def test_max_wait_lets_a_short_batch_fill() -> None:
    node = Recorder()
    async with StatelessEngine(
        "enc", node, StatelessEngineConfig(max_batch_size=4, max_wait_s=5.0)
    ) as engine:
        first = asyncio.ensure_future(engine.submit("a", {"x": torch.zeros(1)}))
        await asyncio.sleep(0)  # the engine now waits for the batch to fill
        rest = [asyncio.ensure_future(engine.submit(r, {"x": torch.ones(1)})) for r in "bcd"]
        await asyncio.gather(first, *rest)
    assert node.sizes == [4]


async def test_abort_drops_pending_inputs() -> None:
    node = Recorder()
    engine = StatelessEngine("enc", node, StatelessEngineConfig(max_batch_size=4, max_wait_s=5.0))
    async with engine:
        keep = asyncio.ensure_future(engine.submit("keep", {"x": torch.zeros(1)}))
        gone = asyncio.ensure_future(engine.submit("gone", {"x": torch.zeros(1)}))
        await asyncio.sleep(0)
        assert engine.pending_request_ids() == {"keep", "gone"}
        assert engine.abort("gone") == 1
        with pytest.raises(RequestAbortedError, match="'gone' was aborted"):
            await gone
        await asyncio.gather(*(engine.submit(r, {"x": torch.zeros(1)}) for r in "xyz"), keep)
    assert node.sizes == [4]  # the aborted input took no slot


async def test_a_bad_input_fails_only_its_request() -> None:
    def node(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        if inputs["x"] < 0:
            raise ValueError("negative input")
        return {"y": inputs["x"] + 1}

    async with StatelessEngine(
        "enc", batched(node), StatelessEngineConfig(max_batch_size=8)
    ) as engine:
        results = await asyncio.gather(
            *(engine.submit(f"r{x}", {"x": x}) for x in (1, -1, 2)), return_exceptions=True
        )
    assert results[0] == {"y": 2} and results[2] == {"y": 3}
    assert isinstance(results[1], ValueError)


async def test_wrong_output_count_is_an_error() -> None:
    async with StatelessEngine("enc", lambda batch: [], StatelessEngineConfig()) as engine:
        with pytest.raises(RuntimeError, match="returned 0 outputs for a batch of 1"):
            await engine.submit("r", {"x": 1})


async def test_close_fails_pending_and_later_submissions() -> None:
    engine = StatelessEngine(
        "enc", Recorder(), StatelessEngineConfig(max_batch_size=2, max_wait_s=30.0)
    )
    engine.start()
    pending = asyncio.ensure_future(engine.submit("r", {"x": torch.zeros(1)}))
    await asyncio.sleep(0)
    await engine.aclose()
    with pytest.raises(EngineClosedError):
        await pending
    with pytest.raises(EngineClosedError, match="is closed"):
        await engine.submit("r2", {"x": torch.zeros(1)})


async def test_steps_on_the_event_loop_start_and_stop_with_the_engine() -> None:
    node = Recorder()
    engine = StatelessEngine("enc", node, StatelessEngineConfig(max_batch_size=2))
    early = [asyncio.ensure_future(engine.submit(r, {"x": torch.zeros(1)})) for r in "abc"]
    await asyncio.sleep(0)
    assert node.sizes == [] and engine.num_pending == 3  # not started: nothing runs
    engine.start()
    await asyncio.gather(*early)
    assert node.sizes == [2, 1]
    late = asyncio.ensure_future(engine.submit("d", {"x": torch.zeros(1)}))
    await asyncio.sleep(0)  # queued, its step scheduled for the next loop turn
    await engine.aclose()
    with pytest.raises(EngineClosedError):
        await late
    assert node.sizes == [2, 1]  # the scheduled step found the engine closed


async def test_steps_can_run_off_the_event_loop() -> None:
    node = Recorder()
    with ThreadPoolExecutor(1) as pool:
        async with StatelessEngine(
            "enc", node, StatelessEngineConfig(max_batch_size=16), executor=pool
        ) as engine:
            outs = await asyncio.gather(
                *(engine.submit(str(i), {"x": torch.tensor([float(i)])}) for i in range(5))
            )
    assert [float(o["y"]) for o in outs] == [1.0, 3.0, 5.0, 7.0, 9.0]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        StatelessEngineConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="max_wait_s must be >= 0"):
        StatelessEngineConfig(max_wait_s=-1)


class ThreadRecorder(Recorder):
    """A `Recorder` that also notes each call's thread and torch thread count."""

    def __init__(self, concurrent: bool) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.supports_concurrent_calls = concurrent

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        self.calls.append((threading.current_thread().name, torch.get_num_threads()))
        time.sleep(0.01)  # long enough for the calls of a step to overlap on two workers
        return super().__call__(batch)


@pytest.mark.parametrize("concurrent", [False, True])
async def test_a_deterministic_engine_computes_each_input_alone_on_one_thread(
    concurrent: bool,
) -> None:
    """Deterministic serving: one input per call on one torch thread, whatever the batch; a
    node that allows concurrent calls takes a step's inputs side by side."""
    node = ThreadRecorder(concurrent)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = StatelessEngineConfig(max_batch_size=8, deterministic=True)
        with ThreadPoolExecutor(1) as step_thread:
            async with StatelessEngine("enc", node, config, step_thread) as engine:
                outs = await asyncio.gather(
                    *(engine.submit(f"r{i}", {"x": torch.full((3,), float(i))}) for i in range(6))
                )
    finally:
        torch.set_num_threads(before)
    assert [o["y"][0].item() for o in outs] == [2 * i + 1 for i in range(6)]
    assert node.sizes == [1] * 6
    assert {threads for _, threads in node.calls} == {1}
    assert engine.num_batched == 6 and engine.num_steps < 6  # still batched across requests
    names = {name for name, _ in node.calls}
    assert len(names) == (2 if concurrent else 1)
    assert torch.get_num_threads() == before
