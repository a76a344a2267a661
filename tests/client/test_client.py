"""`mstar.client` against real servers: typed outputs of every modality, streamed; the
server's errors raised as their `mstar.errors` types; leaving a stream aborts its request."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import transformers
from PIL import Image

from mstar.client import (
    ActionOutput,
    AsyncClient,
    AudioOutput,
    Client,
    ImageOutput,
    LatentOutput,
    TextOutput,
    error_from_body,
    image_url,
)
from mstar.errors import APIRequestError, MStarError, OverloadedError, WalkExecutionError
from mstar.runtime.model import ModelSpec
from mstar.server import AdmissionLimits, ServerConfig
from tests.server.conftest import RunningServer, running_server


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> Iterator[RunningServer]:
    spec = ModelSpec(
        "mstar.zoo.llm:TextLLM", {"checkpoint": str(tiny_llama_dir), "name": "tiny-chat"}
    )
    with running_server(spec, names=("tiny-chat",)) as server:
        yield server


def _ndjson(server: RunningServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        answer = http.post("/generate", json=body)
    return [json.loads(line) for line in answer.text.splitlines() if line]


def test_text_streams_as_the_server_detokenizes_it(
    llama: RunningServer, byte_tokenizer: transformers.PreTrainedTokenizerFast
) -> None:
    fields = {
        "prompt": "Once upon",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
    with Client(llama.url) as client:
        stream = client.generate("generate", **fields)
        outputs = list(stream)
    assert all(isinstance(o, TextOutput) for o in outputs)
    texts = [o for o in outputs if isinstance(o, TextOutput)]
    ids = [i for o in texts for i in o.token_ids]
    assert len(ids) == 8 and stream.usage == {"completion_tokens": 8}
    assert "".join(o.text for o in texts) == byte_tokenizer.decode(ids, skip_special_tokens=True)
    raw = [line for line in _ndjson(llama, fields) if line.get("token_ids")]
    assert [o.logprobs for o in texts if o.token_ids] == [[line["logprobs"]] for line in raw]
    assert texts[0].node == "llm" and texts[0].walk == "prefill" and texts[1].walk == "decode"


async def test_the_async_client_gives_the_same_outputs(llama: RunningServer) -> None:
    fields = {"prompt_token_ids": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Client(llama.url) as client:
        expected = client.run(**fields)  # no task: the model's only one
    async with AsyncClient(llama.url) as client:
        stream = client.generate(**fields)
        got = [out async for out in stream]
        assert stream.usage == {"completion_tokens": 6}
        assert await client.run("generate", fields) == expected
        assert (await client.health())["status"] == "ok"
    assert got == expected


def test_audio_images_and_latents_arrive_as_arrays(toy_server: RunningServer) -> None:
    with Client(toy_server.url) as client:
        speech = client.run("speech", text="hello")
        image = client.run("image", text="a lighthouse", seed=3)
        no_samples = client.run("speech", text="hello", audio_data=False)
    audio = [o for o in speech if isinstance(o, AudioOutput)]
    assert audio and all(
        o.sample_rate == 16_000 and o.samples is not None and o.samples.dtype == np.float32
        for o in audio
    )
    raw_audio = [
        line
        for line in _ndjson(toy_server, {"task": "speech", "text": "hello"})
        if line.get("modality") == "audio"
    ]
    pcm = np.frombuffer(base64.b64decode(raw_audio[0]["data"]), dtype="<i2")
    np.testing.assert_allclose(audio[0].samples, pcm / 32767.0, atol=1e-6)  # type: ignore[arg-type]
    assert sum(o.num_samples for o in audio) == sum(len(o.samples) for o in audio)  # type: ignore[arg-type]
    assert next(o.samples for o in no_samples if isinstance(o, AudioOutput)) is None
    (picture,) = [o for o in image if isinstance(o, ImageOutput)]
    raw_image = [
        line
        for line in _ndjson(toy_server, {"task": "image", "text": "a lighthouse", "seed": 3})
        if line.get("modality") == "image"
    ]
    with Image.open(io.BytesIO(base64.b64decode(raw_image[0]["data"]))) as png:
        assert png.mode == "L"  # the toy's images are grey: the client expands them to RGB
        np.testing.assert_array_equal(picture.image, np.array(png.convert("RGB")))
    assert picture.image.dtype == np.uint8 and picture.image.shape == (8, 8, 3)
    latents = [o for o in image if isinstance(o, LatentOutput)]
    assert latents and latents[0].array.dtype == np.float32 and latents[0].array.size > 0


def test_images_go_in_as_data_urls(toy_server: RunningServer) -> None:
    picture = np.random.default_rng(2).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    with Client(toy_server.url) as client:
        as_url = client.run("image_edit", text="bluer", images=[image_url(picture)], seed=1)
        as_pil = client.run("image_edit", text="bluer", images=[Image.fromarray(picture)], seed=1)
        as_lists = client.run("image_edit", text="bluer", images=[picture], seed=1)  # nested lists
        with pytest.raises(APIRequestError) as bad:
            client.run("image_edit", text="x", images=["data:image/png;base64,AAAA"], seed=1)
        assert client.run("image", text="data:image/png;base64,AAAA", seed=1)  # text stays text
    edited = [
        next(o.image for o in run if isinstance(o, ImageOutput))
        for run in (as_url, as_pil, as_lists)
    ]
    np.testing.assert_array_equal(edited[0], edited[2])
    np.testing.assert_array_equal(edited[1], edited[2])
    assert (bad.value.status, bad.value.param) == (400, "data.images.0")
    with pytest.raises(ValueError, match="uint8"):
        image_url(picture.astype(np.float32))


def test_action_chunks_arrive_as_arrays() -> None:
    g = np.random.default_rng(7)
    observation = {
        "observation/exterior_image_1_left": g.integers(0, 256, (32, 48, 3), dtype=np.uint8),
        "observation/wrist_image_left": g.integers(0, 256, (32, 32, 3), dtype=np.uint8),
        "observation/joint_position": g.uniform(-1.0, 1.0, 7),
        "observation/gripper_position": g.uniform(0.0, 1.0, 1),
        "prompt": "pick up the cup",
        "seed": 7,
    }
    with (
        running_server(
            ModelSpec("mstar.zoo.pi05.model:Pi05Model", {"config": "pi05-tiny"}),
            names=("pi05-tiny",),
        ) as server,
        Client(server.url) as client,
    ):
        outputs = client.run("act", observation)  # numpy arrays go as nested lists
        with pytest.raises(APIRequestError, match="DROID observation has no") as bad:
            client.run("act", {"prompt": "x"})
    (actions,) = [o for o in outputs if isinstance(o, ActionOutput)]
    assert actions.array.shape == (10, 8) and actions.array.dtype == np.float32
    assert bad.value.status == 400


def test_server_errors_are_raised_as_their_types(llama: RunningServer) -> None:
    with Client(llama.url) as client:
        with pytest.raises(APIRequestError) as bad_seed:
            client.run("generate", prompt="hi", seed=[1])
        assert (bad_seed.value.status, bad_seed.value.param) == (400, "data.seed")
        with pytest.raises(APIRequestError) as no_task:
            client.run("speech", text="hi")
        assert no_task.value.param == "task" and no_task.value.code == "unsupported_task"
        with pytest.raises(APIRequestError) as wrong_model:
            client.run("generate", prompt="hi", max_tokens=1, model="gpt-4o")
        assert (wrong_model.value.status, wrong_model.value.code) == (404, "model_not_found")
        with pytest.raises(APIRequestError, match="max_tokens") as too_long:
            client.run("generate", prompt="hi", max_tokens=10**6)
        assert (too_long.value.status, too_long.value.param, too_long.value.code) == (
            400,
            "data.max_tokens",
            "context_length_exceeded",
        )
        with pytest.raises(APIRequestError) as long_prompt:
            client.run("generate", prompt_token_ids=[5] * 5000, max_tokens=1)
        assert (long_prompt.value.param, long_prompt.value.code) == (
            "data.prompt_token_ids",
            "context_length_exceeded",
        )
    with Client(llama.url, api_key="nope") as client:
        assert client.health()["status"] == "ok"  # a server without a key takes any


def test_overload_and_engine_failures_map_back() -> None:
    overloaded = error_from_body(
        {"error": {"message": "full", "type": "overloaded_error", "code": 503}},
        status=503,
        retry_after="7",
    )
    assert isinstance(overloaded, OverloadedError) and overloaded.retry_after_s == 7
    walk = error_from_body(
        {
            "error": {
                "message": "node raised X: boom (node 'llm', walk 'decode', request 'r1')",
                "type": "server_error",
                "mstar_error": "WalkExecutionError",
            }
        }
    )
    assert isinstance(walk, WalkExecutionError) and (
        walk.node,
        walk.walk,
        walk.request_id,
        walk.reason,
    ) == ("llm", "decode", "r1", "node raised X: boom")
    unknown = error_from_body(
        {"error": {"message": "?", "type": "server_error", "mstar_error": "NotAnMStarError"}}
    )
    assert type(unknown) is MStarError
    assert type(error_from_body("Internal Server Error", status=500)) is MStarError


def test_a_full_server_answers_overloaded() -> None:
    config = ServerConfig(
        port=0, admission=AdmissionLimits(max_running=1, max_waiting=0, retry_after_s=3)
    )
    with (
        running_server(
            ModelSpec("tests.server.models:EndlessTone"), config, names=("endless",)
        ) as server,
        Client(server.url) as client,
    ):
        with client.generate("speech") as endless:
            outputs = iter(endless)
            assert isinstance(next(outputs), AudioOutput)  # the request holds the one running slot
            with pytest.raises(OverloadedError) as full:
                client.run("speech", num_chunks=1)
            assert full.value.retry_after_s == 3
        assert server.wait_idle() is not None
        assert (
            len(client.run("speech", num_chunks=2)) == 2
        )  # the stream left: its slot is free again
