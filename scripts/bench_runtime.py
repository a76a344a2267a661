"""Runtime overhead per walk step: a no-op `DynamicLoop`, co-located and across processes.

Each request runs ``--steps`` iterations of ``Sequential([a, b])`` (two no-op nodes) inside a
`DynamicLoop`. Per-step overhead = request latency / steps (the nodes do no work). Compared,
in the same run, with the floors of the transport underneath: an asyncio-queue round trip
(co-located) and a raw ZeroMQ ipc round trip (nodes on two worker processes: every step
crosses between the processes twice, one round trip).

    python scripts/bench_runtime.py [--steps 1000] [--concurrency 1 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from mstar.bench import (
    BenchRequest,
    ClosedLoop,
    OutputEvent,
    make_requests,
    print_table,
    run_benchmark,
)
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request

LOOP = "asyncio"
SAME_RANK = "node_groups:\n  - {node_names: [a, b, done], ranks: [0]}\n"
TWO_RANKS = "node_groups:\n  - {node_names: [a, done], ranks: [0]}\n  - {node_names: [b], ranks: [1]}\n"


async def queue_round_trip(n: int = 20_000) -> float:
    """Return the median asyncio-queue ping-pong round trip between two tasks, in seconds."""
    ping: asyncio.Queue[int] = asyncio.Queue()
    pong: asyncio.Queue[int] = asyncio.Queue()

    async def echo() -> None:
        for _ in range(n):
            pong.put_nowait(await ping.get())

    task = asyncio.create_task(echo())
    times = []
    for i in range(n):
        t = time.perf_counter()
        ping.put_nowait(i)
        await pong.get()
        times.append(time.perf_counter() - t)
    await task
    return statistics.median(times)


async def zmq_round_trip(n: int = 5_000) -> float:
    """Return the median raw pyzmq ipc PAIR round trip (asyncio sockets), in seconds."""
    ctx = zmq.asyncio.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    address = f"ipc:///tmp/mstar-bench-{time.monotonic_ns()}"
    a.bind(address)
    b.connect(address)

    async def echo() -> None:
        for _ in range(n):
            await b.send(await b.recv())

    task = asyncio.create_task(echo())
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await a.send(b"x" * 64)
        await a.recv()
        times.append(time.perf_counter() - t)
    await task
    a.close(0)
    b.close(0)
    ctx.term()
    return statistics.median(times)


def engine_target(engine: AsyncEngine) -> Any:
    async def run(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        async for _ in engine.generate(Request("loop", {}, request_id=request.request_id)):
            yield OutputEvent("latent")

    return run


async def measure(name: str, placement: str, processes: bool, steps: int, concurrency: list[int]) -> dict[int, float]:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": steps})
    config = EngineConfig(worker_processes=processes, offload_steps=False, loop=LOOP)
    async with await AsyncEngine.start(spec, Placement.from_yaml(placement), config) as engine:
        result = await run_benchmark(
            {name: engine_target(engine)},
            make_requests(["loop"]),
            ClosedLoop(tuple(concurrency)),
            name=f"runtime overhead: {name}",
            progress=False,
            config={"steps": steps, "placement": placement.replace("\n", " "), "worker_processes": processes},
        )
    print_table(result)
    out = {}
    for point in result.points:
        e2e = point.summary.e2e_s
        assert e2e is not None and point.summary.num_failed == 0
        out[int(point.point)] = e2e.p50 / steps
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop", help="event loop everywhere")
    args = parser.parse_args()
    global LOOP
    LOOP = args.loop
    print(f"config: steps={args.steps} concurrency={args.concurrency} loop={args.loop}")
    q = await queue_round_trip()
    z = await zmq_round_trip()
    print(f"floors: asyncio queue round trip {q * 1e6:.1f} us; ZeroMQ ipc round trip {z * 1e6:.1f} us")
    colocated = await measure("co-located", SAME_RANK, False, args.steps, args.concurrency)
    across = await measure("two processes", TWO_RANKS, True, args.steps, args.concurrency)
    print()
    print(f"{'setup':>14} {'conc':>5} {'us/step (p50 E2E/steps)':>24} {'us/step/request':>16} {'floor us':>9} {'ratio':>6}")
    for name, res, floor in (("co-located", colocated, q), ("two processes", across, z)):
        for c, per_step in res.items():
            per_request = per_step / c
            print(
                f"{name:>14} {c:>5} {per_step * 1e6:>24.1f} {per_request * 1e6:>16.2f} {floor * 1e6:>9.1f} "
                f"{per_step / floor:>6.2f}"
            )
    print("targets: co-located <= 50 us per step per request at concurrency 1; two processes <= 2x the ZeroMQ round trip")


if __name__ == "__main__":
    import sys

    if "--loop" in sys.argv and sys.argv[sys.argv.index("--loop") + 1] == "asyncio":
        asyncio.run(main())
    else:
        import uvloop

        uvloop.run(main())
