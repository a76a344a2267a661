#!/usr/bin/env python
"""Workers on Ray "nodes" against worker processes on one machine, and against raw tcp.

A local Ray cluster (this machine; everything on loopback) has two nodes: the driver's,
advertising ``node_a``, and one advertising ``node_b``. The same model and placement run
three ways, side by side in one run:

- ``ray nodes``: each rank a Ray actor pinned to its node (``ray_resources``), ZeroMQ over
  tcp with CURVE between them, tensors as frames (two Ray nodes are two hosts: no shared
  memory);
- ``processes``: each rank a worker process on this machine (ipc, shared-memory arena);
- the floors: a bare ZeroMQ tcp round trip between two processes (64 B, and the payload),
  plain and with CURVE (what every mstar tcp link pays for encryption).

Measured:

- per-walk-step overhead: `noop-loop` (``a`` on rank 0 / node A, ``b`` on rank 1 / node B),
  every step one round trip between the ranks; request latency / steps;
- tensor throughput between the ranks: the same loop carrying a float32 tensor of
  ``--payload-mib`` each way every step (bytes moved / time);
- Ray's own data plane for comparison: the payload sent to an actor on node B and back
  through Ray's object store (``ray.get(actor.echo.remote(tensor))``).

Every figure is the median of ``--rounds`` interleaved rounds (the machine's load drifts);
ratios are against the floors measured in the same rounds. Writes JSON and a PNG.

    .venv/bin/python scripts/bench_multinode.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's default address: loopback

import torch
import zmq
import zmq.asyncio

from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request

LOOPBACK = "127.0.0.1"
ACROSS_NODES = """
model: noop-loop
node_groups:
  - {node_names: [a, done], ranks: [0], ray_resources: {node_a: 1}}
  - {node_names: [b], ranks: [1], ray_resources: {node_b: 1}}
"""
TWO_PROCESSES = """
model: noop-loop
node_groups:
  - {node_names: [a, done], ranks: [0]}
  - {node_names: [b], ranks: [1]}
"""


# ----------------------------------------------------------------------------- raw tcp floor


def _echo_child(address: str, count: int, curve: tuple[bytes, bytes, bytes] | None) -> None:
    """Child process: connect a DEALER to ``address``; send back ``count`` messages."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(address)
    sock.send(b"ready")
    for _ in range(count):
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
    sock.close(linger=1000)
    ctx.term()


