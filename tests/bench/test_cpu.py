"""CPU accounting: each target is charged its own threads' CPU, per audio second made."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from mstar.bench import BenchRequest, OutputEvent
from mstar.bench.cpu import CpuAccount, thread_cpu_seconds

COMPONENTS = {
    "stage": (("stage-thinker", "thinker"), ("stage-talker", "talker")),
    "mstar": (("mstar-rank0", "thinker"),),
}


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_cpu_seconds_lists_the_live_threads() -> None:
    seconds = thread_cpu_seconds()
    name, used = seconds[threading.main_thread().ident or 0]
    assert name == "MainThread" and used > 0


def test_cpu_account_charges_each_target_its_own_threads() -> None:
    """Work on a stage thread while the stage target has a request in flight is the stage's, per
    audio second; another target's named threads are not charged."""
    account = CpuAccount(COMPONENTS, sample_rate=24_000)
    pool = ThreadPoolExecutor(1, thread_name_prefix="stage-talker")  # lives on, as a stage's

    async def stage_target(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        await asyncio.get_running_loop().run_in_executor(pool, spin, 0.05)
        yield OutputEvent("audio", num_samples=24_000, sample_rate=24_000)

    async def consume(target: str) -> None:
        async for _ in account.wrap(target, stage_target)(BenchRequest("concurrency-1-0", "hi")):
            pass

    try:
        asyncio.run(consume("stage"))
        row = account.take()["stage"]
        assert 45 <= row["talker"] <= 80  # ms of CPU per audio second
        assert "thinker" not in row and row["total"] >= row["talker"]
        assert 0 < row["cores_busy"] <= 2
        assert account.take() == {}
        asyncio.run(consume("mstar"))  # the stage's thread does the work: not mstar's
        assert "talker" not in account.take()["mstar"]
    finally:
        pool.shutdown()
