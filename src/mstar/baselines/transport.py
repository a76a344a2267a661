"""Raw floors of mstar's actor transports: the same messages without mstar's actors.

What ``ActorRef.ask`` and ``tell`` are measured against, on the same machine in the same run:

- in process: a bare asyncio-queue ping-pong between two tasks (`queue_echo`, `queue_floor`);
- between processes: bare pyzmq sockets on the same address scheme (ipc, tcp), a DEALER here
  and a ROUTER in a spawned process (`raw_zmq_peer`): a ping-pong, one-way messages counted
  by the peer, and large frames acknowledged by it (`zmq_dealer`, `zmq_ping`, `zmq_floor`),
  also with blocking sockets and no event loop on either side (`zmq_blocking_floor`);
- a tensor handoff through shared memory: one copy into a prefaulted ``/dev/shm`` mapping, the
  one copy an arena handoff makes (`shm_copy_floors`).

Times are ``time.perf_counter_ns`` samples, one per call (`mstar.bench.calls.time_calls`).
The raw peer speaks a protocol of one-byte kinds: ``p`` is echoed, ``t`` counted, ``c``
answered with the count (reset), anything else acknowledged with ``ok``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import mmap
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.asyncio

from mstar.bench.calls import time_calls

__all__ = [
    "queue_echo",
    "queue_floor",
    "raw_zmq_peer",
    "shm_copy_floors",
    "zmq_blocking_floor",
    "zmq_dealer",
    "zmq_floor",
    "zmq_ping",
]


def raw_zmq_peer(endpoints: list[str], mode: str, ready: Any) -> None:
    """Serve bare pyzmq ROUTERs: echo b"p", count b"t", report the count on b"c", ack the rest.

    The target of a spawned process. `mode` is "asyncio" or "uvloop" (zmq.asyncio sockets, one
    task per socket) or "blocking" (plain sockets and a poller, no event loop at all). Once
    bound, the endpoints (a wildcard port resolved) are sent as JSON through the ``ready``
    connection end.
    """

    def bind(ctx: zmq.Context[Any]) -> list[zmq.Socket[Any]]:
        socks = []
        for endpoint in endpoints:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.bind(endpoint)
            socks.append(sock)
        ready.send_bytes(
            json.dumps([s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks]).encode()
        )
        return socks

    counts: dict[int, int] = {}

    def answer(index: int, frames: list[Any]) -> list[Any] | None:
        kind = frames[1].bytes
        if kind == b"p":
            return [frames[0], frames[1], frames[2]]
        if kind == b"t":
            counts[index] = counts.get(index, 0) + 1
            return None
        if kind == b"c":
            count, counts[index] = counts.get(index, 0), 0
            return [frames[0], str(count).encode()]
        return [frames[0], b"ok"]

    if mode == "blocking":
        socks = bind(zmq.Context.instance())
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                out = answer(socks.index(sock), sock.recv_multipart(copy=False))
                if out is not None:
                    sock.send_multipart(out, copy=False)

    async def serve() -> None:
        socks = bind(zmq.asyncio.Context.instance())

        async def run(index: int, sock: Any) -> None:
            while True:
                out = answer(index, await sock.recv_multipart(copy=False))
                if out is not None:
                    await sock.send_multipart(out, copy=False)

        await asyncio.gather(*(run(i, s) for i, s in enumerate(socks)))

    _run_loop(mode, serve())


def _run_loop(loop_name: str, main: Awaitable[None]) -> None:
    if loop_name == "uvloop":
        import uvloop

        uvloop.run(main)  # type: ignore[arg-type]
    else:
        asyncio.run(main)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def queue_echo() -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Run a task echoing an asyncio queue into another; yield one ping-pong with it."""
    to_peer: asyncio.Queue[Any] = asyncio.Queue()
    back: asyncio.Queue[Any] = asyncio.Queue()

    async def peer() -> None:
        while True:
            item = await to_peer.get()
            if item is None:
                return
            back.put_nowait(item)

    task = asyncio.create_task(peer())

    async def ping() -> None:
        to_peer.put_nowait(1)
        await back.get()

    try:
        yield ping
    finally:
        to_peer.put_nowait(None)
        await task


