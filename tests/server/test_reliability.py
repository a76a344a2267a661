"""Every bad input a 4xx, a server that answers while one request is heavy or a worker is lost."""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mstar.cli.serve import EXIT_USAGE, add_serve_arguments, serve_command
from mstar.runtime import EngineConfig, ModelSpec, Placement
from mstar.server import ServerConfig
from tests.server.conftest import RunningServer, running_server
from tests.server.models import save_tiny_chat_llama

TWO_RANKS = (
    "node_groups:\n  - {node_names: [a, done], ranks: [0]}\n  - {node_names: [b], ranks: [1]}\n"
)
KEY = "sk-test-reliable"
# A KV block of the tiny chat Llama: 2 layers x (K, V) x 2 heads x 16 dims x 16 tokens x 4 bytes.
TINY_LLAMA_BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4


@pytest.fixture(scope="module")
def capped_server() -> Iterator[RunningServer]:
    config = ServerConfig(port=0, api_key=KEY, max_text_chars=100)
    with running_server(
        ModelSpec("mstar.zoo.toy:ToyModel"), config, names=("toy-composite",)
    ) as server:
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
    ok = httpx.post(
        f"{capped_server.url}/generate",
        json={"task": "speech", "text": "a" * 100},
        headers=auth(),
        timeout=30,
    )
    assert ok.status_code == 200 and ok.text.rstrip().endswith('"finished":true}')


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(capped_server: RunningServer, scheme: str) -> None:
    answer = httpx.get(f"{capped_server.url}/v1/models", headers=auth(scheme), timeout=10)
    assert answer.status_code == 200
    wrong = httpx.get(
        f"{capped_server.url}/v1/models", headers={"Authorization": f"{scheme} nope"}, timeout=10
    )
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


@pytest.mark.timeout(120)
def test_generate_past_a_kv_cache_smaller_than_the_models_length_is_a_400_naming_the_field(
    tmp_path: Path,
) -> None:
    # The checkpoint's length is 4,096 positions; the KV-cache budget holds 8 blocks of 16
    # tokens, which only the engine knows once it sized its cache.
    spec = ModelSpec(
        "mstar.zoo.llm:TextLLM",
        {"checkpoint": str(save_tiny_chat_llama(tmp_path)), "name": "tiny-chat"},
    )
    engine = EngineConfig(kv_cache_memory=8 * TINY_LLAMA_BLOCK_BYTES)
    with (
        running_server(spec, names=("tiny-chat",), engine_config=engine) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        limit = server.state.max_seq_len
        assert limit is not None and limit <= 128
        for stream in (True, False):
            for body, field in (
                ({"prompt_token_ids": [1, 2, 3], "max_tokens": 200}, "max_tokens"),
                ({"prompt_token_ids": list(range(5, 205)), "max_tokens": 1}, "prompt_token_ids"),
                # max_tokens left out: the default does not fit either
                ({"prompt": "x" * 300}, "prompt"),
            ):
                answer = http.post("/generate", json={**body, "stream": stream})
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
                assert (error["param"], error["code"], error["type"]) == (
                    field,
                    "context_length_exceeded",
                    "invalid_request_error",
                )
                assert f"holds {limit} tokens" in error["message"], error["message"]
            nested = http.post(
                "/generate",
                json={
                    "data": {"prompt_token_ids": [1, 2, 3], "max_tokens": limit},
                    "stream": stream,
                },
            )
            assert (
                nested.status_code == 400 and nested.json()["error"]["param"] == "data.max_tokens"
            )
            assert f"at most {limit - 3}" in nested.json()["error"]["message"]
        fits = http.post(
            "/generate",
            json={"prompt_token_ids": [1, 2, 3], "max_tokens": limit - 3, "ignore_eos": True},
        )
        assert fits.status_code == 200 and fits.text.rstrip().endswith('"finished":true}')
        assert server.wait_idle() == {
            k: dict.fromkeys(v, 0) for k, v in server.held_state().items()
        }


def test_serve_takes_a_request_stall_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["toy-composite"]).request_stall_timeout == 600.0
    assert (
        serve_command(parser.parse_args(["toy-composite", "--request-stall-timeout", "-1"]))
        == EXIT_USAGE
    )
    assert "--request-stall-timeout must be >= 0" in capsys.readouterr().err
