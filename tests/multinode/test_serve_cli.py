"""`mstar serve --ray-address`: orpheus-tiny's LLM and codec on two Ray nodes, over HTTP.

The server runs as a user would start it: without Ray's loopback variable in its environment
(`mstar serve` sets it itself for a loopback address).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from mstar.runtime.ray_launcher import LOOPBACK_ENV
from tests.multinode.conftest import LOOPBACK, LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]

ACROSS = """
model: orpheus
node_groups:
  - {node_names: [LLM], ranks: [0], ray_resources: {node_a: 1}}
  - {node_names: [snac_decoder], ranks: [1], ray_resources: {node_b: 1}}
"""


def user_env() -> dict[str, str]:
    env = os.environ.copy()
    env.pop(LOOPBACK_ENV, None)
    env.pop("RAY_ADDRESS", None)
    return env


def serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "mstar.cli", "serve", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_an_address_where_no_cluster_runs_fails_with_an_error_naming_it() -> None:
    address = f"{LOOPBACK}:{free_port()}"
    done = subprocess.run(
        serve("toy-composite", "--ray-address", address, "--port", "0", "--log-level", "warning"),
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mstar serve: error: cannot reach the Ray cluster at {address}"), last
    assert "ray start --head" in last


@pytest.mark.timeout(120)
def test_sigterm_while_joining_the_cluster_stops_the_server() -> None:
    # A listener that never answers: the connection opens, Ray's handshake never completes.
    with socket.socket() as silent:
        silent.bind((LOOPBACK, 0))
        silent.listen(8)
        address = f"{LOOPBACK}:{silent.getsockname()[1]}"
        command = serve(
            "toy-composite", "--ray-address", address, "--port", "0", "--log-format", "json"
        )
        server = subprocess.Popen(
            command, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            assert server.stdout is not None
            seen = []
            for line in server.stdout:  # until the server says it is joining the cluster
                seen.append(line)
                if '"ray_connecting"' in line:
                    break
            else:
                pytest.fail("the server exited before joining: " + "".join(seen[-20:]))
            server.send_signal(signal.SIGTERM)
            code = server.wait(60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    rest = server.stdout.read()
    assert code == 0, rest[-2000:]
    assert "server_stopped_while_starting" in rest


def test_sigterm_while_the_workers_start_stops_the_server_and_frees_its_placement(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    from tests.multinode.test_ray_cluster import placement_groups

    placement = tmp_path / "across.yaml"
    placement.write_text(ACROSS)
    before = {g["placement_group_id"] for g in placement_groups("CREATED")}
    command = serve(
        "orpheus-tiny",
        "--config",
        str(placement),
        "--ray-address",
        ray_cluster.cluster.address,
        "--ray-num-cpus",
        "0.5",
        "--port",
        "0",
        "--log-format",
        "json",
    )
    server = subprocess.Popen(
        command, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert server.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []

    def drain() -> None:  # read to the end, so the server never blocks on a full pipe
        assert server.stdout is not None
        for line in server.stdout:
            lines.put(f"{time.monotonic():.2f} {line}")
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    code = None
    try:
        # until the ranks' resources are reserved
        while (line := lines.get(timeout=300)) is not None:
            seen.append(line)
            if '"ray_placed"' in line:
                break
        else:
            pytest.fail("the server exited before placing its ranks: " + "".join(seen[-20:]))
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        while (line := lines.get(timeout=30)) is not None:
            seen.append(line)
    assert code == 0, f"SIGTERM at {signalled:.2f}; " + "".join(seen[-30:])[-4000:]
    # its reservation is gone
    assert {g["placement_group_id"] for g in placement_groups("CREATED")} <= before


def test_serve_speech_across_nodes_on_loopback_and_stop_gracefully(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    placement = tmp_path / "across.yaml"
    placement.write_text(ACROSS)
    address = ray_cluster.cluster.address
    # a head on loopback only, as `ray start --node-ip-address 127.0.0.1`
    assert address.startswith(f"{LOOPBACK}:")
    port = 18000 + os.getpid() % 1000
    command = serve(
        "orpheus-tiny",
        "--config",
        str(placement),
        "--ray-address",
        address,
        "--ray-num-cpus",
        "0.5",
        "--port",
        str(port),
        "--log-level",
        "warning",
    )
    server = subprocess.Popen(
        command, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {
            "model": "orpheus-tiny",
            "input": "Hello there",
            "voice": "tara",
            "response_format": "wav",
        }
        speech = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=body, timeout=120)
        assert (
            speech.status_code == 200 and speech.content[:4] == b"RIFF" and len(speech.content) > 44
        )
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
    assert code == 0  # the server's own graceful stop, not Ray's exit on SIGTERM
