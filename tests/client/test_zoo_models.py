"""Every zoo model's every task through `mstar.client`, against a real server per model: each
output arrives as its typed class and decodes (images as uint8 RGB with a valid PNG, audio as
float32 samples at the model's rate, arrays of the model's shapes with finite values)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from mstar.client import (
    ActionOutput,
    AudioOutput,
    Client,
    GenerateOutput,
    ImageOutput,
    LatentOutput,
    TensorOutput,
    TextOutput,
    ValueOutput,
    image_url,
)
from mstar.zoo import resolve_model
from mstar.zoo.vjepa2 import get_vjepa2_config
from tests.server.conftest import RunningServer, running_server

pytestmark = pytest.mark.slow  # a server per model, each task run once

VJEPA = get_vjepa2_config("vjepa2-tiny")
N, D = VJEPA.predictor.num_patches, VJEPA.predictor.embed_dim
RNG = np.random.default_rng(5)
PICTURE = RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)


def _latent(seed: int) -> list[list[float]]:
    x = np.random.default_rng(seed).standard_normal((N, D)).astype(np.float32)
    x = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)  # as the encoder normalises
    return x.tolist()


def _observation() -> dict[str, Any]:
    return {
        "observation/exterior_image_1_left": RNG.integers(0, 256, (32, 48, 3), dtype=np.uint8),
        "observation/wrist_image_left": RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8),
        "observation/joint_position": RNG.uniform(-1.0, 1.0, 7),
        "observation/gripper_position": RNG.uniform(0.0, 1.0, 1),
        "prompt": "pick up the cup",
        "seed": 7,
    }


@dataclass(frozen=True)
class Case:
    """One task of one model: its request data and the outputs it must give, by class and name."""

    model: str
    task: str
    data: dict[str, Any]
    expects: dict[type[GenerateOutput], set[str]]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


CASES = [
    Case(
        "toy-composite",
        "speech",
        {"text": "hello"},
        {AudioOutput: {"audio"}, TextOutput: {"token"}},
    ),
    Case(
        "toy-composite",
        "image",
        {"text": "a lighthouse", "seed": 3},
        {ImageOutput: {"image"}, LatentOutput: {"norm"}},
        {"image": (8, 8, 3)},
    ),
    Case(
        "toy-composite",
        "image_edit",
        {"text": "bluer", "images": [image_url(PICTURE[:8, :8])], "seed": 3},
        {ImageOutput: {"image"}, LatentOutput: {"norm"}},
        {"image": (8, 8, 3)},
    ),
    Case(
        "orpheus-tiny",
        "speech",
        {
            "text": "Hello from mstar.",
            "voice": "tara",
            "seed": 7,
            "temperature": 0.0,
            "max_tokens": 120,
        },
        {AudioOutput: {"audio"}},
    ),
    Case(
        "vjepa2-tiny",
        "encode",
        {"image": image_url(PICTURE)},
        {LatentOutput: {"latents"}},
        {"latents": (1, N, D)},
    ),
    Case(
        "vjepa2-tiny",
        "rollout",
        {
            "latent": _latent(1),
            "actions": (RNG.standard_normal((2, 7)) * 0.05).tolist(),
            "pose": [0.0] * 7,
        },
        {LatentOutput: {"latents", "poses"}},
        {"latents": (2, N, D), "poses": (2, 7)},
    ),
    Case(
        "vjepa2-tiny",
        "plan",
        {
            "latent": _latent(2),
            "goal_latent": _latent(3),
            "samples": 8,
            "topk": 2,
            "cem_steps": 2,
            "rollout": 2,
            "seed": 1,
        },
        {ActionOutput: {"action"}},
        {"action": (7,)},
    ),
    Case("pi05-tiny", "act", _observation(), {ActionOutput: {"actions"}}, {"actions": (10, 8)}),
    Case(
        "bagel-tiny",
        "image",
        {"text": "a red square", "seed": 3, "num_timesteps": 3},
        {ImageOutput: {"image"}, LatentOutput: {"latents"}},
    ),
    Case(
        "bagel-tiny",
        "image_edit",
        {"text": "make it blue", "image": image_url(PICTURE), "seed": 3, "num_timesteps": 3},
        {ImageOutput: {"image"}, LatentOutput: {"latents"}},
    ),
    Case(
        "bagel-tiny",
        "understand",
        {"text": "what is it?", "image": image_url(PICTURE), "max_tokens": 4},
        {TextOutput: {"token"}},
    ),
    Case(
        "bagel-tiny", "generate", {"prompt": "Once upon", "max_tokens": 4}, {TextOutput: {"token"}}
    ),
    Case(
        "qwen3-omni-tiny",
        "generate",
        {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
        {TextOutput: {"text"}},
    ),
    Case(
        "qwen3-omni-tiny",
        "speech",
        {"text": "Hello you", "voice": "chelsie"},
        {AudioOutput: {"audio"}},
    ),
    # Real small weights (SmolLM2-135M; the assistant adds a Piper voice): about 10 s each to load.
    Case(
        "smollm2-135m",
        "generate",
        {"prompt": "Hi", "max_tokens": 4, "temperature": 0.0},
        {TextOutput: {"tokens"}},
    ),
    Case(
        "assistant",
        "generate",
        {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0.0},
        {TextOutput: {"tokens"}, AudioOutput: {"audio"}},
    ),
    Case("assistant", "speech", {"text": "Hello there."}, {AudioOutput: {"audio"}}),
]
_REAL_WEIGHTS = frozenset({"smollm2-135m", "assistant"})


@pytest.fixture(scope="module")
def zoo_server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    name = request.param
    if name in _REAL_WEIGHTS:
        try:
            from mstar.zoo.smollm2 import smollm2_checkpoint_dir

            smollm2_checkpoint_dir()
        except Exception as exc:  # the weights package is not installed here
            pytest.skip(f"SmolLM2 weights unavailable: {exc}")
    with running_server(resolve_model(name), names=(name,)) as server:
        yield server


def _raw_lines(server: RunningServer, task: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        answer = http.post("/generate", json={"task": task, "data": data, "stream": False})
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line]


def _check_decodes(out: GenerateOutput, case: Case, server: RunningServer) -> None:
    if isinstance(out, ImageOutput):
        assert out.image.dtype == np.uint8 and out.image.ndim == 3 and out.image.shape[2] == 3
        assert out.width > 0 and out.height > 0
    elif isinstance(out, AudioOutput):
        assert out.samples is not None and out.samples.dtype == np.float32
        assert out.num_samples == len(out.samples) and np.isfinite(out.samples).all()
        assert out.sample_rate == server.state.sample_rate
    elif isinstance(out, TensorOutput):
        assert out.array.size > 0 and np.isfinite(out.array).all()
    elif isinstance(out, TextOutput):
        assert all(isinstance(t, int) for t in out.token_ids)
    if out.name in case.shapes:
        shape = out.image.shape if isinstance(out, ImageOutput) else out.array.shape  # type: ignore[attr-defined]
        assert tuple(shape) == case.shapes[out.name], (out.name, shape)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("zoo_server", "case"),
    [pytest.param(c.model, c, id=f"{c.model}-{c.task}") for c in CASES],
    indirect=["zoo_server"],
)
def test_every_task_arrives_typed_and_decodes(zoo_server: RunningServer, case: Case) -> None:
    # none left out
    assert set(zoo_server.state.tasks) == {c.task for c in CASES if c.model == case.model}
    with Client(zoo_server.url) as client:
        stream = client.generate(case.task, case.data)
        outputs = list(stream)
    assert stream.usage is not None
    assert not [o for o in outputs if isinstance(o, ValueOutput)], "an output fell back to a value"
    got: dict[type[GenerateOutput], set[str]] = {}
    for out in outputs:
        got.setdefault(type(out), set()).add(out.name)
        _check_decodes(out, case, zoo_server)
    for cls, names in case.expects.items():
        assert names <= got.get(cls, set()), (cls.__name__, names, got)
    images = [o for o in outputs if isinstance(o, ImageOutput)]
    if images:  # the PNG on the wire is the array the client gives
        (line,) = [
            line
            for line in _raw_lines(zoo_server, case.task, case.data)
            if line.get("modality") == "image"
        ]
        with Image.open(io.BytesIO(base64.b64decode(line["data"])), formats=("PNG",)) as png:
            assert (
                (png.width, png.height)
                == (line["width"], line["height"])
                == (images[-1].width, images[-1].height)
            )
            np.testing.assert_array_equal(np.array(png.convert("RGB")), images[-1].image)
