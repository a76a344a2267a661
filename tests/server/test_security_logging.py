"""API keys, body limits, and structured logs with one request id per request and no secrets."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import httpx
import openai
import pytest
import structlog

from mstar.runtime.model import ModelSpec
from mstar.server import ServerConfig, configure_logging
from tests.server.conftest import RunningServer, running_server

KEY = "sk-test-5f3a9c0e1d"


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """Route every log line to a buffer (as JSON), then restore logging."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging("info", json=True, stream=stream, secrets=[KEY])
    try:
        yield stream
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        structlog.reset_defaults()


@pytest.fixture
def secured_server(log_stream: io.StringIO) -> Iterator[RunningServer]:
    config = ServerConfig(port=0, api_key=KEY, max_body_bytes=2048)
    with running_server(
        ModelSpec("mstar.zoo.toy:ToyModel"), config, names=("toy-composite",)
    ) as server:
        yield server


def test_api_key_is_required_except_for_health_and_metrics(secured_server: RunningServer) -> None:
    with httpx.Client(base_url=secured_server.url) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        missing = http.post("/v1/audio/speech", json={"input": "hi"})
        wrong = http.post(
            "/generate", json={"text": "hi"}, headers={"Authorization": "Bearer nope"}
        )
        listing = http.get("/v1/models")
    for answer in (missing, wrong, listing):
        assert (
            answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"
        )
    assert missing.headers["www-authenticate"] == "Bearer"
    keyed = openai.OpenAI(base_url=f"{secured_server.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in keyed.models.list().data] == ["toy-composite"]
    assert (
        keyed.audio.speech.create(model="toy-composite", voice="alloy", input="hi").content[:4]
        == b"RIFF"
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{secured_server.url}/v1", api_key="sk-wrong", max_retries=0
        ).models.list()


def test_bodies_over_the_limit_get_413(secured_server: RunningServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    big = json.dumps({"input": "x" * 4000}).encode()

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 500):
            yield big[i : i + 500]

    with httpx.Client(base_url=secured_server.url, headers=auth) as http:
        declared = http.post(
            "/v1/audio/speech", content=big, headers={"content-type": "application/json"}
        )
        streamed = http.post(
            "/v1/audio/speech", content=chunked(), headers={"content-type": "application/json"}
        )
        small = http.post("/v1/audio/speech", json={"input": "x" * 100})
    assert declared.status_code == 413 and "2048 bytes" in declared.json()["error"]["message"]
    assert streamed.status_code == 413
    assert small.status_code == 200


def test_logs_are_json_with_one_request_id_per_request_and_no_secrets(
    secured_server: RunningServer, log_stream: io.StringIO
) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=secured_server.url, headers=auth) as http:
        ok = http.post("/v1/audio/speech", json={"input": "log me"})
        # the model refuses it
        invalid = http.post("/generate", json={"task": "speech", "text": ""})
        http.get("/health", headers={"Authorization": f"Bearer {KEY}-typo"})
    assert ok.status_code == 200 and invalid.status_code == 400
    text = log_stream.getvalue()
    assert KEY not in text
    lines = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    assert all({"event", "level", "timestamp"} <= line.keys() for line in lines)
    for answer, events in (
        (ok, {"request_started", "request_finished"}),
        (invalid, {"request_started", "request_ended", "request_finished"}),
    ):
        request_id = answer.headers["x-request-id"]
        mine = [line for line in lines if line.get("request_id") == request_id]
        assert events <= {line["event"] for line in mine}
        assert [line["status"] for line in mine if line["event"] == "request_finished"] == [
            answer.status_code
        ]
    request_lines = [line for line in lines if line["event"].startswith("request_")]
    assert all("request_id" in line for line in request_lines)


def test_console_lines_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = Terminal()
    try:
        configure_logging("info", stream=stream, secrets=["hunter2"])
        with structlog.contextvars.bound_contextvars(request_id="abc123"):
            structlog.get_logger("t").info("hello", password="hunter2", note="pw hunter2")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        structlog.reset_defaults()
    out = stream.getvalue()
    assert "hello" in out and "abc123" in out and "hunter2" not in out
    assert not out.lstrip().startswith("{")
