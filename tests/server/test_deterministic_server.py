"""`mstar serve --deterministic` through the OpenAI API: a seeded, sampled chat completion
gives the same text and log-probabilities alone and among concurrent requests; `/health`
says which mode serves."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

from mstar.runtime import EngineConfig, ModelSpec

from .conftest import running_server


def _ask(client: openai.OpenAI, text: str, seed: int) -> tuple[str, list[Any]]:
    reply = client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": text}],
        seed=seed,
        temperature=1.0,
        top_p=0.9,
        max_tokens=24,
        logprobs=True,
        top_logprobs=2,
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    return choice.message.content or "", [
        (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
        for t in choice.logprobs.content
    ]


def test_a_seeded_completion_repeats_byte_for_byte_under_load(tiny_llama_dir: Path) -> None:
    spec = ModelSpec(
        "mstar.zoo.llm:TextLLM", {"checkpoint": str(tiny_llama_dir), "name": "tiny-chat"}
    )
    with running_server(
        spec, names=("tiny-chat",), engine_config=EngineConfig(deterministic=True)
    ) as server:
        health = httpx.get(f"{server.url}/health").json()
        assert health == {"status": "ok", "model": "tiny-chat", "deterministic": True}
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        alone = _ask(client, "tell me about the sea", 11)
        assert len(alone[1]) == 24
        with ThreadPoolExecutor(9) as pool:
            load = [pool.submit(_ask, client, f"request {i} " * (1 + i % 5), i) for i in range(8)]
            under_load = pool.submit(_ask, client, "tell me about the sea", 11)
            for f in load:
                f.result()
            assert under_load.result() == alone


def test_the_default_server_says_it_is_not_deterministic(tiny_llama_dir: Path) -> None:
    spec = ModelSpec(
        "mstar.zoo.llm:TextLLM", {"checkpoint": str(tiny_llama_dir), "name": "tiny-chat"}
    )
    with running_server(spec, names=("tiny-chat",)) as server:
        assert httpx.get(f"{server.url}/health").json()["deterministic"] is False
