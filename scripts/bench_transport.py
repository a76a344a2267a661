#!/usr/bin/env python
"""Benchmark mstar's actor transports against raw floors measured in the same run.

For each transport (inproc, ipc, tcp):
- `ActorRef.ask` round trip of a small message (p50, p99) next to the raw floor: a bare
  asyncio-queue ping-pong (inproc) or a bare pyzmq DEALER/ROUTER ping-pong on the same scheme
  with the peer in another process (ipc, tcp);
- one-way throughput of small messages (`tell`) next to the same raw floors;
- 16 MiB tensor handoff (ask carrying a tensor, acknowledged by the receiver) through the
  shared-memory arena and as ZeroMQ frames, next to a raw /dev/shm copy and a raw pyzmq
  16 MiB send.

The raw floors are `mstar.baselines.transport`'s. Peers of ipc/tcp runs live in processes
started with `spawn`. Targets: ask within 2x of the
floor (inproc) and 1.5x (ZeroMQ), p50; shared-memory handoff at least 10 GB/s.

The ask round trip is also measured on the `mstar.bench` harness, once per transport: each
harness request is a burst of `--burst` round trips (so the harness's own bookkeeping per
request is negligible), the primary target `mstar` sends them as `ActorRef.ask`, the baseline
`floor` as raw ping-pongs to the same floor peer as above. The harness prints its table and
ratios and writes JSON and a PNG per transport; the mean round trip inside a burst is the
burst's E2E / `--burst`. The per-ask p50/p99 (and the targets) come from individually timed
asks, which a burst cannot give.

    .venv/bin/python scripts/bench_transport.py [--loop uvloop] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import zmq

from mstar.actors import Actor, ActorSystem, SystemConfig
from mstar.actors.process import SystemProcess
from mstar.baselines.transport import (
    queue_echo,
    queue_floor,
    raw_zmq_peer,
    shm_copy_floors,
    zmq_blocking_floor,
    zmq_dealer,
    zmq_floor,
    zmq_ping,
)
from mstar.bench import (
    ClosedLoop,
    make_requests,
    plot_png,
    print_table,
    run_benchmark,
    write_json,
)
from mstar.bench.calls import burst, per_round_trip, percentiles, time_calls
from mstar.wire import Ack, Ping, Pong, TensorBundle

TENSOR_BYTES = 16 << 20
# Handoffs in flight at once in the pipelined throughput runs.
PIPELINE_DEPTH = 4
SMALL_PAYLOAD = b"x" * 16


# ------------------------------------------------------------------------------- peer actors


class Echo(Actor):
    """Answer a Ping with a Pong."""

    async def handle(self, message: Any) -> Any:
        return Pong(message.seq, message.payload)


class Sink(Actor):
    """Count told Pings; answer a Pong with the count; acknowledge tensors."""

    def __init__(self) -> None:
        self.count = 0

    async def handle(self, message: Any) -> Any:
        if type(message) is Ping:
            self.count += 1
            return None
        if type(message) is Pong:
            count, self.count = self.count, 0
            return Pong(count)
        return Ack()


async def setup_peer(system: ActorSystem) -> None:
    """Spawn the benchmark's actors (runs in the peer process too)."""
    await system.spawn(Echo, name="echo")
    await system.spawn(Sink, name="sink", mailbox_size=1 << 20)


# --------------------------------------------------------------------------- measurements


