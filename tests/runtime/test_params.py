"""A request's options are typed once, where it enters: `GenerationParams` as the request is
made, a task's declared `TaskOptions` where the engine takes it; a bad value names its field,
over HTTP too, and ``preprocess`` reads typed values."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import httpx
import msgspec
import pytest
from msgspec import Meta

from mstar.engines import SamplingParams
from mstar.errors import InvalidRequestError
from mstar.runtime import (
    AsyncEngine,
    GenerationParams,
    ModelSpec,
    PreparedRequest,
    Request,
    TaskOptions,
)
from mstar.zoo.toy import ToyModel
from tests.server.conftest import running_server


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: must be an integer >= 1, got 0"),
        ({"max_tokens": 1.5}, "max_tokens: must be an integer, got 1.5"),
        ({"temperature": -0.5}, "temperature: must be a number >= 0.0, got -0.5"),
        ({"temperature": True}, "temperature: must be a number, got True"),
        ({"top_p": "NaN"}, "top_p: must be a number, got 'NaN'"),
        ({"top_p": 0.0}, "top_p: must be a number > 0.0, got 0.0"),
        ({"top_k": " "}, "top_k: must be an integer, got ' '"),
        ({"logprobs": 50}, "logprobs: must be an integer <= 20, got 50"),
        ({"presence_penalty": 3}, "presence_penalty: must be a number <= 2.0, got 3"),
        ({"ignore_eos": "yes"}, "ignore_eos: must be true or false, got 'yes'"),
        ({"seed": 2**70}, "seed: must fit in 64 bits"),
        ({"prefix_group_size": 2000}, "prefix_group_size: must be an integer <= 1024, got 2000"),
    ],
)
def test_a_bad_setting_is_refused_as_the_request_is_made_naming_it(
    data: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as refused:
        Request("speech", {"text": "hi", **data})
    assert refused.value.param == next(iter(data))


def test_settings_are_typed_and_unset_ones_take_the_models_defaults() -> None:
    request = Request(
        "generate", {"prompt": "hi", "temperature": 1, "seed": None, "images": [object()]}
    )
    params = request.params
    assert params == GenerationParams(temperature=1.0) and isinstance(params.temperature, float)
    merged = params.with_defaults({"temperature": 0.2, "top_p": 0.9, "unrelated": 3})
    assert (merged.temperature, merged.top_p) == (1.0, 0.9)  # the request's own values win
    sampling = merged.sampling(max_tokens=5, stop_token_ids=(2,), prompt_len=3)
    assert sampling == SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=5, stop_token_ids=(2,), prompt_len=3
    )
    ignoring = GenerationParams(ignore_eos=True).sampling(max_tokens=5, stop_token_ids=(2,))
    assert ignoring.stop_token_ids == ()


class Voiced(TaskOptions, frozen=True, kw_only=True):
    """A held-out model's declared options: a voice and a speed."""

    voice: Literal["calm", "bright"] = "calm"
    speed: Annotated[float, Meta(gt=0.0, le=4.0)] = 1.0


class VoicedToy(ToyModel):
    """The toy composite with options of its own on its speech task; records what preprocess got."""

    seen: ClassVar[list[Any]] = []

    def task_options(self, task: str) -> type[TaskOptions] | None:
        return Voiced if task == "speech" else None

    def preprocess(self, request: Request) -> PreparedRequest:
        VoicedToy.seen.append(request.options)
        return super().preprocess(request)


async def test_the_engine_parses_a_tasks_declared_options_once() -> None:
    VoicedToy.seen = []
    async with await AsyncEngine.start(VoicedToy()) as engine:
        await engine.run(Request("speech", {"text": "hello", "speed": 2, "seed": 1}))
        await engine.run(Request("image", {"text": "a cat", "speed": "ignored: not this task's"}))
        with pytest.raises(
            InvalidRequestError, match=r"voice: must be one of 'bright', 'calm', got 'loud'"
        ) as bad:
            await engine.run(Request("speech", {"text": "hello", "voice": "loud"}))
        assert bad.value.param == "voice"
        with pytest.raises(InvalidRequestError, match=r"speed: must be a number <= 4.0, got 9"):
            await engine.run(Request("speech", {"text": "hello", "speed": 9}))
    # the bad ones never reached it
    assert VoicedToy.seen == [Voiced(voice="calm", speed=2.0), None]


def test_options_as_parses_once_where_no_engine_did() -> None:
    request = Request("speech", {"text": "hi", "voice": "bright"})
    first = request.options_as(Voiced)
    assert first == Voiced(voice="bright") and request.options_as(Voiced) is first
    assert msgspec.structs.asdict(first) == {"voice": "bright", "speed": 1.0}


def test_http_names_the_field_of_a_bad_setting_or_option() -> None:
    spec = ModelSpec("tests.runtime.test_params:VoicedToy", {})
    with running_server(spec, names=("toy",)) as server:
        for data, param in (
            ({"speed": 0}, "speed"),
            ({"voice": 3}, "voice"),
            ({"seed": "x"}, "seed"),
        ):
            reply = httpx.post(
                f"{server.url}/generate",
                json={"task": "speech", "data": {"text": "hi", **data}},
                timeout=60,
            )
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] in (param, f"data.{param}") and param in error["message"], error
        ok = httpx.post(
            f"{server.url}/generate",
            json={"task": "speech", "data": {"text": "hi", "speed": 3}},
            timeout=60,
        )
        assert ok.status_code == 200 and b'"finished": true' in ok.content.replace(
            b'":true', b'": true'
        )


async def test_engines_publish_their_limits_once_at_start(tmp_path: Any) -> None:
    """The server reads the model's length from `AsyncEngine.limits`, typed, not from counters."""
    from mstar.engines.limits import NodeLimits
    from mstar.zoo.llm import TextLLM
    from tests.server.models import save_tiny_chat_llama

    model = TextLLM(
        save_tiny_chat_llama(tmp_path), engine_config={"num_blocks": 8, "block_size": 16}
    )
    async with await AsyncEngine.start(model) as engine:
        assert engine.limits.nodes == {
            0: {"llm": NodeLimits(max_seq_len=128, num_blocks=8, block_size=16)}
        }
        assert engine.limits.max_seq_len == 128
    async with await AsyncEngine.start(ToyModel()) as toy:  # a model whose nodes hold no KV cache
        assert toy.limits.nodes == {0: {}} and toy.limits.max_seq_len is None
