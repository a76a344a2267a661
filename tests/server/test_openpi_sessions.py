"""Robot sessions on a server configured as `mstar serve` runs it (its uvicorn settings, the
10 s header deadline, WebSocket pings): openpi-client robots calling non-stop or idling for a
minute keep their connections while a slow-loris HTTP client is cut off at the deadline and a
peer that stops answering pings is dropped; a call that outlasts the ping timeout keeps its
connection; every malformed frame gets openpi's answer (the error as a text frame, then close
code 1011). In the same minute an `openai` realtime session idles past every timer on its path
and still answers (one wait for both long-lived protocols)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import openai
import pytest
import uvicorn
import websockets.sync.client
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.uri import parse_uri

from mstar.runtime import ModelSpec
from mstar.server import AdmissionLimits, ServerConfig, make_app
from mstar.server.openpi import pack, unpack
from mstar.server.runner import DrainingServer, uvicorn_config
from tests.server.conftest import (
    START_TIMEOUT_S,
    RunningServer,
    qwen3_omni_tiny_spec,
    serve_in_thread,
)
from tests.server.test_openpi_server import SPEC, observation

pytestmark = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
)

HEADER_TIMEOUT_S = ServerConfig().header_timeout_s  # the server's real default (10 s)
WINDOW_S = 62.0  # the busy robots' session: six header deadlines, three ping intervals
IDLE_S = 60.0  # the idle robot's pause between two calls
REALTIME_IDLE_S = 65.0  # the realtime session's silence: past uvicorn's 20 s ping timers
REALTIME_MODEL = "qwen3-omni-tiny"
NUM_BUSY_ROBOTS = 16
MAX_CALLS = 5_000  # a bound on each busy robot's loop besides the window
MIN_CALLS = 10  # calls per busy robot that even a crowded machine makes in the window
MAX_TRICKLED = 90  # header bytes the slow loris sends at most (one a second)
HORIZON, ACTION_DIM = 10, 8


@contextlib.contextmanager
def serving_like_mstar(
    config: ServerConfig,
    *,
    ping_s: float | None = None,
    spec: ModelSpec = SPEC,
    name: str = "pi05-tiny",
) -> Iterator[RunningServer]:
    """Serve pi05-tiny (or ``spec``) with the uvicorn settings of `mstar serve`, in a thread;
    stop it on exit.

    ``ping_s`` replaces both the WebSocket ping interval and the pong timeout.
    """
    app = make_app(spec, config, names=(name,))
    uv = uvicorn_config(app, config)
    if ping_s is not None:
        uv.ws_ping_interval = uv.ws_ping_timeout = ping_s
    with serve_in_thread(DrainingServer(uv, config, app), uv.bind_socket(), app) as server:
        yield server


@pytest.fixture(scope="module")
def pi05_server() -> Iterator[RunningServer]:
    with serving_like_mstar(ServerConfig(port=0)) as server:
        yield server


@pytest.fixture(scope="module")
def realtime_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    spec = qwen3_omni_tiny_spec(tmp_path_factory.mktemp("qwen3_omni") / "tiny", 30)
    with serving_like_mstar(ServerConfig(port=0), spec=spec, name=REALTIME_MODEL) as server:
        yield server


def idle_realtime_session(server: RunningServer) -> str:
    """Open a session with the `openai` realtime client, say nothing for `REALTIME_IDLE_S`, then
    ask for an answer; return its status."""

    async def session() -> str:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model=REALTIME_MODEL) as conn:
            await conn.recv()
            await asyncio.sleep(REALTIME_IDLE_S)
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hi"}],
            }
            await conn.conversation.item.create(item=item)
            await conn.response.create(
                response={"max_output_tokens": 2, "output_modalities": ["text"]}
            )
            async for event in conn:
                if event.type == "response.done":
                    return str(event.response.status)
        return "closed"

    return asyncio.run(session())


def address(server: RunningServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


@dataclass
class RobotLog:
    """What one robot client saw: its calls' action shapes and dtypes, and the chunks."""

    shapes: list[tuple[tuple[int, ...], str]]
    chunks: list[np.ndarray]

    def record(self, actions: np.ndarray) -> None:
        self.shapes.append((actions.shape, actions.dtype.str))
        self.chunks.append(actions)


