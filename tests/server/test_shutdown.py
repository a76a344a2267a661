"""Shutdown drains (503 for new requests, a grace for running ones, then an error event) and
connections that idle or trickle their headers are closed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from mstar.cli.serve import resolve_api_key
from mstar.errors import ServerConfigError
from mstar.runtime.model import ModelSpec
from mstar.server import ServerConfig, make_app
from mstar.server.http_protocol import HeaderTimeoutH11Protocol, timed_h11
from mstar.server.runner import DrainingServer, uvicorn_config
from mstar.transport.janitor import SHM_DIR, runtime_dir


def serve_in_thread(server: uvicorn.Server) -> tuple[str, threading.Thread]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=lambda: server.run(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", thread


@pytest.mark.timeout(120)
def test_sigterm_drains_then_ends_running_streams_with_an_error_event() -> None:
    config = ServerConfig(port=0, graceful_shutdown_s=1.0)
    app = make_app(ModelSpec("tests.server.models:EndlessTone"), config, names=("endless",))
    server = DrainingServer(uvicorn_config(app, config), config, app)
    url, thread = serve_in_thread(server)
    lines: list[dict[str, object]] = []
    with (
        httpx.Client(base_url=url, timeout=30) as http,
        http.stream("POST", "/generate", json={"task": "speech", "text": "x"}) as stream,
    ):
        assert stream.status_code == 200
        received = stream.iter_lines()  # one iterator: closing one would close the connection
        lines += [json.loads(next(received)) for _ in range(3)]
        start = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        with httpx.Client(base_url=url, timeout=10) as other:
            deadline = time.monotonic() + 5
            while (health := other.get("/health")).status_code == 200:
                assert time.monotonic() < deadline
            assert health.status_code == 503 and health.json()["status"] == "stopping"
            refused = other.post("/generate", json={"task": "speech", "text": "x"})
            assert (
                refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            )
        for raw in received:  # the running stream goes on through the grace...
            lines.append(json.loads(raw))
    last = lines[-1]
    # ...and ends with an error
    assert "error" in last and "shutting down" in str(last["error"]), last
    assert time.monotonic() - start >= 0.9  # the grace was given
    thread.join(30)
    assert not thread.is_alive(), "the server did not stop"
    assert time.monotonic() - start < 20


def test_shutdown_without_running_requests_is_quick() -> None:
    config = ServerConfig(port=0, graceful_shutdown_s=30.0)
    app = make_app(ModelSpec("mstar.zoo.toy:ToyModel"), config, names=("toy-composite",))
    server = DrainingServer(uvicorn_config(app, config), config, app)
    url, thread = serve_in_thread(server)
    assert (
        httpx.post(f"{url}/generate", json={"task": "speech", "text": "hi"}, timeout=30).status_code
        == 200
    )
    start = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - start < 10  # not the 30 s of grace


def test_idle_and_slow_header_connections_are_closed() -> None:
    app = FastAPI()

    @app.get("/")
    async def root() -> dict[str, str]:
        return {"ok": "yes"}

    server = uvicorn.Server(
        uvicorn.Config(
            app, http=timed_h11(0.5), timeout_keep_alive=1, log_config=None, lifespan="off"
        )
    )
    url, thread = serve_in_thread(server)
    host, port = url.removeprefix("http://").split(":")
    try:
        silent = socket.create_connection((host, int(port)), timeout=10)
        trickle = socket.create_connection((host, int(port)), timeout=10)
        trickle.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        for _ in range(40):  # a header byte every 0.1 s: never a whole request
            try:
                trickle.sendall(b"X")
            except OSError:
                break
            time.sleep(0.1)
        assert silent.recv(1) == b""  # closed by the server
        assert time.monotonic() - start < 4.5
        assert httpx.get(url, timeout=5).json() == {"ok": "yes"}  # whole requests are served
        silent.close()
        trickle.close()
    finally:
        server.should_exit = True
        thread.join(10)


def test_uvicorn_gets_the_connection_timeouts() -> None:
    config = ServerConfig(port=0, keep_alive_timeout_s=3, header_timeout_s=7)
    uv = uvicorn_config(FastAPI(), config)
    assert uv.timeout_keep_alive == 3
    assert isinstance(uv.http, type) and issubclass(uv.http, HeaderTimeoutH11Protocol)
    assert uv.http.header_timeout_s == 7
    with pytest.raises(ServerConfigError):
        ServerConfig(header_timeout_s=0)


def test_the_api_key_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    monkeypatch.setenv("MSTAR_API_KEY", "sk-from-env")
    assert resolve_api_key(None, str(key_file)) == "sk-from-file"
    assert resolve_api_key(None, None) == "sk-from-env"
    assert resolve_api_key("sk-given", None) == "sk-given"
    with pytest.raises(ServerConfigError, match="not both"):
        resolve_api_key("sk-given", str(key_file))
    with pytest.raises(ServerConfigError, match="cannot read"):
        resolve_api_key(None, str(tmp_path / "missing"))


def owned(pid: int) -> set[Path]:
    prefix = f"mstar-{pid}-"
    return {
        p
        for d in (SHM_DIR, runtime_dir())
        if d.exists()
        for p in d.iterdir()
        if p.name.startswith(prefix)
    }


@pytest.mark.timeout(120)
def test_a_killed_engine_process_leaves_nothing_once_its_workers_exit(tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(
        textwrap.dedent("""
        import asyncio, os, sys
        from mstar import AsyncEngine, EngineConfig, ModelSpec, Placement

        TWO = "node_groups:\\n  - {node_names: [a, done], ranks: [0]}\\n  - {node_names: [b], ranks: [1]}\\n"

        async def main():
            spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 3})
            engine = await AsyncEngine.start(spec, Placement.from_yaml(TWO), EngineConfig(worker_processes=True))
            print("workers", *(p.pid for p in engine.processes.values()), flush=True)
            await asyncio.sleep(600)

        if __name__ == "__main__":
            asyncio.run(main())
    """)  # noqa: E501 (a table or diagram)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert proc.stdout is not None
        line = ""
        while not line.startswith("workers"):  # past the engine's log lines
            line = proc.stdout.readline()
            assert line, "the engine did not start"
        workers = [int(p) for p in line.split()[1:]]
        assert len(workers) == 2 and owned(proc.pid), "the engine serves an ipc socket and an arena"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20  # the workers exit at once, and sweep what was left
        while any(owned(pid) for pid in [proc.pid, *workers]) or any(
            _alive(pid) for pid in workers
        ):
            assert time.monotonic() < deadline, {pid: owned(pid) for pid in [proc.pid, *workers]}
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