@contextlib.contextmanager
def zmq_dealer(endpoint: str) -> Iterator[Any]:
    """Yield a zmq.asyncio DEALER connected to a raw peer's ROUTER; close it on exit."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=0)


def zmq_ping(sock: Any, payload: bytes) -> Callable[[], Awaitable[None]]:
    """Return one raw round trip of ``payload`` through a `zmq_dealer` to the echoing peer."""

    async def ping() -> None:
        await sock.send_multipart([b"p", payload])
        await sock.recv_multipart(copy=False)

    return ping


async def queue_floor(n: int, warmup: int) -> tuple[list[int], float]:
    """Time ``n`` bare asyncio-queue ping-pongs between two tasks (after ``warmup``); measure
    one-way queue throughput (``4 n`` items, per second)."""
    async with queue_echo() as ping:
        samples = await time_calls(ping, n, warmup)

    counted = asyncio.Event()
    sink: asyncio.Queue[Any] = asyncio.Queue()
    total = n * 4

    async def consumer() -> None:
        for _ in range(total):
            await sink.get()
        counted.set()

    task = asyncio.create_task(consumer())
    t0 = time.perf_counter()
    for i in range(total):
        sink.put_nowait(i)
        if i % 256 == 255:
            await asyncio.sleep(0)  # let the consumer run, as a sender loop would
    await counted.wait()
    rate = total / (time.perf_counter() - t0)
    await task
    return samples, rate


async def zmq_floor(
    endpoint: str,
    n: int,
    warmup: int,
    n_tensors: int,
    *,
    payload: bytes,
    tensor_bytes: int,
    depth: int,
) -> dict[str, Any]:
    """Time bare zmq.asyncio DEALER runs against a raw peer, as mstar's asks and tells are.

    Returns ``rtt``: ``n`` ping-pongs of ``payload`` (after ``warmup``); ``rate``: one-way
    messages per second (``4 n`` sent, then counted by the peer); ``tensor``: ``n_tensors``
    frames of ``tensor_bytes`` each acknowledged; ``window``: ``depth`` such frames in flight
    at a time, per window.
    """
    with zmq_dealer(endpoint) as sock:
        return await _zmq_floor_runs(sock, n, warmup, n_tensors, payload, tensor_bytes, depth)


async def _zmq_floor_runs(
    sock: Any, n: int, warmup: int, n_tensors: int, payload: bytes, tensor_bytes: int, depth: int
) -> dict[str, Any]:
    samples = await time_calls(zmq_ping(sock, payload), n, warmup)
    total = n * 4
    t0 = time.perf_counter()
    for _ in range(total):
        await sock.send_multipart([b"t", payload])
    await sock.send_multipart([b"c"])
    got = int((await sock.recv_multipart())[0])
    rate = total / (time.perf_counter() - t0)
    assert got == total, (got, total)

    buffer = torch.randn(tensor_bytes // 4).view(torch.uint8).numpy()

    async def send_tensor() -> None:
        await sock.send_multipart([b"x", buffer], copy=False)
        await sock.recv_multipart()

    tensor_samples = await time_calls(send_tensor, n_tensors, 3)

    async def send_window() -> None:
        for _ in range(depth):
            await sock.send_multipart([b"x", buffer], copy=False)
        for _ in range(depth):
            await sock.recv_multipart()

    window_samples = await time_calls(send_window, max(2, n_tensors // depth), 1)
    return {"rtt": samples, "rate": rate, "tensor": tensor_samples, "window": window_samples}


def zmq_blocking_floor(endpoint: str, n: int, warmup: int, *, payload: bytes) -> list[int]:
    """Time ``n`` bare blocking pyzmq DEALER ping-pongs to a blocking peer: no event loop on
    either side."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    samples = []
    for i in range(n + warmup):
        t0 = time.perf_counter_ns()
        sock.send_multipart([b"p", payload])
        sock.recv_multipart(copy=False)
        if i >= warmup:
            samples.append(time.perf_counter_ns() - t0)
    sock.close()
    return samples


def shm_copy_floors(n: int, tensor_bytes: int) -> dict[str, list[int]]:
    """Time ``n`` copies of ``tensor_bytes`` into a prefaulted /dev/shm mapping (the one copy an
    arena handoff makes).

    Two raw methods, interleaved so that both see the same machine: torch's `copy_` over the
    intra-op threads, and one `memmove` in this thread.
    """
    path = Path("/dev/shm") / f"mstar-bench-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, tensor_bytes)
        mapping = mmap.mmap(fd, tensor_bytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        path.unlink()
    dst = torch.frombuffer(mapping, dtype=torch.uint8)
    dst.zero_()
    src = torch.randn(tensor_bytes // 4).view(torch.uint8)
    samples: dict[str, list[int]] = {"torch copy_": [], "memmove": []}
    for i in range(n + 3):
        t0 = time.perf_counter_ns()
        dst.copy_(src)
        t1 = time.perf_counter_ns()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), tensor_bytes)
        t2 = time.perf_counter_ns()
        if i >= 3:
            samples["torch copy_"].append(t1 - t0)
            samples["memmove"].append(t2 - t1)
    del dst
    mapping.close()
    return samples
