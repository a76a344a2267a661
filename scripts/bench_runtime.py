"""Runtime overhead per walk step: a no-op `DynamicLoop`, co-located and across processes.

Each request runs ``--steps`` iterations of ``Sequential([a, b])`` (two no-op nodes) inside a
`DynamicLoop`. Per-step overhead = request latency / steps (the nodes do no work). Compared,
in the same run, with the floors of the transport underneath: an asyncio-queue round trip
(co-located), and a bare ZeroMQ ipc round trip between two processes, ROUTER to DEALER as
the workers' links are, on the same event loop (nodes on two worker processes: every step
crosses between the processes twice, one round trip).

On a shared machine the load drifts within a run, so the two-process ratio is also measured
in ``--rounds`` interleaved rounds (a ZeroMQ round-trip floor, then one request on the same
engine), each ratio from measurements seconds apart; the median of those is the figure.
A walk's step is its request's time over its steps: a mean, stalls of a loaded machine
included. Each round gives the step over the floor's median round trip (the target's
figure) and over its mean round trip (the time of back-to-back round trips over their
number: the same statistic as the step's).

    python scripts/bench_runtime.py [--steps 1000] [--concurrency 1 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine
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
TWO_RANKS = (
    "node_groups:\n  - {node_names: [a, done], ranks: [0]}\n  - {node_names: [b], ranks: [1]}\n"
)


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


def _zmq_echo(address: str, n: int, loop: str) -> None:
    """Child process: connect a DEALER to ``address`` and send back ``n`` messages."""

    async def echo() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        await sock.send(b"ready")
        for _ in range(n):
            await sock.send_multipart(await sock.recv_multipart())
        sock.close(linger=1000)
        ctx.term()

    run_loop(echo(), loop)


async def zmq_round_trip(n: int = 5_000) -> float:
    """Return the median ZeroMQ ipc round trip between two processes, in seconds."""
    return (await zmq_round_trips(n))[0]


async def zmq_round_trips(n: int = 5_000) -> tuple[float, float]:
    """Return the median and the mean ZeroMQ ipc round trip between two processes, in seconds.

    What a worker-to-worker hop rides on: a ROUTER here, a DEALER in a spawned process,
    asyncio sockets on the same event loop as the workers; 64-byte messages.
    """
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    address = f"ipc://{tempfile.gettempdir()}/mstar-bench-{os.getpid()}-{time.monotonic_ns()}"
    router.bind(address)
    child = multiprocessing.get_context("spawn").Process(target=_zmq_echo, args=(address, n, LOOP))
    child.start()
    try:
        identity, _ = await asyncio.wait_for(router.recv_multipart(), 120)  # the child is up
        times = []
        start = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            await router.send_multipart([identity, b"x" * 64])
            await router.recv_multipart()
            times.append(time.perf_counter() - t)
        mean = (time.perf_counter() - start) / n
    finally:
        await asyncio.to_thread(child.join, 30)
        if child.is_alive():
            child.kill()
        router.close(0)
        ctx.term()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address.removeprefix("ipc://"))
    return statistics.median(times), mean


def engine_target(engine: AsyncEngine) -> Any:
    async def run(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        async for _ in engine.generate(Request("loop", {}, request_id=request.request_id)):
            yield OutputEvent("latent")

    return run


async def measure(
    name: str, placement: str, processes: bool, steps: int, concurrency: list[int], rounds: int = 0
) -> tuple[dict[int, float], list[tuple[float, float, float]]]:
    """Return p50 seconds per step at each concurrency, and ``rounds`` interleaved (step, floor
    median, mean)."""
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": steps})
    config = EngineConfig(worker_processes=processes, offload_steps=False, loop=LOOP)
    pairs: list[tuple[float, float, float]] = []
    async with await AsyncEngine.start(spec, Placement.from_yaml(placement), config) as engine:
        for i in range(rounds):
            floor, floor_mean = await zmq_round_trips(2_000)
            start = time.perf_counter()
            await engine.run(Request("loop", {}, request_id=f"round-{i}"))
            pairs.append(((time.perf_counter() - start) / steps, floor, floor_mean))
        result = await run_benchmark(
            {name: engine_target(engine)},
            make_requests(["loop"]),
            ClosedLoop(tuple(concurrency)),
            name=f"runtime overhead: {name}",
            progress=False,
            config={
                "steps": steps,
                "placement": placement.replace("\n", " "),
                "worker_processes": processes,
            },
        )
    print_table(result)
    out = {}
    for point in result.points:
        e2e = point.summary.e2e_s
        assert e2e is not None and point.summary.num_failed == 0
        out[int(point.point)] = e2e.p50 / steps
    return out, pairs


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--loop", choices=["asyncio", "uvloop"], default="uvloop", help="event loop everywhere"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved floor/walk rounds (two processes)"
    )
    args = parser.parse_args()
    global LOOP
    LOOP = args.loop
    print(
        f"config: steps={args.steps} concurrency={args.concurrency} loop={args.loop} "
        f"rounds={args.rounds}"
    )
    # Each floor is measured right before the runs it is compared with: on a shared machine
    # the load drifts within a run.
    q = await queue_round_trip()
    print(f"floor: asyncio queue round trip {q * 1e6:.1f} us")
    colocated, _ = await measure("co-located", SAME_RANK, False, args.steps, args.concurrency)
    z = await zmq_round_trip()
    print(f"floor: ZeroMQ ipc round trip between two processes {z * 1e6:.1f} us")
    across, pairs = await measure(
        "two processes", TWO_RANKS, True, args.steps, args.concurrency, args.rounds
    )
    print()
    print(
        f"{'setup':>14} {'conc':>5} {'us/step (p50 E2E/steps)':>24} {'us/step/request':>16} "
        f"{'floor us':>9} {'ratio':>6}"
    )
    for name, res, floor in (("co-located", colocated, q), ("two processes", across, z)):
        for c, per_step in res.items():
            per_request = per_step / c
            print(
                f"{name:>14} {c:>5} {per_step * 1e6:>24.1f} {per_request * 1e6:>16.2f} "
                f"{floor * 1e6:>9.1f} "
                f"{per_step / floor:>6.2f}"
            )
    if pairs:
        print()
        print(
            f"interleaved rounds (two processes, concurrency 1): {'us/step':>8} "
            f"{'floor us':>9} {'ratio':>6}"
            f" {'mean floor us':>14} {'ratio':>6}"
        )
        for i, (step, floor, mean) in enumerate(pairs):
            print(
                f"{'round ' + str(i):>50} {step * 1e6:>8.1f} {floor * 1e6:>9.1f} "
                f"{step / floor:>6.2f}"
                f" {mean * 1e6:>14.1f} {step / mean:>6.2f}"
            )
        median = statistics.median(step / floor for step, floor, _ in pairs)
        median_mean = statistics.median(step / mean for step, _, mean in pairs)
        print(f"{'median ratio':>50} {'':>8} {'':>9} {median:>6.2f} {'':>14} {median_mean:>6.2f}")
    print(
        "targets: co-located <= 50 us per step per request at concurrency 1; two processes "
        "<= 1.25x "
        "the ZeroMQ round trip (median of the interleaved rounds, over the floor's median "
        "round trip)"
    )


def run_loop(coro: Coroutine[Any, Any, None], loop: str) -> None:
    """Run ``coro`` on a fresh event loop of kind ``loop`` ("asyncio" or "uvloop")."""
    if loop == "asyncio":
        asyncio.run(coro)
    else:
        import uvloop

        uvloop.run(coro)


if __name__ == "__main__":
    import sys

    run_loop(
        main(),
        "asyncio"
        if "--loop" in sys.argv and sys.argv[sys.argv.index("--loop") + 1] == "asyncio"
        else "uvloop",
    )
