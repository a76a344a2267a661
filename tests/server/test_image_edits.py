"""`POST /v1/images/edits` against `toy-composite` (its `image_edit` task), with the official
`openai` client and httpx: uploads, validation, limits, and a model without the task."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from mstar.graph import run_reference
from mstar.runtime.model import ModelSpec
from mstar.server import ServerConfig
from mstar.server.images import decode_image
from mstar.zoo.toy import ToyModel, ToyPlan, make_toy_inputs, prepare_toy_images
from tests.server.conftest import RunningServer, running_server

MODEL = "toy-composite"


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def encoded(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()


def picture(seed: int, shape: tuple[int, ...] = (20, 14, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def reference(files: list[bytes], prompt: str, seed: int = 0) -> np.ndarray:
    """The toy's edit of these files, computed by the reference interpreter."""
    model = ToyModel()
    images = prepare_toy_images([decode_image(f) for f in files], model.config)
    inputs = make_toy_inputs(prompt, model.config, seed, images)
    emissions = run_reference(model.graph(), model._nodes, inputs, ToyPlan(), state="image_edit")
    (image,) = [e.value for e in emissions if e.name == "image"]
    return torch.as_tensor(image).numpy()


def pixels(b64: str | None) -> np.ndarray:
    assert b64 is not None
    decoded = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert decoded.format == "PNG"
    return np.asarray(decoded)


def test_the_openai_client_edits_an_image(toy_server: RunningServer) -> None:
    png = encoded(picture(1))
    result = client(toy_server).images.edit(
        model=MODEL,
        image=("in.png", png, "image/png"),
        prompt="make it brighter",
        n=2,
        response_format="b64_json",
    )
    assert len(result.data) == 2
    want = reference([png], "make it brighter")
    for image in result.data:
        assert np.array_equal(pixels(image.b64_json), want)
    # another picture, another edit
    other = client(toy_server).images.edit(
        model=MODEL, image=("in.png", encoded(picture(2)), "image/png"), prompt="make it brighter"
    )
    assert not np.array_equal(pixels(other.data[0].b64_json), want)


def test_the_openai_client_sends_several_images(toy_server: RunningServer) -> None:
    files = [encoded(picture(3)), encoded(picture(4, (9, 31)), "JPEG")]
    result = client(toy_server).images.edit(
        model=MODEL,
        image=[("a.png", files[0], "image/png"), ("b.jpg", files[1], "image/jpeg")],
        prompt="blend",
        extra_body={"seed": 11},
    )
    assert np.array_equal(pixels(result.data[0].b64_json), reference(files, "blend", seed=11))


def test_httpx_multipart_with_size_and_seed(toy_server: RunningServer) -> None:
    jpeg = encoded(picture(5, (64, 48, 3)), "JPEG")
    with httpx.Client(base_url=toy_server.url) as http:
        answer = http.post(
            "/v1/images/edits",
            files=[("image", ("photo.jpg", jpeg, "image/jpeg"))],
            data={
                "prompt": "a cat",
                "n": "2",
                "size": "8x8",
                "seed": "3",
                "response_format": "b64_json",
            },
        )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert isinstance(body["created"], int) and len(body["data"]) == 2
    first, second = (pixels(d["b64_json"]) for d in body["data"])
    assert np.array_equal(first, reference([jpeg], "a cat", seed=3))
    assert np.array_equal(second, reference([jpeg], "a cat", seed=4))  # image i gets seed + i
    assert (
        toy_server.metric("mstar_requests_finished_total", task="image_edit", status="completed")
        >= 2
    )


