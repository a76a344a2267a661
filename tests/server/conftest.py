"""Fixtures of the server tests: real servers on 127.0.0.1 (uvicorn in a thread), test models."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import transformers
import uvicorn
from fastapi import FastAPI

from mstar.runtime.model import Model, ModelSpec
from mstar.server import AdmissionLimits, ServerConfig, make_app
from mstar.server.state import ServerState
from mstar.zoo.qwen3_omni.checkpoint import make_random_checkpoint
from mstar.zoo.qwen3_omni.config import get_qwen3_omni_config
from tests.server.models import make_byte_tokenizer, save_tiny_chat_llama

T = TypeVar("T")
START_TIMEOUT_S = 300.0  # a bound on a hang, not a speed: a busy machine starts slowly


@dataclass
class RunningServer:
    """A server the test started: its URL, app and event loop."""

    url: str
    app: FastAPI
    loop: asyncio.AbstractEventLoop

    @property
    def state(self) -> ServerState:
        state: ServerState = self.app.state.server
        return state

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's loop (the engine lives there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def held_state(self) -> dict[str, dict[str, int]]:
        return self.call(self.state.engine.held_state())

    def wait_idle(self, timeout: float = 20.0) -> dict[str, dict[str, int]]:
        """Poll (bounded) until the engine holds nothing for any request; return the last counts."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.held_state()
            admission = self.state.admission
            if (
                not any(v for counts in held.values() for v in counts.values())
                and admission.num_running == 0
            ):
                return held
            if time.monotonic() > deadline:
                return held
            time.sleep(0.01)

    def metric(self, name: str, **labels: str) -> float:
        value = self.state.metrics.registry.get_sample_value(
            name, {"model": self.state.name, **labels}
        )
        return 0.0 if value is None else value


@contextlib.contextmanager
def serve_in_thread(
    server: uvicorn.Server, sock: socket.socket, app: FastAPI
) -> Iterator[RunningServer]:
    """Run ``server`` on ``sock`` in a thread once its engine started (bounded); stop it on exit."""
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(
        target=lambda: loop.run_until_complete(server.serve(sockets=[sock])), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:  # bounded wait for the engine to start in the lifespan
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(
                f"the server did not start: {getattr(app.state, 'startup_error', None)!r}"
            )
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", app, loop)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        loop.close()
        sock.close()


@contextlib.contextmanager
def running_server(
    model: ModelSpec | Model, config: ServerConfig | None = None, **kwargs: Any
) -> Iterator[RunningServer]:
    """Serve ``model`` on 127.0.0.1 (a free port) in a thread; stop it on exit."""
    app = make_app(model, config or ServerConfig(port=0), **kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="on",
            loop="asyncio",
            timeout_graceful_shutdown=5,
        )
    )
    with serve_in_thread(server, sock, app) as running:
        yield running


@pytest.fixture(scope="module")
def toy_server() -> Iterator[RunningServer]:
    with running_server(ModelSpec("mstar.zoo.toy:ToyModel"), names=("toy-composite",)) as server:
        yield server


@pytest.fixture(scope="module")
def endless_server() -> Iterator[RunningServer]:
    """One running slot and one waiting slot, so tests can fill both."""
    config = ServerConfig(
        port=0, admission=AdmissionLimits(max_running=1, max_waiting=1, retry_after_s=2)
    )
    with running_server(
        ModelSpec("tests.server.models:EndlessTone"), config, names=("endless",)
    ) as server:
        yield server


@pytest.fixture(scope="session")
def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    return make_byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama"))


@pytest.fixture(scope="module")
def llama_server(tiny_llama_dir: Path) -> Iterator[RunningServer]:
    spec = ModelSpec(
        "mstar.zoo.llm:TextLLM", {"checkpoint": str(tiny_llama_dir), "name": "tiny-chat"}
    )
    with running_server(spec, names=("tiny-chat",)) as server:
        yield server


def qwen3_omni_tiny_spec(directory: Path, max_audio_frames: int) -> ModelSpec:
    """A spec of qwen3-omni-tiny on random weights freshly written under ``directory``."""
    checkpoint = make_random_checkpoint(get_qwen3_omni_config("qwen3-omni-tiny"), directory)
    return ModelSpec(
        "mstar.zoo.qwen3_omni.model:Qwen3OmniModel",
        {
            "config": "qwen3-omni-tiny",
            "checkpoint": str(checkpoint),
            "max_audio_frames": max_audio_frames,
        },
    )
