"""Every bad input a 4xx, a server that answers while one request is heavy or a worker is lost."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mstar.runtime import EngineConfig, ModelSpec, Placement
from mstar.server import ServerConfig
from tests.server.conftest import RunningServer, running_server

TWO_RANKS = "node_groups:\n  - {node_names: [a, done], ranks: [0]}\n  - {node_names: [b], ranks: [1]}\n"
KEY = "sk-test-reliable"


@pytest.fixture(scope="module")
def capped_server() -> Iterator[RunningServer]:
    config = ServerConfig(port=0, api_key=KEY, max_text_chars=100)
    with running_server(ModelSpec("mstar.zoo.toy:ToyModel"), config, names=("toy-composite",)) as server:
        yield server


def auth(scheme: str = "Bearer") -> dict[str, str]:
    return {"Authorization": f"{scheme} {KEY}"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"task": "speech", "text": "a" * 101}, "text"),
        ({"task": "speech", "data": {"text": "a" * 101}}, "data.text"),
        ({"task": "speech", "prompt": "a" * 5_000}, "prompt"),
    ],
)
def test_generate_refuses_a_text_over_the_cap_naming_the_field(
    capped_server: RunningServer, body: dict[str, object], field: str
) -> None:
    answer = httpx.post(f"{capped_server.url}/generate", json=body, headers=auth(), timeout=10)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == field and "at most 100" in error["message"]
    ok = httpx.post(f"{capped_server.url}/generate", json={"task": "speech", "text": "a" * 100}, headers=auth(), timeout=30)
    assert ok.status_code == 200 and ok.text.rstrip().endswith('"finished":true}')


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(capped_server: RunningServer, scheme: str) -> None:
    answer = httpx.get(f"{capped_server.url}/v1/models", headers=auth(scheme), timeout=10)
    assert answer.status_code == 200
    wrong = httpx.get(f"{capped_server.url}/v1/models", headers={"Authorization": f"{scheme} nope"}, timeout=10)
    assert wrong.status_code == 401


def rank_up(server: RunningServer, text: str) -> dict[str, float]:
    return {
        s.labels["rank"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "mstar_rank_up"
        for s in family.samples
    }


@pytest.mark.timeout(180)
def test_health_and_metrics_report_a_lost_worker_at_once() -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 20})
    engine = EngineConfig(worker_processes=True, offload_steps=False)
    placement = Placement.from_yaml(TWO_RANKS)
    with (
        running_server(spec, placement=placement, engine_config=engine, names=("noop",)) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        assert http.get("/health").json()["status"] == "ok"
        assert rank_up(server, http.get("/metrics").text) == {"0": 1.0, "1": 1.0}
        victim = server.state.engine.processes[1].pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (health := http.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "the lost worker was never reported"
            time.sleep(0.01)
        assert health.status_code == 503
        assert health.json() == {"status": "degraded", "model": "noop", "ranks_down": [1]}
        start = time.monotonic()
        scrape = http.get("/metrics", timeout=10)
        assert scrape.status_code == 200 and time.monotonic() - start < 5
        assert rank_up(server, scrape.text)["1"] == 0.0
        deadline = time.monotonic() + 120
        while http.get("/health").status_code != 200:  # the worker is restarted
            assert time.monotonic() < deadline, "the worker did not come back"
            time.sleep(0.05)
        assert rank_up(server, http.get("/metrics").text) == {"0": 1.0, "1": 1.0}
        answer = http.post("/generate", json={})
        assert answer.status_code == 200 and answer.text.rstrip().endswith('"finished":true}')