def busy_robot(server: RunningServer, seed: int, stop_at: float) -> RobotLog:
    """Call non-stop until ``stop_at`` (at most `MAX_CALLS` calls), on one connection."""
    client = WebsocketClientPolicy(*address(server))
    obs = observation(seed)
    log = RobotLog([], [])
    for _ in range(MAX_CALLS):
        if time.monotonic() >= stop_at:
            break
        log.record(client.infer(obs)["actions"])
    log.record(client.infer(obs)["actions"])  # past the window: still connected
    return log


def idle_robot(server: RunningServer, seed: int) -> RobotLog:
    """Call once, idle `IDLE_S` seconds, call again on the same connection."""
    client = WebsocketClientPolicy(*address(server))
    obs = observation(seed)
    log = RobotLog([], [])
    log.record(client.infer(obs)["actions"])
    time.sleep(IDLE_S)  # the robot idles: this pause is the behaviour under test
    log.record(client.infer(obs)["actions"])
    return log


def slow_loris(server: RunningServer) -> tuple[bytes, float, bool]:
    """Trickle a header byte a second, never finishing; return (bytes got, seconds, closed)."""
    start = time.monotonic()
    received = b""
    with socket.create_connection(address(server), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: robot\r\n")
        for _ in range(MAX_TRICKLED):
            readable, _, _ = select.select([sock], [], [], 1.0)  # wait a second for the server
            try:
                if readable:
                    chunk = sock.recv(4096)
                    if not chunk:
                        return received, time.monotonic() - start, True
                    received += chunk
                else:
                    sock.sendall(b"X")
            except (ConnectionResetError, BrokenPipeError):
                return received, time.monotonic() - start, True
    return received, time.monotonic() - start, False


def silent_client(server: RunningServer) -> bytes:
    """Connect and send nothing; return what the server sent before closing."""
    with socket.create_connection(address(server), timeout=IDLE_S) as sock:
        return sock.recv(1024)


def dead_peer(server: RunningServer) -> tuple[list[Opcode], int | None]:
    """Open a WebSocket, then never answer a ping; return the frames' opcodes and the close code.

    A robot whose network went away sends nothing, pongs included: the server's pings must
    find it out.
    """
    protocol = ClientProtocol(parse_uri(server.url.replace("http://", "ws://") + "/"))
    opcodes: list[Opcode] = []
    with socket.create_connection(address(server), timeout=2 * WINDOW_S) as sock:
        protocol.send_request(protocol.connect())
        sock.sendall(b"".join(protocol.data_to_send()))
        for _ in range(1_000):
            data = sock.recv(65536)
            if not data:
                break
            protocol.receive_data(data)
            opcodes += [e.opcode for e in protocol.events_received() if isinstance(e, Frame)]
            # protocol.data_to_send() now holds the pongs: they are never sent.
    code = protocol.close_rcvd.code if protocol.close_rcvd is not None else None
    return opcodes, code


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_robot_sessions_outlast_the_header_deadline_and_slow_loris_does_not(
    pi05_server: RunningServer, realtime_server: RunningServer
) -> None:
    """... and, in the same minute, an `openai` realtime session idle past every timer on its
    path (uvicorn's 20 s ping interval and timeout, the client's keepalive) still answers."""
    completed_before = pi05_server.metric(
        "mstar_requests_finished_total", task="act", status="completed"
    )
    stop_at = time.monotonic() + WINDOW_S
    with concurrent.futures.ThreadPoolExecutor(NUM_BUSY_ROBOTS + 4) as pool:
        busy = [
            pool.submit(busy_robot, pi05_server, seed, stop_at) for seed in range(NUM_BUSY_ROBOTS)
        ]
        idle = pool.submit(idle_robot, pi05_server, 100)
        loris = pool.submit(slow_loris, pi05_server)
        silent = pool.submit(silent_client, pi05_server)
        dead = pool.submit(dead_peer, pi05_server)
        realtime = pool.submit(idle_realtime_session, realtime_server)
        logs = [f.result(timeout=4 * WINDOW_S) for f in busy]  # a closed connection raises here
        idle_log = idle.result(timeout=4 * WINDOW_S)
        loris_got, loris_s, loris_closed = loris.result(timeout=4 * WINDOW_S)
        silent_got = silent.result(timeout=4 * WINDOW_S)
        dead_opcodes, dead_code = dead.result(timeout=4 * WINDOW_S)
        assert realtime.result(timeout=4 * WINDOW_S) == "completed"

    calls = [len(log.shapes) for log in logs]
    assert min(calls) > MIN_CALLS, calls
    for log in [*logs, idle_log]:
        assert set(log.shapes) == {((HORIZON, ACTION_DIM), "<f4")}
        for chunk in log.chunks[1:]:  # seeded noise: the same chunk on every call of a robot
            np.testing.assert_allclose(chunk, log.chunks[0], rtol=1e-4, atol=1e-4)
    assert not np.allclose(logs[0].chunks[0], logs[1].chunks[0])
    # Every call was one request that completed (none failed, none was cut off).
    completed = pi05_server.metric("mstar_requests_finished_total", task="act", status="completed")
    assert completed - completed_before == sum(calls) + len(idle_log.shapes)

    # The HTTP clients that never finish their headers were closed at the deadline, unanswered.
    assert loris_closed and loris_got == b"" and loris_s >= HEADER_TIMEOUT_S - 0.05
    assert silent_got == b""
    # The dead peer got the metadata and a ping, then was dropped with 1011 (ping timeout).
    assert dead_opcodes[0] == Opcode.BINARY and Opcode.PING in dead_opcodes, dead_opcodes
    assert dead_opcodes[-1] == Opcode.CLOSE and dead_code == 1011, (dead_opcodes, dead_code)

    held = pi05_server.wait_idle()
    assert all(v == 0 for counts in held.values() for v in counts.values()), held


@pytest.mark.slow
def test_a_call_longer_than_the_ping_timeout_keeps_its_connection() -> None:
    ping_s = 0.3
    config = ServerConfig(port=0, admission=AdmissionLimits(max_running=1, max_waiting=4))
    with serving_like_mstar(config, ping_s=ping_s) as server:
        client = WebsocketClientPolicy(*address(server))
        server.call(server.state.admission.acquire())  # the one running slot: the call waits
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(client.infer, observation(2))
            deadline = time.monotonic() + 60
            while server.state.admission.num_waiting == 0:  # bounded: the call reached the queue
                assert time.monotonic() < deadline and not call.done()
                time.sleep(0.01)
            time.sleep(10 * ping_s)  # a call that takes ten pings: the behaviour under test
            server.loop.call_soon_threadsafe(server.state.admission.release)
            actions = call.result(timeout=60)["actions"]  # a closed connection raises here
        assert actions.shape == (HORIZON, ACTION_DIM)
        assert client.infer(observation(2))["actions"].shape == (HORIZON, ACTION_DIM)


def malformed_frames() -> list[tuple[str | bytes, str]]:
    """Return 200 frames a robot must not send, each with a fragment its error names."""
    g = np.random.default_rng(0)
    good = observation(0)
    texts = ["", "{}", '{"prompt": "pick"}', "observation", "\u00e9\u4e2d"]
    non_maps: list[Any] = [
        7,
        -1,
        1.5,
        None,
        True,
        "a string",
        b"bytes",
        [1, "x"],
        [],
        np.arange(6, dtype=np.float32),
    ]
    short_array = {b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "<f4", b"shape": [2, 3]}
    bad_observations: list[tuple[bytes, str]] = [
        (pack({}), "joint_position"),
        (
            pack({k: v for k, v in good.items() if k != "observation/wrist_image_left"}),
            "wrist_image_left",
        ),
        (pack({**good, "observation/joint_position": np.zeros(3)}), "joint_position"),
        (
            pack({**good, "observation/exterior_image_1_left": np.zeros((4, 4), np.uint8)}),
            "exterior_image_1_left",
        ),
        (
            pack({**good, "observation/exterior_image_1_left": np.full((8, 8, 3), 2.0)}),
            "exterior_image_1_left",
        ),
        (pack({**good, "prompt": 5}), "prompt"),
        (pack({**good, "prompt": "  "}), "prompt"),
        (
            msgpack.packb({"observation/joint_position": short_array}, use_bin_type=True),
            "needs 24 bytes",
        ),
    ]
    frames: list[tuple[str | bytes, str]] = []
    for i in range(50):
        frames.append(
            (f"{texts[i % len(texts)]} {i}" if i >= len(texts) else texts[i], "text frame")
        )
        frames.append((b"\xc1" + g.bytes(i), "msgpack"))  # 0xc1 is never valid msgpack
        frames.append((pack(non_maps[i % len(non_maps)]), "msgpack map"))
        frames.append(bad_observations[i % len(bad_observations)])
    return frames


def error_and_close_code(
    server: RunningServer, frame: str | bytes
) -> tuple[str | bytes, int | None]:
    """Send one frame on a fresh connection; return the reply and the server's close code."""
    url = server.url.replace("http://", "ws://")
    with websockets.sync.client.connect(
        url, compression=None, max_size=None, open_timeout=30
    ) as ws:
        metadata = ws.recv(timeout=30)
        assert isinstance(metadata, bytes) and unpack(metadata)["model"] == "pi05-tiny"  # first
        ws.send(frame)
        reply = ws.recv(timeout=30)
        try:
            ws.recv(timeout=30)
        except websockets.exceptions.ConnectionClosed as closed:
            return reply, closed.rcvd.code if closed.rcvd is not None else None
    return reply, None


def test_every_malformed_frame_gets_the_error_text_and_close_1011(
    pi05_server: RunningServer,
) -> None:
    frames = malformed_frames()
    assert len(frames) == 200
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda f: error_and_close_code(pi05_server, f[0]), frames))
    wrong = [
        (frame, reply, code)
        for (frame, fragment), (reply, code) in zip(frames, answers, strict=True)
        if not (isinstance(reply, str) and fragment in reply and code == 1011)
    ]
    assert not wrong, f"{len(wrong)} of 200 frames: {wrong[:3]}"
    host, port = address(pi05_server)
    assert WebsocketClientPolicy(host, port).infer(observation(1))["actions"].shape == (
        HORIZON,
        ACTION_DIM,
    )


@contextlib.contextmanager
def echo_server(header_timeout_s: float) -> Iterator[tuple[str, int]]:
    """Serve a WebSocket echo at /echo with `mstar serve`'s uvicorn settings and this header
    deadline."""
    app = FastAPI()

    @app.websocket("/echo")
    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                await websocket.send_text(await websocket.receive_text())

    server = uvicorn.Server(
        uvicorn_config(app, ServerConfig(port=0, header_timeout_s=header_timeout_s))
    )
    sock = server.config.bind_socket()
    thread = threading.Thread(target=lambda: server.run(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_a_websocket_upgrade_ends_the_header_deadline() -> None:
    with echo_server(header_timeout_s=0.5) as (host, port):
        silent = socket.create_connection((host, port), timeout=30)
        with websockets.sync.client.connect(f"ws://{host}:{port}/echo", open_timeout=30) as ws:
            ws.send("first")
            assert ws.recv(timeout=30) == "first"
            with pytest.raises(TimeoutError):  # six deadlines of silence: the session stays open
                ws.recv(timeout=3.0)
            ws.send("still here")
            assert ws.recv(timeout=30) == "still here"
        assert silent.recv(1) == b""  # an HTTP connection without headers is still closed
        silent.close()
