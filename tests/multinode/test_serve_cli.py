"""`mstar serve --ray-address`: orpheus-tiny's LLM and codec on two Ray nodes, over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.multinode.conftest import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ACROSS = """
model: orpheus
node_groups:
  - {node_names: [LLM], ranks: [0], ray_resources: {node_a: 1}}
  - {node_names: [snac_decoder], ranks: [1], ray_resources: {node_b: 1}}
"""


def test_serve_speech_across_nodes_and_stop_gracefully(ray_cluster: LocalCluster, tmp_path: Path) -> None:
    placement = tmp_path / "across.yaml"
    placement.write_text(ACROSS)
    port = 18000 + os.getpid() % 1000
    command = [
        sys.executable, "-m", "mstar.cli", "serve", "orpheus-tiny", "--config", str(placement),
        "--ray-address", ray_cluster.cluster.address, "--ray-num-cpus", "0.5", "--port", str(port),
        "--log-level", "warning",
    ]
    server = subprocess.Popen(command, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        body = {"model": "orpheus-tiny", "input": "Hello there", "voice": "tara", "response_format": "wav"}
        speech = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=body, timeout=120)
        assert speech.status_code == 200 and speech.content[:4] == b"RIFF" and len(speech.content) > 44
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
    assert code == 0  # the server's own graceful stop, not Ray's exit on SIGTERM