async def tcp_floor(
    num_small: int, payload: bytes, num_payload: int, curve: bool = False
) -> tuple[float, float]:
    """Return the median tcp round trip of 64 B (s) and the payload's echo rate (bytes/s)."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    client_keys = None
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = server_public, server_secret
        client_keys = (server_public, client_public, client_secret)
    port = router.bind_to_random_port(f"tcp://{LOOPBACK}")
    child = multiprocessing.get_context("spawn").Process(
        target=_echo_child, args=(f"tcp://{LOOPBACK}:{port}", num_small + num_payload, client_keys)
    )
    child.start()
    try:
        identity, _ = await asyncio.wait_for(router.recv_multipart(), 120)
        times = []
        for _ in range(num_small):
            start = time.perf_counter()
            await router.send_multipart([identity, b"x" * 64])
            await router.recv_multipart()
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(num_payload):
            await router.send_multipart([identity, payload], copy=False)
            await router.recv_multipart(copy=False)
        rate = 2 * len(payload) * num_payload / (time.perf_counter() - start)
    finally:
        await asyncio.to_thread(child.join, 30)
        if child.is_alive():
            child.kill()
        router.close(0)
        ctx.term()
    return statistics.median(times), rate


# ------------------------------------------------------------------------------- the engines


async def walk_seconds(engine: AsyncEngine, steps: int, tag: str) -> float:
    """Run one request; return its seconds per step."""
    start = time.perf_counter()
    await engine.run(Request("loop", {}, request_id=tag))
    return (time.perf_counter() - start) / steps


async def measure(args: argparse.Namespace, ray: Any) -> dict[str, Any]:
    payload_numel = int(args.payload_mib * (1 << 20)) // 4
    payload_bytes = payload_numel * 4
    loop_spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": args.steps})
    tensor_spec = ModelSpec(
        "mstar.zoo.noop:NoopLoopModel",
        {"steps": args.payload_steps, "payload_numel": payload_numel},
    )
    ray_config = EngineConfig(ray_address="auto", ray_num_cpus=0.5, offload_steps=False)
    proc_config = EngineConfig(worker_processes=True, offload_steps=False)

    @ray.remote(num_cpus=0, resources={"node_b": 1})
    class Echo:
        def echo(self, x: Any) -> Any:
            return x

    echo = Echo.remote()  # type: ignore[attr-defined]
    tensor = torch.randn(payload_numel)
    ray.get(echo.echo.remote(tensor))  # warm up (the actor starts)

    rounds: list[dict[str, float]] = []
    engines: dict[str, AsyncEngine] = {}
    try:
        engines["ray nodes"] = await AsyncEngine.start(
            loop_spec, Placement.from_yaml(ACROSS_NODES), ray_config
        )
        engines["processes"] = await AsyncEngine.start(
            loop_spec, Placement.from_yaml(TWO_PROCESSES), proc_config
        )
        engines["ray nodes/tensor"] = await AsyncEngine.start(
            tensor_spec, Placement.from_yaml(ACROSS_NODES), ray_config
        )
        engines["processes/tensor"] = await AsyncEngine.start(
            tensor_spec, Placement.from_yaml(TWO_PROCESSES), proc_config
        )
        for e in engines.values():  # warm up
            await e.run(Request("loop", {}, request_id="warm-up"))
        for i in range(args.rounds):
            raw = tensor.numpy().tobytes()
            rtt, tcp_rate = await tcp_floor(args.rtt_samples, raw, args.payload_steps)
            curve_rtt, curve_rate = await tcp_floor(
                args.rtt_samples, raw, args.payload_steps, curve=True
            )
            row = {
                "tcp_rtt_s": rtt,
                "tcp_bytes_per_s": tcp_rate,
                "curve_rtt_s": curve_rtt,
                "curve_bytes_per_s": curve_rate,
            }
            for name in ("ray nodes", "processes"):
                row[f"{name}_step_s"] = await walk_seconds(
                    engines[name], args.steps, f"r{i}-{name}"
                )
            for name in ("ray nodes", "processes"):
                per_step = await walk_seconds(
                    engines[f"{name}/tensor"], args.payload_steps, f"t{i}-{name}"
                )
                row[f"{name}_bytes_per_s"] = 2 * payload_bytes / per_step
            start = time.perf_counter()
            for _ in range(args.payload_steps):
                await asyncio.wrap_future(echo.echo.remote(tensor).future())
            row["ray_object_store_bytes_per_s"] = (
                2 * payload_bytes * args.payload_steps / (time.perf_counter() - start)
            )
            start = time.perf_counter()
            for _ in range(args.rtt_samples // 10 or 1):
                await asyncio.wrap_future(echo.echo.remote(0).future())
            row["ray_call_rtt_s"] = (time.perf_counter() - start) / (args.rtt_samples // 10 or 1)
            rounds.append(row)
            print(f"round {i}: " + ", ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
    finally:
        for e in engines.values():
            await e.shutdown()
        ray.kill(echo)
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return {"payload_bytes": payload_bytes, "rounds": rounds, "median": median}


def report(result: dict[str, Any], out: Path, config: dict[str, Any]) -> None:
    m = result["median"]
    rtt = m["tcp_rtt_s"]
    print()
    print(f"{'per walk step':<34} {'us':>9} {'x tcp RTT':>10}")
    print(f"{'raw tcp round trip (64 B)':<34} {rtt * 1e6:>9.1f} {1.0:>10.2f}")
    print(
        f"{'raw tcp + CURVE round trip (64 B)':<34} {m['curve_rtt_s'] * 1e6:>9.1f} "
        f"{m['curve_rtt_s'] / rtt:>10.2f}"
    )
    for name in ("ray nodes", "processes"):
        step = m[f"{name}_step_s"]
        print(f"{'mstar walk step, ' + name:<34} {step * 1e6:>9.1f} {step / rtt:>10.2f}")
    print(
        f"{'Ray actor call (small)':<34} {m['ray_call_rtt_s'] * 1e6:>9.1f} "
        f"{m['ray_call_rtt_s'] / rtt:>10.2f}"
    )
    print()
    mib = result["payload_bytes"] / (1 << 20)
    tcp = m["tcp_bytes_per_s"]
    print(
        f"{'tensor throughput (' + f'{mib:g}' + ' MiB each way)':<34} {'GB/s':>9} {'x raw tcp':>10}"
    )
    rows = [
        ("raw tcp (ZeroMQ frames)", tcp),
        ("raw tcp + CURVE", m["curve_bytes_per_s"]),
        ("mstar walk, ray nodes (tcp)", m["ray nodes_bytes_per_s"]),
        ("mstar walk, processes (shm)", m["processes_bytes_per_s"]),
        ("Ray object store round trip", m["ray_object_store_bytes_per_s"]),
    ]
    for label, rate in rows:
        print(f"{label:<34} {rate / 1e9:>9.2f} {rate / tcp:>10.2f}")
    ratio = m["ray nodes_bytes_per_s"] / m["ray_object_store_bytes_per_s"]
    print(f"\nmstar tcp / Ray object store, between the same two nodes: {ratio:.2f}x")
    out.mkdir(parents=True, exist_ok=True)
    data = {"config": config, **result, "mstar_over_object_store": ratio}
    (out / "bench_multinode.json").write_text(json.dumps(data, indent=2))
    plot(data, out / "bench_multinode.png")
    print(f"wrote {out / 'bench_multinode.json'} and {out / 'bench_multinode.png'}")


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = data["median"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [
        "raw tcp\nRTT",
        "tcp+CURVE\nRTT",
        "walk step\nray nodes",
        "walk step\nprocesses",
        "Ray actor\ncall",
    ]
    values = [
        m["tcp_rtt_s"],
        m["curve_rtt_s"],
        m["ray nodes_step_s"],
        m["processes_step_s"],
        m["ray_call_rtt_s"],
    ]
    left.bar(
        labels,
        [v * 1e6 for v in values],
        color=["grey", "darkgrey", "tab:blue", "tab:orange", "tab:red"],
    )
    left.set_ylabel("microseconds")
    left.set_title("per walk step (median of rounds)")
    labels = ["raw tcp", "tcp+CURVE", "mstar\nray nodes", "mstar\nprocesses", "Ray object\nstore"]
    values = [
        m["tcp_bytes_per_s"],
        m["curve_bytes_per_s"],
        m["ray nodes_bytes_per_s"],
        m["processes_bytes_per_s"],
        m["ray_object_store_bytes_per_s"],
    ]
    right.bar(
        labels,
        [v / 1e9 for v in values],
        color=["grey", "darkgrey", "tab:blue", "tab:orange", "tab:red"],
    )
    right.set_ylabel("GB/s")
    right.set_title(f"tensor round trips, {data['payload_bytes'] / (1 << 20):g} MiB each way")
    fig.suptitle("mstar across Ray nodes vs worker processes vs raw tcp (one machine, loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000, help="walk steps per request (overhead)")
    parser.add_argument("--payload-mib", type=float, default=4.0, help="tensor each way per step")
    parser.add_argument("--payload-steps", type=int, default=20, help="steps per tensor request")
    parser.add_argument("--rtt-samples", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, one round (a smoke test)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/multinode"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.payload_mib, args.payload_steps, args.rtt_samples, args.rounds = (
            50,
            0.25,
            4,
            100,
            1,
        )
    import ray
    from ray.cluster_utils import Cluster

    config = {
        "steps": args.steps,
        "payload_mib": args.payload_mib,
        "payload_steps": args.payload_steps,
        "rounds": args.rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "ray": ray.__version__,
        "cluster": "local: head {node_a}, one node {node_b}; loopback",
    }
    print("config: " + json.dumps(config))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"node_a": 4},
            "node_ip_address": LOOPBACK,
            "include_dashboard": False,
        },
    )
    try:
        cluster.add_node(num_cpus=2, resources={"node_b": 4}, node_ip_address=LOOPBACK)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        result = asyncio.run(measure(args, ray))
    finally:
        ray.shutdown()
        cluster.shutdown()
    report(result, args.out, config)


if __name__ == "__main__":
    main()
