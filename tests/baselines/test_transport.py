"""The transports' raw floors: each run returns its samples; the raw peer speaks its protocol."""

from __future__ import annotations

import json
import multiprocessing

from mstar.baselines.transport import (
    queue_floor,
    raw_zmq_peer,
    shm_copy_floors,
    zmq_blocking_floor,
    zmq_floor,
)


async def test_queue_floor_times_each_ping_and_counts_a_rate() -> None:
    samples, rate = await queue_floor(20, 2)
    assert len(samples) == 20 and rate > 0


def test_shm_copy_floors_time_both_copies() -> None:
    samples = shm_copy_floors(4, 1 << 16)
    assert set(samples) == {"torch copy_", "memmove"}
    assert all(len(v) == 4 for v in samples.values())


async def test_zmq_floors_against_a_raw_peer_process() -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    peer = context.Process(
        target=raw_zmq_peer, args=(["tcp://127.0.0.1:*"], "asyncio", theirs), daemon=True
    )
    peer.start()
    try:
        (endpoint,) = json.loads(ours.recv_bytes())
        floor = await zmq_floor(
            endpoint, 20, 2, 3, payload=b"x" * 16, tensor_bytes=1 << 16, depth=2
        )
        # every one-way message counted by the peer (zmq_floor checks it), each run timed
        assert len(floor["rtt"]) == 20 and floor["rate"] > 0
        assert len(floor["tensor"]) == 3 and len(floor["window"]) == 2
        assert len(zmq_blocking_floor(endpoint, 10, 1, payload=b"y")) == 10
    finally:
        peer.kill()
        peer.join()
