"""Sampling defaults from the checkpoint's `generation_config.json` (vLLM's convention).

A tiny random Llama checkpoint written here, served through the `llama` family (a local
directory), asked through the official `openai` client: what a request leaves unset takes the
file's value, what it sets wins.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from mstar.engines import SamplingParams
from mstar.errors import CheckpointError
from mstar.runtime.model import Request
from mstar.zoo import resolve_model
from mstar.zoo.llm import TextLLM
from tests.server.conftest import RunningServer, running_server
from tests.server.models import save_tiny_chat_llama

FILE = {"temperature": 0.0, "top_p": 0.5, "top_k": 7, "repetition_penalty": 1.3, "do_sample": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_tiny_chat_llama(tmp_path_factory.mktemp("generation-defaults"))
    (path / "generation_config.json").write_text(json.dumps(FILE))
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    with running_server(resolve_model(str(checkpoint)), names=("tiny-chat",)) as running:
        yield running


def _params(model: TextLLM, **data: object) -> SamplingParams:
    prepared = model.preprocess(Request("generate", {"prompt": "hello", **data}))
    params: SamplingParams = prepared.inputs["llm"]["params"]
    return params


def test_unset_fields_take_the_file_and_set_ones_the_request(checkpoint: Path) -> None:
    model = TextLLM(checkpoint)
    params = _params(model)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        0.0,
        0.5,
        7,
        1.3,
    )
    params = _params(model, temperature=0.8, top_k=3)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (
        0.8,
        3,
        0.5,
        1.3,
    )


def test_a_checkpoint_without_the_file_keeps_the_engine_defaults(tmp_path: Path) -> None:
    params = _params(TextLLM(save_tiny_chat_llama(tmp_path)))
    defaults = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty,
    )  # fmt: skip


def test_an_invalid_file_names_the_setting(tmp_path: Path) -> None:
    path = save_tiny_chat_llama(tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(CheckpointError, match="temperature"):
        TextLLM(path)


def test_the_server_samples_with_the_file_unless_the_request_says_otherwise(
    server: RunningServer,
) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]

    def answer(**sampling: object) -> str:
        reply = client.chat.completions.create(
            model="tiny-chat", messages=messages, max_tokens=16, **sampling
        )  # type: ignore[arg-type,call-overload]
        return str(reply.choices[0].message.content)

    # The file's temperature 0: two unseeded requests answer alike (greedy), not at the API's 1.0.
    first = answer()
    assert first and answer() == first
    # The request's own temperature wins: seeded draws differ from each other and from greedy.
    hot = [answer(temperature=1.5, top_p=1.0, extra_body={"top_k": 0}, seed=s) for s in (1, 2)]
    assert hot[0] != hot[1] and first not in hot
    assert answer(temperature=1.5, top_p=1.0, extra_body={"top_k": 0}, seed=1) == hot[0]
