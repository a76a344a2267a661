"""pi0.5 behind openpi's WebSocket policy protocol, driven by the real `openpi-client` robot client:
metadata first, un-normalized (horizon, 8) action chunks, many robots at once, bad observations
answered with an error frame while the other robots go on, API keys, /healthz. Long sessions and
every kind of malformed frame: test_openpi_sessions.py."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import websockets.sync.client
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from mstar.runtime.model import ModelSpec, Request
from mstar.server import ServerConfig
from mstar.server.openpi import pack, unpack
from mstar.zoo.pi05.model import Pi05Model
from tests.server.conftest import RunningServer, running_server

# openpi-client 0.1.2 opens its connection without a context manager, which websockets warns about.
pytestmark = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
)

SPEC = ModelSpec("mstar.zoo.pi05.model:Pi05Model", {"config": "pi05-tiny"})


def observation(seed: int) -> dict[str, Any]:
    g = np.random.default_rng(seed)
    return {
        "observation/exterior_image_1_left": g.integers(0, 256, (32, 48, 3), dtype=np.uint8),
        "observation/wrist_image_left": g.integers(0, 256, (32, 32, 3), dtype=np.uint8),
        "observation/joint_position": g.uniform(-1.0, 1.0, 7),
        "observation/gripper_position": g.uniform(0.0, 1.0, 1),
        "prompt": "pick up the cup",
        "seed": seed,
    }


@pytest.fixture(scope="module")
def pi05_server() -> Iterator[RunningServer]:
    with running_server(SPEC, names=("pi05-tiny",)) as server:
        yield server


def expected(seed: int) -> np.ndarray:
    """The same request through the in-process engine path (its own engine)."""
    import asyncio

    from mstar.runtime import AsyncEngine

    async def run() -> np.ndarray:
        async with await AsyncEngine.start(Pi05Model("pi05-tiny")) as engine:
            outputs = await engine.run(Request("act", observation(seed)))
        return next(o.data for o in outputs if o.name == "actions")

    return asyncio.run(run())


def test_openpi_client_gets_unnormalized_action_chunks(pi05_server: RunningServer) -> None:
    host, port = pi05_server.url.removeprefix("http://").split(":")
    client = WebsocketClientPolicy(host, int(port))
    assert client.get_server_metadata() == {
        "model": "pi05-tiny",
        "robot": "droid",
        "action_horizon": 10,
        "action_dim": 8,
    }
    reply = client.infer(observation(0))
    assert reply["actions"].shape == (10, 8) and reply["actions"].dtype == np.float32
    assert reply["policy_timing"]["infer_ms"] > 0 and "infer_ms" in reply["server_timing"]
    np.testing.assert_allclose(reply["actions"], expected(0), rtol=1e-5, atol=1e-5)
    second = client.infer(observation(1))
    assert "prev_total_ms" in second["server_timing"]
    assert not np.allclose(second["actions"], reply["actions"])


def test_many_robots_at_once_and_a_bad_one_fails_alone(pi05_server: RunningServer) -> None:
    host, port = pi05_server.url.removeprefix("http://").split(":")

    def robot(seed: int) -> np.ndarray:
        client = WebsocketClientPolicy(host, int(port))
        return np.stack([client.infer(observation(seed))["actions"] for _ in range(2)])

    steps_before = pi05_server.call(pi05_server.state.engine.stats())[0]["llm"]["steps"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(robot, seed) for seed in range(8)]
        bad = WebsocketClientPolicy(host, int(port))
        with pytest.raises(RuntimeError, match="joint_position"):
            bad.infer({**observation(99), "observation/joint_position": np.zeros(3)})
        chunks = [f.result(timeout=120) for f in futures]
    assert not np.allclose(chunks[0][0], chunks[1][0])  # each robot its own observation
    for chunk in chunks:
        # Seeded noise: the same chunk twice (up to float rounding: other robots shared the
        # batches).
        np.testing.assert_allclose(chunk[0], chunk[1], rtol=1e-5, atol=1e-5)
        assert chunk.shape == (2, 10, 8)
    stats = pi05_server.call(pi05_server.state.engine.stats())[0]["llm"]
    assert stats["steps"] - steps_before < 16 * 11  # robots shared steps
    held = pi05_server.wait_idle()
    assert all(v == 0 for counts in held.values() for v in counts.values()), held


def test_messages_use_openpis_array_encoding() -> None:
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.uint8(7), "c": [1, "x"]}
    ours = unpack(msgpack_numpy.packb(arrays))  # openpi's packer, our decoder
    np.testing.assert_array_equal(ours["a"], arrays["a"])
    assert ours["b"] == 7 and ours["c"] == [1, "x"]
    theirs = msgpack_numpy.unpackb(pack(arrays))  # our packer, openpi's decoder
    np.testing.assert_array_equal(theirs["a"], arrays["a"])
    short = {b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "<f4", b"shape": [2, 3]}
    with pytest.raises(ValueError, match="needs 24 bytes"):
        unpack(msgpack.packb({"a": short}, use_bin_type=True))


def test_healthz_and_api_keys() -> None:
    with running_server(
        SPEC, ServerConfig(port=0, api_key="sekret"), names=("pi05-tiny",)
    ) as server:
        assert httpx.get(f"{server.url}/healthz").text == "OK\n"
        host, port = server.url.removeprefix("http://").split(":")
        with pytest.raises(websockets.exceptions.InvalidStatus):
            WebsocketClientPolicy(host, int(port))
        # Authorization: Api-Key sekret
        client = WebsocketClientPolicy(host, int(port), api_key="sekret")
        assert client.infer(observation(5))["actions"].shape == (10, 8)


def test_native_generate_returns_the_action_chunk(pi05_server: RunningServer) -> None:
    import base64
    import json

    obs = observation(7)
    body = {
        "task": "act",
        "data": {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in obs.items()},
    }
    response = httpx.post(f"{pi05_server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines() if line]
    (chunk,) = [line for line in lines if line.get("name") == "actions"]
    assert (
        chunk["modality"] == "action" and chunk["shape"] == [10, 8] and chunk["dtype"] == "float32"
    )
    actions = np.frombuffer(base64.b64decode(chunk["data"]), dtype="<f4").reshape(10, 8)
    host, port = pi05_server.url.removeprefix("http://").split(":")
    over_ws = WebsocketClientPolicy(host, int(port)).infer(obs)["actions"]
    np.testing.assert_allclose(actions, over_ws, rtol=1e-5, atol=1e-5)
    bad = httpx.post(
        f"{pi05_server.url}/generate", json={"task": "act", "data": {"prompt": "x"}}, timeout=60
    )
    assert bad.status_code == 400 and "DROID observation has no" in bad.text