def error(answer: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    payload: dict[str, Any] = answer.json()["error"]
    return payload


def test_bad_edits_get_clear_400s(toy_server: RunningServer) -> None:
    png = encoded(picture(6))
    gif = io.BytesIO()
    Image.fromarray(picture(6)).save(gif, format="GIF")

    def post(files: list[tuple[str, Any]] | None = None, **fields: str) -> httpx.Response:
        with httpx.Client(base_url=toy_server.url) as http:
            return http.post(
                "/v1/images/edits",
                files=files or [("image", ("in.png", png, "image/png"))],
                data={"prompt": "p", **fields},
            )

    with httpx.Client(base_url=toy_server.url) as http:
        as_json = http.post("/v1/images/edits", json={"prompt": "p", "image": "aGk="})
        no_image = http.post("/v1/images/edits", data={"prompt": "p"}, files={"other": ("x", b"1")})
        text_image = http.post(
            "/v1/images/edits", data={"prompt": "p", "image": "aGk="}, files={"other": ("x", b"1")}
        )
    assert "multipart/form-data" in error(as_json)["message"]
    assert error(no_image)["param"] == "image" and "required" in error(no_image)["message"]
    assert "file upload" in error(text_image)["message"]
    assert (
        "not a PNG or JPEG"
        in error(post([("image", ("in.gif", gif.getvalue(), "image/gif"))]))["message"]
    )
    truncated = error(post([("image", ("in.png", png[: len(png) // 2], "image/png"))]))
    assert truncated["param"] == "image" and "'in.png'" in truncated["message"]
    assert "empty" in error(post([("image", ("in.png", b"", "image/png"))]))["message"]
    assert (
        error(
            post([("image", ("in.png", png, "image/png")), ("mask", ("m.png", png, "image/png"))])
        )["param"]
        == "mask"
    )
    assert error(post(response_format="url"))["param"] == "response_format"
    assert error(post(n="0"))["param"] == "n"
    assert error(post(n="two"))["param"] == "n"
    assert error(post(prompt=""))["param"] == "prompt"
    assert error(post(output_format="webp"))["param"] == "output_format"
    assert "8x8" in error(post(size="512x512"))["message"]
    assert error(post(model="dall-e-2"), 404)["code"] == "model_not_found"
    many = [("image[]", (f"{i}.png", png, "image/png")) for i in range(17)]
    assert "at most 16" in error(post(many))["message"]
    with pytest.raises(openai.BadRequestError, match="not a PNG or JPEG"):
        client(toy_server).images.edit(
            model=MODEL, image=("in.gif", gif.getvalue(), "image/gif"), prompt="p"
        )
    # the server still edits after all that
    assert post().status_code == 200


@pytest.fixture(scope="module")
def small_body_server() -> Iterator[RunningServer]:
    config = ServerConfig(port=0, max_body_bytes=4096)
    with running_server(ModelSpec("mstar.zoo.toy:ToyModel"), config, names=(MODEL,)) as server:
        yield server


def test_uploads_over_the_body_limit_get_413(small_body_server: RunningServer) -> None:
    big = encoded(picture(7, (64, 64, 3)))  # noise does not compress: about 12 KiB
    assert len(big) > 4096
    with httpx.Client(base_url=small_body_server.url) as http:
        declared = http.post(
            "/v1/images/edits", files={"image": ("big.png", big, "image/png")}, data={"prompt": "p"}
        )
        request = http.build_request(
            "POST",
            "/v1/images/edits",
            files={"image": ("big.png", big, "image/png")},
            data={"prompt": "p"},
        )
        body, content_type = request.read(), request.headers["content-type"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for i in range(0, len(body), 1000):
                yield body[i : i + 1000]

        streamed = http.post(
            "/v1/images/edits", content=chunks(), headers={"content-type": content_type}
        )
        small = http.post(
            "/v1/images/edits",
            files={"image": ("s.png", encoded(picture(8, (4, 4))), "image/png")},
            data={"prompt": "p"},
        )
    assert "4096 bytes" in error(declared, 413)["message"]
    assert error(streamed, 413)["code"] == 413
    assert small.status_code == 200
    with pytest.raises(openai.APIStatusError) as too_large:
        client(small_body_server).images.edit(
            model=MODEL, image=("big.png", big, "image/png"), prompt="p"
        )
    assert too_large.value.status_code == 413


def test_a_model_without_an_edit_task_says_so(endless_server: RunningServer) -> None:
    png = encoded(picture(9))
    with pytest.raises(openai.BadRequestError) as refused:
        client(endless_server).images.edit(image=("in.png", png, "image/png"), prompt="p")
    assert "cannot do task 'image_edit'" in refused.value.message
    assert refused.value.body["code"] == "unsupported_task"  # type: ignore[index]
