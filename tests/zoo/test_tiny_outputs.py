"""Every tiny zoo model's outputs, task by task, carry a signal: finite and not constant.

Random weights make noise, but noise that shows the path works: audio that is not all zeros
(nor a constant) once rounded to PCM16, images of more than one colour, latents and actions
that vary. Each model runs in the embedded `AsyncEngine`, one process.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Output, Request
from mstar.server.audio import pcm16_bytes
from mstar.zoo import resolve_model
from mstar.zoo.qwen3_omni.checkpoint import make_random_checkpoint
from mstar.zoo.qwen3_omni.config import get_qwen3_omni_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

_RNG = np.random.default_rng(0)
IMAGE = _RNG.integers(0, 256, (40, 56, 3), dtype=np.uint8)
GOAL = _RNG.integers(0, 256, (40, 56, 3), dtype=np.uint8)
OBSERVATION = {
    "observation/exterior_image_1_left": _RNG.integers(0, 256, (48, 64, 3), dtype=np.uint8),
    "observation/wrist_image_left": _RNG.integers(0, 256, (48, 48, 3), dtype=np.uint8),
    "observation/joint_position": _RNG.uniform(-1.5, 1.5, 7),
    "observation/gripper_position": _RNG.uniform(0, 1, 1),
    "prompt": "pick up the cup",
    "seed": 1,
}

# (task, request data, the output names that must carry a signal)
REQUESTS: dict[str, list[tuple[str, dict[str, Any], set[str]]]] = {
    "toy-composite": [
        ("speech", {"text": "hello there", "seed": 1}, {"audio"}),
        ("image", {"text": "a cube", "seed": 1}, {"image", "norm"}),
        ("image_edit", {"text": "bluer", "image": IMAGE, "seed": 1}, {"image", "norm"}),
    ],
    "orpheus-tiny": [("speech", {"text": "hello", "max_tokens": 70, "seed": 1}, {"audio"})],
    "qwen3-omni-tiny": [
        ("speech", {"text": "hello", "seed": 1, "max_audio_frames": 30}, {"audio"}),
        ("generate", {"text": "hi", "max_tokens": 6, "seed": 1, "max_audio_frames": 30}, {"audio"}),
        (
            "generate",
            {
                "text": "hi",
                "max_tokens": 6,
                "seed": 1,
                "max_audio_frames": 30,
                "return_codes": True,
            },
            {"audio", "talker_codes"},
        ),
    ],
    "bagel-tiny": [
        ("image", {"prompt": "a cube", "num_timesteps": 4, "seed": 1}, {"image", "latents"}),
        (
            "image_edit",
            {"prompt": "bluer", "image": IMAGE, "num_timesteps": 4, "seed": 1},
            {"image", "latents"},
        ),
    ],
    "vjepa2-tiny": [
        ("encode", {"image": IMAGE}, {"latents"}),
        (
            "rollout",
            {"image": IMAGE, "actions": _RNG.normal(size=(3, 7)) * 0.05},
            {"latents", "poses"},
        ),
        ("plan", {"image": IMAGE, "goal_image": GOAL, "seed": 1}, {"action"}),
    ],
    "pi05-tiny": [("act", OBSERVATION, {"actions"})],
}


def _spec(name: str, tmp_path: Path) -> ModelSpec:
    if name != "qwen3-omni-tiny":
        return resolve_model(name)
    # Freshly written random weights: what `make_random_checkpoint` draws now, not a cached copy.
    checkpoint = make_random_checkpoint(get_qwen3_omni_config(name), tmp_path / "qwen3-omni-tiny")
    return resolve_model(name, checkpoint=str(checkpoint), colocated=True)


def _array(out: Output) -> np.ndarray:
    if isinstance(out.data, bytes | bytearray):  # an encoded image
        return np.asarray(Image.open(io.BytesIO(out.data)).convert("RGB"))
    return (
        torch.as_tensor(
            np.asarray(out.data) if not isinstance(out.data, torch.Tensor) else out.data
        )
        .double()
        .numpy()
    )


def _check_signal(name: str, task: str, output: str, outs: list[Output]) -> None:
    where = f"{name} {task} {output}"
    if outs[0].modality == "audio":
        samples = np.concatenate([_array(o).reshape(-1) for o in outs])
        pcm = np.frombuffer(pcm16_bytes(samples), "<i2")
        assert np.isfinite(samples).all(), where
        assert np.abs(pcm).max() > 0 and pcm.std() > 0, (
            f"{where}: silent ({np.abs(samples).max():.3g} abs-max)"
        )
        return
    for out in outs:
        value = _array(out)
        assert value.size and np.isfinite(value).all(), where
        if out.modality == "image":
            pixels = value.reshape(-1, value.shape[-1]) if value.ndim == 3 else value.reshape(-1, 1)
            assert len(np.unique(pixels, axis=0)) > 1, f"{where}: a single colour"
        else:
            assert value.std() > 0, f"{where}: constant"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(REQUESTS))
async def test_every_task_of_a_tiny_model_gives_a_signal(name: str, tmp_path: Path) -> None:
    async with await AsyncEngine.start(
        _spec(name, tmp_path), config=EngineConfig(worker_processes=False)
    ) as engine:
        for task, data, names in REQUESTS[name]:
            outputs = await engine.run(Request(task, dict(data)))
            by_name: dict[str, list[Output]] = {}
            for out in outputs:
                by_name.setdefault(out.name, []).append(out)
            assert names <= set(by_name), f"{name} {task}: outputs {sorted(by_name)}"
            for output in names:
                _check_signal(name, task, output, by_name[output])