async def mstar_runs(
    client: ActorSystem, address: str, n: int, warmup: int, n_tensors: int
) -> dict[str, Any]:
    echo = client.ref("echo", address)
    sink = client.ref("sink", address)
    ping = Ping(1, SMALL_PAYLOAD)
    samples = await time_calls(lambda: echo.ask(ping), n, warmup)

    total = n * 4
    await sink.ask(Pong())  # reset the count
    t0 = time.perf_counter()
    for i in range(total):
        sink.tell(ping)
        if i % 256 == 255:
            await asyncio.sleep(0)  # let links and peers run, as a sender loop would
    got = (await sink.ask(Pong())).seq
    rate = total / (time.perf_counter() - t0)
    assert got == total, (got, total)

    bundle = TensorBundle({"x": torch.randn(TENSOR_BYTES // 4)})
    tensor_samples = await time_calls(lambda: sink.ask(bundle), n_tensors, 3)

    async def send_window() -> None:
        await asyncio.gather(*(sink.ask(bundle) for _ in range(PIPELINE_DEPTH)))

    window_samples = await time_calls(send_window, max(2, n_tensors // PIPELINE_DEPTH), 1)
    return {"rtt": samples, "rate": rate, "tensor": tensor_samples, "window": window_samples}


async def burst_run(
    scheme: str,
    ask: Callable[[], Awaitable[Any]],
    floor: Callable[[], Awaitable[Any]],
    floor_label: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Time bursts of asks and of raw floor round trips on the harness; report and save them.

    Returns the mean round trip inside a burst (p50 and p99 over the bursts) of both targets,
    and their ratio mstar / floor.
    """
    k = args.burst
    result = await run_benchmark(
        {"mstar": burst(ask, k), "floor": burst(floor, k)},
        make_requests([f"{k} small-message round trips"]),
        ClosedLoop((1,), num_requests=args.bursts, warmup=1),
        name=f"transport {scheme}: ActorRef.ask vs {floor_label}, {k} round trips per request",
        progress=False,
        config={
            "transport": scheme,
            "round_trips_per_request": k,
            "floor": floor_label,
            "loop": args.loop,
            "payload_bytes": len(SMALL_PAYLOAD),
        },
    )
    print_table(result)
    write_json(result, args.out / f"transport_{scheme}.json")
    plot_png(result, args.out / f"transport_{scheme}.png")
    return per_round_trip(result, k)


def gbps(samples_ns: list[int]) -> float:
    """Median handoff throughput in GB/s (bytes per ns)."""
    return TENSOR_BYTES / statistics.median(samples_ns)


def window_gbps(samples_ns: list[int]) -> float:
    """Median throughput of windows of `PIPELINE_DEPTH` handoffs in flight, in GB/s."""
    return PIPELINE_DEPTH * TENSOR_BYTES / statistics.median(samples_ns)


def best_gbps(samples_ns: list[int]) -> float:
    """Throughput of the fastest handoff: what the path does when the machine lets it."""
    return TENSOR_BYTES / min(samples_ns)


# -------------------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    n, warmup, n_tensors = args.n, args.n // 10, args.tensors
    results: dict[str, Any] = {}
    config = SystemConfig(shm_arena_bytes=args.arena_mib << 20)
    frames_config = SystemConfig(shm_arena_bytes=0)

    # inproc: two systems in this process.
    floor_rtt, floor_rate = await queue_floor(n, warmup)
    async with ActorSystem(config) as server, ActorSystem(config) as client:
        address = await server.serve("inproc://bench")
        await setup_peer(server)
        await client.connect(address)
        ours = await mstar_runs(client, address, n, warmup, n_tensors)
        ask = functools.partial(client.ref("echo", address).ask, Ping(1, SMALL_PAYLOAD))
        async with queue_echo() as floor_ping:
            bursts = await burst_run("inproc", ask, floor_ping, "asyncio.Queue ping-pong", args)
    results["inproc"] = {
        "bursts": bursts,
        "floor": {**percentiles(floor_rtt), "msgs_per_s": floor_rate},
        "mstar": {**percentiles(ours["rtt"]), "msgs_per_s": ours["rate"]},
        "handoff_gbps": {"by reference": gbps(ours["tensor"])},
        "pipelined_gbps": {"by reference": window_gbps(ours["window"])},
    }

    # ipc and tcp: peers in spawned processes.
    context = multiprocessing.get_context("spawn")
    raws, raw_endpoints = [], {}
    for mode in (args.loop, "blocking"):
        ours_end, theirs = context.Pipe()
        endpoints = ["ipc://" + _ipc_path(mode), "tcp://127.0.0.1:*"]
        raw = context.Process(target=raw_zmq_peer, args=(endpoints, mode, theirs), daemon=True)
        raw.start()
        raws.append(raw)
        raw_endpoints[mode] = dict(
            zip(("ipc", "tcp"), json.loads(ours_end.recv_bytes()), strict=True)
        )
    serve = ["ipc://", "tcp://127.0.0.1:0"]
    setup = f"{Path(__file__).stem}:setup_peer"
    shm_peer = SystemProcess(setup, serve=serve, config=config, loop=args.loop)
    frames_peer = SystemProcess(setup, serve=serve, config=frames_config, loop=args.loop)
    try:
        shm_eps = dict(zip(("ipc", "tcp"), await asyncio.to_thread(shm_peer.start), strict=True))
        frames_eps = dict(
            zip(("ipc", "tcp"), await asyncio.to_thread(frames_peer.start), strict=True)
        )
        shm_floors = shm_copy_floors(n_tensors, TENSOR_BYTES)
        for scheme in ("ipc", "tcp"):
            floor = await zmq_floor(
                raw_endpoints[args.loop][scheme],
                n,
                warmup,
                n_tensors,
                payload=SMALL_PAYLOAD,
                tensor_bytes=TENSOR_BYTES,
                depth=PIPELINE_DEPTH,
            )
            blocking = zmq_blocking_floor(
                raw_endpoints["blocking"][scheme], n, warmup, payload=SMALL_PAYLOAD
            )
            async with ActorSystem(config) as client:
                await client.connect(shm_eps[scheme])
                ours = await mstar_runs(client, shm_eps[scheme], n, warmup, n_tensors)
                ask = functools.partial(
                    client.ref("echo", shm_eps[scheme]).ask, Ping(1, SMALL_PAYLOAD)
                )
                with zmq_dealer(raw_endpoints[args.loop][scheme]) as sock:
                    bursts = await burst_run(
                        scheme,
                        ask,
                        zmq_ping(sock, SMALL_PAYLOAD),
                        f"pyzmq {args.loop} ping-pong",
                        args,
                    )
            async with ActorSystem(frames_config) as client:
                await client.connect(frames_eps[scheme])
                framed = await mstar_runs(
                    client, frames_eps[scheme], max(n // 5, 100), warmup, n_tensors
                )
            results[scheme] = {
                "bursts": bursts,
                "floor": {**percentiles(floor["rtt"]), "msgs_per_s": floor["rate"]},
                "blocking_floor": percentiles(blocking),
                "mstar": {**percentiles(ours["rtt"]), "msgs_per_s": ours["rate"]},
                "handoff_gbps": {
                    "shm arena": gbps(ours["tensor"]),
                    "zmq frames": gbps(framed["tensor"]),
                    "raw shm torch copy_": gbps(shm_floors["torch copy_"]),
                    "raw shm memmove": gbps(shm_floors["memmove"]),
                    "raw pyzmq send": gbps(floor["tensor"]),
                },
                "pipelined_gbps": {
                    "shm arena": window_gbps(ours["window"]),
                    "zmq frames": window_gbps(framed["window"]),
                    "raw pyzmq send": window_gbps(floor["window"]),
                },
                "handoff_best_gbps": {
                    "shm arena": best_gbps(ours["tensor"]),
                    "raw shm torch copy_": best_gbps(shm_floors["torch copy_"]),
                    "raw shm memmove": best_gbps(shm_floors["memmove"]),
                },
            }
    finally:
        await asyncio.to_thread(shm_peer.stop)
        await asyncio.to_thread(frames_peer.stop)
        for raw in raws:
            raw.kill()
            raw.join()
    return results


def _ipc_path(tag: str) -> str:
    return str(Path(tempfile.gettempdir()) / f"mstar-bench-{os.getpid()}-{tag}.sock")


def report(results: dict[str, Any], loop: str) -> list[str]:
    """Print the tables and ratios; return the targets missed."""
    failures = []
    print()
    print(f"ask round trip of a small message, and one-way {'tell':s} throughput ({loop} loop):")
    print(f"  {'transport':<10}{'':<22}{'p50 us':>9}{'p99 us':>9}{'msgs/s':>11}")
    for name, r in results.items():
        floor_label = "asyncio.Queue floor" if name == "inproc" else f"pyzmq {loop} floor"
        rows = [(floor_label, r["floor"]), ("mstar ActorRef.ask", r["mstar"])]
        for label, row in rows:
            rate = f"{row['msgs_per_s']:>11.0f}"
            print(f"  {name:<10}{label:<22}{row['p50_us']:>9.1f}{row['p99_us']:>9.1f}{rate}")
        if "blocking_floor" in r:
            row = r["blocking_floor"]
            print(
                "  "
                f"{name:<10}{'pyzmq blocking (info)':<22}{row['p50_us']:>9.1f}{row['p99_us']:>9.1f}"
            )
        p50 = r["mstar"]["p50_us"] / r["floor"]["p50_us"]
        p99 = r["mstar"]["p99_us"] / r["floor"]["p99_us"]
        rate = r["mstar"]["msgs_per_s"] / r["floor"]["msgs_per_s"]
        target = 2.0 if name == "inproc" else 1.5
        ok = p50 <= target
        r["ratios"] = {"ask_p50": p50, "ask_p99": p99, "tell_throughput": rate}
        print(
            f"  {name:<10}{'ratio mstar/floor':<22}{p50:>8.2f}x{p99:>8.2f}x{rate:>10.2f}x"
            f"   target p50 <= {target}x: {'PASS' if ok else 'FAIL'}"
        )
        if not ok:
            failures.append(f"{name} ask p50 ratio {p50:.2f}x > {target}x")
    print()
    print(
        "mean round trip inside a burst, from the harness runs above: E2E / round trips per burst,"
    )
    print("p50 and p99 over the bursts (the harness ratio above is its inverse):")
    print(f"  {'transport':<10}{'':<22}{'p50 us':>9}{'p99 us':>9}")
    for name, r in results.items():
        b = r["bursts"]
        for label in ("floor", "mstar"):
            print(f"  {name:<10}{label:<22}{b[label]['p50_us']:>9.1f}{b[label]['p99_us']:>9.1f}")
        print(
            f"  {name:<10}{'ratio mstar/floor':<22}{b['ratio_p50']:>8.2f}x   (bursts of "
            f"{b['round_trips_per_burst']})"
        )
    print()
    print("16 MiB tensor handoff, GB/s (median). One at a time: an ask carrying the tensor,")
    print(
        f"acknowledged by the receiver. Pipelined: {PIPELINE_DEPTH} such asks in flight (the "
        "target's figure)."
    )
    for name, r in results.items():
        cells = ", ".join(f"{k} {v:.1f}" for k, v in r["handoff_gbps"].items())
        print(f"  {name:<8} one at a time: {cells}")
        cells = ", ".join(f"{k} {v:.1f}" for k, v in r["pipelined_gbps"].items())
        print(f"  {'':<8} pipelined:    {cells}")
        if "shm arena" in r["pipelined_gbps"]:
            shm = r["pipelined_gbps"]["shm arena"]
            ok = shm >= 10.0
            raw = max(
                r["handoff_gbps"]["raw shm torch copy_"], r["handoff_gbps"]["raw shm memmove"]
            )
            best = r["handoff_best_gbps"]
            print(
                f"  {'':<8} pipelined shm arena / faster raw copy {shm / raw:.2f}x; "
                f"target >= 10 GB/s: {'PASS' if ok else 'FAIL'}"
            )
            print(
                f"  {'':<8} fastest single handoff {best['shm arena']:.1f} GB/s; fastest raw "
                "copies: "
                f"torch copy_ {best['raw shm torch copy_']:.1f}, memmove "
                f"{best['raw shm memmove']:.1f} GB/s"
            )
            if not ok:
                failures.append(f"{name} pipelined shm handoff {shm:.1f} GB/s < 10")
    return failures


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    xs = range(len(names))
    ax1.bar(
        [x - 0.2 for x in xs],
        [results[n]["floor"]["p50_us"] for n in names],
        0.4,
        label="raw floor",
    )
    ax1.bar(
        [x + 0.2 for x in xs],
        [results[n]["mstar"]["p50_us"] for n in names],
        0.4,
        label="mstar ask",
    )
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("round trip p50 (us)")
    ax1.set_yscale("log")
    ax1.legend()
    rows = [
        (f"{n}: {k}{suffix}", v)
        for n in names
        if n != "inproc"
        for key, suffix in (("handoff_gbps", ""), ("pipelined_gbps", f" x{PIPELINE_DEPTH}"))
        for k, v in results[n][key].items()
    ]
    ax2.barh([r[0] for r in rows], [r[1] for r in rows])
    ax2.axvline(10.0, color="red", linestyle="--", label="target 10 GB/s")
    ax2.set_xlabel("16 MiB handoff (GB/s)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--n", type=int, default=5000, help="round trips per measurement")
    parser.add_argument("--tensors", type=int, default=30, help="16 MiB handoffs per measurement")
    parser.add_argument("--burst", type=int, default=500, help="round trips per harness request")
    parser.add_argument(
        "--bursts", type=int, default=10, help="measured harness requests per target"
    )
    parser.add_argument("--arena-mib", type=int, default=128, help="shared arena size")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results/transport"), help="output folder"
    )
    args = parser.parse_args()
    if args.quick:
        args.n, args.tensors, args.burst, args.bursts = 500, 8, 100, 5
    print("bench_transport configuration:")
    print(
        f"  python {platform.python_version()}, torch {torch.__version__}, pyzmq "
        f"{zmq.__version__}, "
        f"libzmq {zmq.zmq_version()}, loop {args.loop}"
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"  cpus {os.cpu_count()}, torch threads {torch.get_num_threads()}, load average {load}")
    print(
        f"  small message: Ping with a {len(SMALL_PAYLOAD)}-byte payload; {args.n} round trips "
        f"(+{args.n // 10} warm-up), {args.n * 4} one-way messages"
    )
    print(
        f"  tensor: {TENSOR_BYTES >> 20} MiB float32, {args.tensors} handoffs; arena "
        f"{args.arena_mib} MiB"
    )
    print(
        f"  harness: {args.bursts} bursts (+1 warm-up) of {args.burst} round trips per "
        "target and transport"
    )
    if args.n < 1 or args.tensors < 1 or args.burst < 1 or args.bursts < 1:
        parser.error("--n, --tensors, --burst and --bursts must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.loop == "uvloop":
        import uvloop

        results = uvloop.run(run(args))
    else:
        results = asyncio.run(run(args))
    failures = report(results, args.loop)
    (args.out / "transport.json").write_text(
        json.dumps({"config": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
    )
    plot(results, args.out / "transport.png")
    print(
        f"\nwrote {args.out / 'transport.json'}, {args.out / 'transport.png'} and the harness's "
        f"transport_{{inproc,ipc,tcp}}.json/.png"
    )
    if failures:
        print("targets missed: " + "; ".join(failures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
