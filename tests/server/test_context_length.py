"""A `max_tokens` no model can honour (1e9, 2**63, 2**70) is the client's 400
``context_length_exceeded`` naming the field, on every route that takes it and every model,
before the request runs: through the `openai` client on the OpenAI routes and through
`mstar.client` on `/generate`. One just past what fits, which only the engine can tell, is the
same 400, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from mstar.client import Client, ImageOutput
from mstar.errors import APIRequestError
from mstar.runtime.model import ModelSpec
from mstar.server.state import MAX_COUNT
from mstar.zoo import resolve_model
from tests.server.conftest import RunningServer, running_server

pytestmark = pytest.mark.slow  # five servers

HUGE = (10**9, 2**63, 2**70)
MESSAGES = [{"role": "user", "content": "hi"}]


def _serve(name: str) -> Iterator[RunningServer]:
    with running_server(resolve_model(name), names=(name,)) as server:
        yield server


@pytest.fixture(scope="module")
def orpheus() -> Iterator[RunningServer]:
    yield from _serve("orpheus-tiny")


@pytest.fixture(scope="module")
def qwen3_omni() -> Iterator[RunningServer]:
    yield from _serve("qwen3-omni-tiny")


@pytest.fixture(scope="module")
def bagel() -> Iterator[RunningServer]:
    yield from _serve("bagel-tiny")


@pytest.fixture(scope="module")
def toy() -> Iterator[RunningServer]:
    yield from _serve("toy-composite")


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> Iterator[RunningServer]:
    spec = ModelSpec(
        "mstar.zoo.llm:TextLLM", {"checkpoint": str(tiny_llama_dir), "name": "tiny-chat"}
    )
    with running_server(spec, names=("tiny-chat",)) as server:
        yield server


def _openai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _refused(call: Any, param: str = "max_tokens") -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", param), (
        refused.value.body
    )
    return refused.value


def _refused_natively(server: RunningServer, task: str, **data: Any) -> APIRequestError:
    with Client(server.url) as client, pytest.raises(APIRequestError) as refused:
        client.run(task, data)
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded"), (
        refused.value
    )
    return refused.value


def _limit(server: RunningServer) -> int:
    limit = server.state.max_seq_len
    assert limit is not None
    return limit


@pytest.mark.parametrize("max_tokens", HUGE)
def test_speech_refuses_a_huge_max_tokens(
    orpheus: RunningServer, qwen3_omni: RunningServer, max_tokens: int
) -> None:
    for server, voice in ((orpheus, "tara"), (qwen3_omni, "chelsie")):
        speech = _openai(server).audio.speech
        error = _refused(
            lambda speech=speech, name=server.state.name, voice=voice: speech.create(
                model=name, voice=voice, input="hi", extra_body={"max_tokens": max_tokens}
            )
        )
        assert (
            str(max_tokens) in error.message and f"holds {_limit(server)} tokens" in error.message
        )
        refused = _refused_natively(server, "speech", text="hi", max_tokens=max_tokens)
        assert refused.param == "data.max_tokens"  # mstar.client sends its fields in `data`


@pytest.mark.parametrize("max_tokens", HUGE)
def test_text_routes_refuse_a_huge_max_tokens(
    llama: RunningServer, qwen3_omni: RunningServer, bagel: RunningServer, max_tokens: int
) -> None:
    for server in (llama, qwen3_omni, bagel):
        oa, name = _openai(server), server.state.name
        _refused(
            lambda oa=oa, name=name: oa.chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=max_tokens
            )
        )
        _refused(
            lambda oa=oa, name=name: oa.chat.completions.create(
                model=name, messages=MESSAGES, max_completion_tokens=max_tokens
            ),
            "max_completion_tokens",
        )
        _refused(
            lambda oa=oa, name=name: oa.completions.create(
                model=name, prompt="hi", max_tokens=max_tokens
            )
        )
        assert (
            _refused_natively(server, "generate", prompt="hi", max_tokens=max_tokens).param
            == "data.max_tokens"
        )


@pytest.mark.parametrize("max_tokens", HUGE)
def test_generate_refuses_a_huge_max_tokens_for_every_task(
    bagel: RunningServer, max_tokens: int
) -> None:
    for task in bagel.state.tasks:  # those that make images too: think mode decodes text first
        assert (
            _refused_natively(bagel, task, text="a red square", max_tokens=max_tokens).param
            == "data.max_tokens"
        )
    with Client(bagel.url) as client, pytest.raises(APIRequestError) as top_level:
        list(client.generate("generate", {"prompt": "hi"}, max_tokens=max_tokens))
    assert top_level.value.param == "data.max_tokens"


def test_the_prompt_alone_too_long_names_its_field(llama: RunningServer) -> None:
    limit = _limit(llama)
    refused = _refused_natively(llama, "generate", prompt_token_ids=[5] * limit, max_tokens=1)
    assert refused.param == "data.prompt_token_ids" and f"has {limit} tokens" in str(refused)
    _refused(
        lambda: _openai(llama).completions.create(
            model="tiny-chat", prompt="x" * limit, max_tokens=1
        ),
        "prompt",
    )


def test_just_past_the_length_is_the_same_400(orpheus: RunningServer) -> None:
    # The server cannot count Orpheus' prompt (its special tokens are the model's), so only the
    # engine finds that this one does not fit: still the client's 400, not a node failure.
    limit = _limit(orpheus)
    _refused(
        lambda: _openai(orpheus).audio.speech.create(
            model="orpheus-tiny", voice="tara", input="hi", extra_body={"max_tokens": limit - 1}
        )
    )
    assert (
        _refused_natively(orpheus, "speech", text="hi", max_tokens=limit - 1).param
        == "data.max_tokens"
    )
    with Client(orpheus.url) as client:  # and the server serves on
        assert client.run("speech", text="hi", max_tokens=14, seed=1)


def test_a_model_without_a_kv_cache_still_refuses_what_no_count_holds(toy: RunningServer) -> None:
    assert toy.state.max_seq_len is None
    refused = _refused_natively(toy, "speech", text="hi", max_tokens=MAX_COUNT + 1)
    assert refused.param == "data.max_tokens" and str(MAX_COUNT) in str(refused)
    _refused(
        lambda: _openai(toy).audio.speech.create(
            model="toy-composite", voice="x", input="hi", extra_body={"max_tokens": MAX_COUNT + 1}
        )
    )
    with Client(toy.url) as client:  # a count it can hold it is free to stop short of
        assert client.run("speech", text="hi", max_tokens=MAX_COUNT)


def test_the_images_route_takes_no_max_tokens(bagel: RunningServer) -> None:
    # OpenAI's images API has no max_tokens; an unknown field is ignored there, as OpenAI does.
    result = _openai(bagel).images.generate(
        model="bagel-tiny",
        prompt="a red square",
        extra_body={"max_tokens": 2**63, "num_inference_steps": 2},
    )
    assert result.data and result.data[0].b64_json
    with Client(bagel.url) as client:
        outputs = client.run("image", text="a red square", num_timesteps=2, max_tokens=8)
    assert any(isinstance(o, ImageOutput) for o in outputs)
