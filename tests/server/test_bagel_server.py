"""BAGEL over HTTP with the official `openai` client: text-to-image, edits and image
understanding in a chat (an ``image_url`` data URL), each equal to the dense reference; bad
inputs answered 400, naming the field."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from mstar.baselines.bagel import reference_generate, reference_understand
from mstar.runtime import Request
from mstar.zoo.bagel.model import BagelModel
from mstar.zoo.bagel.nodes import png_bytes
from tests.server.conftest import RunningServer, running_server

MODEL = "bagel-tiny"


@pytest.fixture(scope="module")
def model() -> BagelModel:
    return BagelModel(MODEL, dtype="float64")  # PNG bytes equal the dense reference's


@pytest.fixture(scope="module")
def server(model: BagelModel) -> Iterator[RunningServer]:
    with running_server(model, names=(MODEL,)) as running:
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def encoded(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def picture(seed: int, shape: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def dense_png(model: BagelModel, task: str, data: dict[str, Any]) -> bytes:
    prepared = model.preprocess(Request(task, data))
    plan = prepared.state
    weights, vae = model.load(__import__("torch").device("cpu"))
    _, pixels, _ = reference_generate(
        weights, vae, plan.items, plan.spec, prepared.inputs["cfg_combine"]["flow"].x
    )
    return png_bytes(pixels)


def test_images_generations_equal_the_dense_reference(
    server: RunningServer, model: BagelModel
) -> None:
    result = client(server).images.generate(
        model=MODEL,
        prompt="a red cube",
        n=2,
        size="64x48",
        response_format="b64_json",
        extra_body={"seed": 7, "num_inference_steps": 4},
    )
    for i, image in enumerate(result.data):
        assert image.b64_json is not None
        png = base64.b64decode(image.b64_json)
        want = dense_png(
            model,
            "image",
            {"text": "a red cube", "seed": 7 + i, "num_timesteps": 4, "width": 64, "height": 48},
        )
        assert png == want
        assert Image.open(io.BytesIO(png)).size == (64, 48)


def test_images_edits_take_the_input_size(server: RunningServer, model: BagelModel) -> None:
    source = picture(1, (48, 80))
    result = client(server).images.edit(
        model=MODEL,
        image=("in.png", encoded(source), "image/png"),
        prompt="make it blue",
        extra_body={"seed": 3, "num_inference_steps": 3},
    )
    assert result.data[0].b64_json is not None
    png = base64.b64decode(result.data[0].b64_json)
    assert Image.open(io.BytesIO(png)).size == (80, 48)
    assert png == dense_png(
        model,
        "image_edit",
        {"text": "make it blue", "images": [source], "seed": 3, "num_timesteps": 3},
    )


def test_a_multipart_edit_takes_one_guidance_scale_the_text_scale(
    server: RunningServer, model: BagelModel
) -> None:
    source = picture(3, (64, 64))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        answer = http.post(
            "/v1/images/edits",
            files=[("image", ("in.png", encoded(source), "image/png"))],
            data={
                "prompt": "make it red",
                "guidance_scale": "2.5",
                "seed": "5",
                "num_inference_steps": "3",
                "size": "64x64",
            },
        )
    assert answer.status_code == 200, answer.text
    png = base64.b64decode(answer.json()["data"][0]["b64_json"])
    data = {"text": "make it red", "images": [source], "seed": 5, "num_timesteps": 3}
    assert png == dense_png(model, "image_edit", {**data, "cfg_text_scale": 2.5})
    # the default text scale (4.0) makes another image
    assert png != dense_png(model, "image_edit", data)


def test_chat_understands_an_image_url(server: RunningServer, model: BagelModel) -> None:
    source = picture(2, (40, 56))
    url = "data:image/png;base64," + base64.b64encode(encoded(source)).decode()
    answer = client(server).chat.completions.create(
        model=MODEL,
        max_tokens=5,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "what is it?"},
                ],
            }
        ],
    )
    prepared = model.preprocess(Request("understand", {"text": "what is it?", "image": source}))
    weights, vae = model.load(__import__("torch").device("cpu"))
    ids = reference_understand(weights, vae, prepared.state.items, 5)
    assert answer.choices[0].message.content == model.detokenize(ids)
    assert answer.usage is not None and answer.usage.completion_tokens == len(ids)


@pytest.mark.parametrize(
    ("path", "kwargs", "field"),
    [
        ("/v1/images/generations", {"json": {"prompt": "x", "size": "4096x64"}}, "width"),
        (
            "/v1/images/generations",
            {"json": {"prompt": "x", "guidance_scale": [4.0, 2.0, 1.5]}},
            "guidance_scale",
        ),
        (
            "/v1/images/edits",
            {
                "files": [("image", ("a.png", b"not an image", "image/png"))],
                "data": {"prompt": "x"},
            },
            "image",
        ),
        (
            "/v1/images/edits",
            {
                "files": [("image", ("a.png", encoded(picture(4, (48, 80))), "image/png"))],
                "data": {"prompt": "x", "size": "64x64"},
            },
            "size",
        ),
        (
            "/v1/chat/completions",
            {
                "json": {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image_url",
                                    "image_url": {"url": "data:image/png;base64,AAAA"},
                                }
                            ],
                        }
                    ]
                }
            },
            "messages.0.content.0",
        ),
    ],
)
def test_bad_inputs_get_a_400_naming_the_field(
    server: RunningServer, path: str, kwargs: dict[str, Any], field: str
) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        answer = http.post(path, **kwargs)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert field in (error.get("param") or "") + error["message"]


def test_understanding_comes_with_log_probabilities(server: RunningServer) -> None:
    url = "data:image/png;base64," + base64.b64encode(encoded(picture(2, (40, 56)))).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what is it?"},
            ],
        }
    ]
    plain = client(server).chat.completions.create(model=MODEL, max_tokens=5, messages=messages)  # type: ignore[arg-type]
    answer = client(server).chat.completions.create(
        model=MODEL,
        max_tokens=5,
        messages=messages,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    choice = answer.choices[0]
    assert (
        choice.message.content == plain.choices[0].message.content and choice.logprobs is not None
    )
    content = choice.logprobs.content or []
    assert len(content) == answer.usage.completion_tokens > 0  # type: ignore[union-attr]
    for entry in content:  # greedy: the chosen token is the likeliest one
        tops = [t.logprob for t in entry.top_logprobs]
        assert entry.logprob <= 0 and len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (
            entry.token,
            entry.logprob,
        )
    native = httpx.post(
        f"{server.url}/generate",
        json={
            "task": "generate",
            "prompt": "what is it?",
            "max_tokens": 4,
            "logprobs": 2,
            "stream": False,
        },
        timeout=60,
    )
    assert native.status_code == 200, native.text
    lines = [json.loads(line) for line in native.text.splitlines()]
    tokens = [line["logprobs"] for line in lines if line.get("modality") == "text"]
    assert tokens and all(
        t["logprob"] <= 0 and t["top_token_ids"][0] == t["token_id"] for t in tokens
    )
