"""The real SmolLM2-135M-Instruct behind the chat API answers a simple question (slow: the
first run dequantises the packaged GGUF weights and caches them)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from mstar.zoo import resolve_model
from mstar.zoo.llm import TextLLM
from mstar.zoo.smollm2 import SMOLLM2_SAMPLING
from tests.server.conftest import RunningServer, running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[RunningServer]:
    try:
        from mstar.zoo.smollm2 import smollm2_checkpoint_dir

        smollm2_checkpoint_dir()
    except Exception as exc:  # the weights package is not installed here
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")
    with running_server(resolve_model(MODEL), names=(MODEL,)) as server:
        yield server


def test_smollm2_chat_streams_a_sensible_answer(smollm2_server: RunningServer) -> None:
    oa = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
        ],
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in answer, answer
    # it ended its turn
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens < 32 and usage.prompt_tokens > 10


def test_smollm2_without_a_temperature_samples_as_its_checkpoint_says(
    smollm2_server: RunningServer,
) -> None:
    """No temperature in the request: SmolLM2's own (0.2, top_p 0.9), not the API's 1.0, which
    rambles."""
    model = smollm2_server.state.model
    assert isinstance(model, TextLLM) and model.generation_defaults == SMOLLM2_SAMPLING
    oa = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    question = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    ]
    for seed in (1, 2, 3):
        reply = oa.chat.completions.create(model=MODEL, messages=question, max_tokens=32, seed=seed)  # type: ignore[arg-type]
        assert "Paris" in str(reply.choices[0].message.content), reply.choices[0].message.content
