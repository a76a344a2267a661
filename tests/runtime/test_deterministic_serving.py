"""Deterministic serving (`EngineConfig(deterministic=True)`) for every zoo model family.

Each task's request, served among others that arrive at random moments (hypothesis draws
which others and when), gives byte for byte the outputs it gives alone: audio samples,
tokens, image pixels and latents, actions, V-JEPA 2 latents and plans. The sizes are the
smallest at which the fast path's outputs do differ under batching (orpheus-small's SNAC,
bagel-small's products). Placements and thread counts are covered in
`test_deterministic_placement.py`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Output, Request
from mstar.zoo import resolve_model
from mstar.zoo.qwen3_omni.checkpoint import make_random_checkpoint
from mstar.zoo.qwen3_omni.config import get_qwen3_omni_config
from tests.zoo.test_tiny_outputs import IMAGE, OBSERVATION

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

_RNG = np.random.default_rng(1)

# model -> its tasks' requests (task, data); the first of each model is the one checked
CASES: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "orpheus-small": [
        ("speech", {"text": "hello there", "max_tokens": 84, "seed": 1, "ignore_eos": True}),
        ("speech", {"text": "a b c", "max_tokens": 56, "seed": 2, "ignore_eos": True}),
    ],
    "pi05-tiny": [
        ("act", OBSERVATION),
        ("act", {**OBSERVATION, "prompt": "open the drawer", "seed": 7}),
    ],
    "vjepa2-tiny": [
        ("rollout", {"image": IMAGE, "actions": _RNG.normal(size=(3, 7)) * 0.05}),
        ("plan", {"image": IMAGE, "goal_image": IMAGE[::-1].copy(), "seed": 1}),
        ("encode", {"image": IMAGE}),
    ],
    "bagel-small": [
        ("image_edit", {"prompt": "bluer", "image": IMAGE, "num_timesteps": 4, "seed": 2}),
        ("image", {"prompt": "a cube", "num_timesteps": 4, "seed": 1}),
    ],
    "qwen3-omni-tiny": [
        (
            "generate",
            {"text": "hi", "max_tokens": 8, "seed": 1, "max_audio_frames": 30, "temperature": 1.0},
        ),
        ("speech", {"text": "hello", "seed": 3, "max_audio_frames": 30}),
    ],
}


def _spec(name: str, tmp: Path) -> ModelSpec:
    if name != "qwen3-omni-tiny":
        return resolve_model(name)
    checkpoint = make_random_checkpoint(get_qwen3_omni_config(name), tmp / name)
    return resolve_model(name, checkpoint=str(checkpoint), colocated=True)


def outputs_bytes(outs: list[Output]) -> dict[str, list[bytes]]:
    """Each output name's values as bytes, in emission order."""
    by_name: dict[str, list[bytes]] = {}
    for out in outs:
        data = out.data
        if isinstance(data, torch.Tensor):
            data = data.numpy()
        value = (
            data.tobytes()
            if isinstance(data, np.ndarray)
            else bytes(data)
            if isinstance(data, bytes | bytearray)
            else repr(data).encode()
        )
        by_name.setdefault(out.name, []).append(value)
    return by_name


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_a_request_gives_its_bytes_alone_and_among_others(name: str, tmp_path: Path) -> None:
    async def serve_all() -> None:
        async with await AsyncEngine.start(
            _spec(name, tmp_path), config=EngineConfig(deterministic=True)
        ) as engine:
            task, data = CASES[name][0]
            alone = outputs_bytes(await engine.run(Request(task, dict(data))))
            assert alone and all(alone.values())

            @settings(
                max_examples=2,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            )
            # every other task twice, all at once; then random mixes and arrivals
            @example(others=[(case, 0.0) for case in CASES[name]] * 2, delay=0.0)
            @given(
                others=st.lists(
                    st.tuples(
                        st.sampled_from(CASES[name]), st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.2])
                    ),
                    min_size=2,
                    max_size=4,
                ),
                delay=st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.2]),
            )
            def among_others(
                others: list[tuple[tuple[str, dict[str, Any]], float]], delay: float
            ) -> None:
                async def late(request: Request, wait: float) -> list[Output]:
                    await asyncio.sleep(wait)
                    return await engine.run(request)

                async def mixed() -> list[Output]:
                    runs = [late(Request(t, dict(d)), wait) for (t, d), wait in others]
                    target = late(Request(task, dict(data)), delay)
                    results = await asyncio.gather(target, *runs)
                    return results[0]

                got = outputs_bytes(asyncio.run_coroutine_threadsafe(mixed(), loop).result())
                assert got == alone

            loop = asyncio.get_running_loop()
            await asyncio.to_thread(among_others)

    asyncio.run(serve_all())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in CASES if n != "orpheus-small"])
def test_every_task_gives_the_same_bytes_on_one_thread_and_on_two(
    name: str, tmp_path: Path
) -> None:
    """(orpheus-small on one and two threads, in processes and over Ray nodes: see
    tests/multinode/test_ray_cluster.py.)"""

    async def run(threads: int) -> list[dict[str, list[bytes]]]:
        config = EngineConfig(deterministic=True, cpu_threads=threads)
        async with await AsyncEngine.start(_spec(name, tmp_path), config=config) as engine:
            return [
                outputs_bytes(await engine.run(Request(task, dict(data))))
                for task, data in CASES[name]
            ]

    assert asyncio.run(run(1)) == asyncio.run(run(2))
