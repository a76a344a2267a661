"""BAGEL on mstar's engine: the paged, forked, branch-skipping walks against the dense reference.

Text-to-image, editing and understanding, 1-4 requests at once: the latents match the dense
reference (each CFG context recomputed with its own cache), the PNG bytes are identical, the
reference interpreter running the same graph on dense nodes emits the same, and each step runs
only the branches it needs.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mstar.baselines.bagel import reference_generate, reference_understand
from mstar.baselines.bagel_walks import dense_nodes
from mstar.graph import run_reference
from mstar.runtime import AsyncEngine, Output, Request
from mstar.zoo.bagel.model import BagelModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model64() -> BagelModel:
    return BagelModel("bagel-tiny", dtype="float64")


@pytest.fixture(scope="module")
def model32() -> BagelModel:
    return BagelModel("bagel-tiny")


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def t2i(i: int, **extra: Any) -> Request:
    return Request(
        "image", {"prompt": f"a red cube no. {i}", "seed": 10 + i, "num_timesteps": 6, **extra}
    )


def edit(i: int, **extra: Any) -> Request:
    size = [(64, 64), (48, 80), (64, 32)][i % 3]
    return Request(
        "image_edit",
        {
            "prompt": f"make it blue {i}",
            "image": _image(i, size),
            "seed": i,
            "num_timesteps": 4,
            **extra,
        },
    )


def understand(i: int) -> Request:
    return Request(
        "understand",
        {"prompt": f"what is this? {i}", "image": _image(100 + i, (40, 56)), "max_tokens": 6},
    )


async def serve(
    model: BagelModel, requests: list[Request]
) -> tuple[list[list[Output]], dict[str, Any]]:
    async with await AsyncEngine.start(model) as engine:
        outs = await asyncio.gather(*(engine.run(r) for r in requests))
        stats = (await engine.stats())[0]["llm"]
    return list(outs), stats


def by_name(outputs: list[Output], name: str) -> list[Any]:
    return [o.data for o in outputs if o.name == name]


def png_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


def dense(model: BagelModel, request: Request) -> tuple[torch.Tensor, np.ndarray, int]:
    prepared = model.preprocess(request)
    plan = prepared.state
    weights, vae = model.load(CPU)
    return reference_generate(
        weights, vae, plan.items, plan.spec, prepared.inputs["cfg_combine"]["flow"].x
    )


@pytest.mark.parametrize("batch", [1, 4])
async def test_text_to_image_equals_the_dense_reference(model64: BagelModel, batch: int) -> None:
    requests = [t2i(i) for i in range(batch)]
    outs, stats = await serve(model64, requests)
    passes = 0
    for request, out in zip(requests, outs, strict=True):
        latents, pixels, n = dense(model64, request)
        passes += n
        torch.testing.assert_close(by_name(out, "latents")[0], latents, rtol=0, atol=1e-6)
        (png,) = by_name(out, "image")
        assert png_pixels(png).shape == (64, 64, 3)
        assert png == _png(pixels)  # identical bytes
    # one prefill per request, then only the passes the steps needed (5 steps: all inside the
    # interval)
    assert stats["batched"] == batch + passes and passes == batch * 5 * 2
    # Requests and branches share steps (how often depends on timing: only that they do is
    # asserted).
    assert stats["steps"] <= stats["batched"] and (batch == 1 or stats["steps"] < stats["batched"])


def _png(pixels: np.ndarray) -> bytes:
    from mstar.zoo.bagel.nodes import png_bytes

    return png_bytes(pixels)


async def test_fp32_latents_are_close_and_the_default_schedule_runs_90_passes(
    model32: BagelModel,
) -> None:
    # 50 timesteps, shift 3, interval (0.4, 1]
    request = Request("image", {"token_ids": [5, 6, 7], "seed": 3})
    outs, stats = await serve(model32, [request])
    latents, _, passes = dense(model32, request)
    assert passes == 90 and stats["batched"] == 1 + 90
    torch.testing.assert_close(by_name(outs[0], "latents")[0], latents, rtol=1e-4, atol=1e-4)


async def test_editing_and_understanding_equal_the_dense_reference(model64: BagelModel) -> None:
    requests = [
        edit(0),
        edit(1),
        understand(0),
        t2i(5, cfg_img_scale=2.0),
        edit(2, cfg_interval=[0.5, 1.0]),
        understand(1),
    ]
    outs, _ = await serve(model64, requests)
    weights, vae = model64.load(CPU)
    for request, out in zip(requests, outs, strict=True):
        if request.task == "understand":
            plan = model64.preprocess(request).state
            assert by_name(out, "token") == reference_understand(weights, vae, plan.items, 6)
            continue
        latents, pixels, _ = dense(model64, request)
        torch.testing.assert_close(by_name(out, "latents")[0], latents, rtol=0, atol=1e-6)
        assert by_name(out, "image")[0] == _png(pixels)
        if request.task == "image_edit":  # the output takes the input's (resized) size
            assert pixels.shape[:2] == model64.preprocess(request).state.items[0].size


async def test_the_reference_interpreter_agrees(model64: BagelModel) -> None:
    requests = [t2i(0), edit(1), understand(2)]
    outs, _ = await serve(model64, requests)
    for request, out in zip(requests, outs, strict=True):
        prepared = model64.preprocess(request)
        nodes, passes = dense_nodes(model64)
        emissions = run_reference(
            model64.graph(), nodes, prepared.inputs, model64, state=prepared.state
        )
        want = [(e.name, e.value) for e in emissions]
        got = [(o.name, o.data) for o in out]
        assert [n for n, _ in got] == [n for n, _ in want]
        for (name, a), (_, b) in zip(got, want, strict=True):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            else:
                assert a == b, name
        if request.task != "understand":
            assert passes() == prepared.state.spec.num_passes()


async def test_think_mode_equals_the_dense_reference(model64: BagelModel) -> None:
    """A planning text is decoded (and streamed) first, then taken by the full context alone."""
    requests = [
        t2i(0, think=True, max_think_tokens=6),
        edit(1, think=True, max_think_tokens=5),
        Request("understand", {**understand(3).data, "think": True}),
    ]
    outs, _ = await serve(model64, requests)
    weights, vae = model64.load(CPU)
    for request, out in zip(requests, outs, strict=True):
        prepared = model64.preprocess(request)
        plan = prepared.state
        if request.task == "understand":  # the reasoning instruction first, then the answer
            assert by_name(out, "token") == reference_understand(weights, vae, plan.items, 6)
            continue
        think_ids = reference_understand(
            weights, vae, plan.items, prepared.inputs["llm"]["segments"].max_tokens
        )
        assert by_name(out, "token") == think_ids and think_ids
        latents, pixels, _ = reference_generate(
            weights, vae, plan.items, plan.spec, prepared.inputs["cfg_combine"]["flow"].x, think_ids
        )
        torch.testing.assert_close(by_name(out, "latents")[0], latents, rtol=0, atol=1e-6)
        assert by_name(out, "image")[0] == _png(pixels)
        assert [o.name for o in out] == ["token"] * len(think_ids) + ["latents", "image"]
        nodes, _ = dense_nodes(model64)  # the reference interpreter on the same walks
        emissions = run_reference(
            model64.graph(), nodes, prepared.inputs, model64, state=prepared.state
        )
        assert [e.value for e in emissions if e.name == "token"] == think_ids
        torch.testing.assert_close(
            next(e.value for e in emissions if e.name == "latents"), latents, rtol=0, atol=1e-6
        )


def test_think_options_are_checked(model32: BagelModel) -> None:
    with pytest.raises(ValueError, match="think"):
        model32.preprocess(t2i(0, think="yes"))
    with pytest.raises(ValueError, match="max_think_tokens"):
        model32.preprocess(t2i(0, think=True, max_think_tokens=0))
    plan = model32.preprocess(t2i(0, think=True)).state
    assert plan.walks == ["prefill_text", "prefill_text", "decode", "prefill_text", "image_gen"]


async def test_answers_honour_the_sampling_settings(model32: BagelModel) -> None:
    def ask(**sampling: Any) -> Request:
        return Request(
            "understand",
            {"prompt": "what is this?", "image": _image(5, (40, 56)), "max_tokens": 8, **sampling},
        )

    requests = [
        ask(),
        ask(temperature=1.5, seed=1),
        ask(temperature=1.5, seed=1),
        ask(temperature=1.5, top_p=0.9, seed=2),
    ]
    outs, _ = await serve(model32, requests)
    greedy, sampled, again, nucleus = (by_name(o, "token") for o in outs)
    weights, vae = model32.load(CPU)
    assert greedy == reference_understand(
        weights, vae, model32.preprocess(requests[0]).state.items, 8
    )
    assert sampled == again  # seeded draws repeat
    assert sampled != greedy and nucleus != sampled  # and are draws (fixed seeds: deterministic)


def test_bad_sampling_settings_and_edit_sizes_are_refused_before_generation(
    model32: BagelModel,
) -> None:
    with pytest.raises(ValueError, match="top_p"):
        model32.preprocess(
            Request("understand", {"prompt": "x", "image": _image(0, (40, 56)), "top_p": 0.0})
        )
    for name, value in (("logprobs", 21), ("ignore_eos", True)):  # logprobs: at most 20
        with pytest.raises(ValueError, match=name):
            model32.preprocess(
                Request("understand", {"prompt": "x", "image": _image(0, (40, 56)), name: value})
            )
    with pytest.raises(ValueError, match="size: an edit keeps the input's size, 80x48"):
        model32.preprocess(edit(1, width=64, height=64))
    plan = model32.preprocess(edit(1, width=80, height=48)).state  # its own size is fine
    assert plan.spec is not None and (plan.spec.width, plan.spec.height) == (80 // 16, 48 // 16)
