"""ConductorCore + WorkerCore wired directly: the whole request lifecycle against the reference."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

import pytest
import torch

from mstar.errors import RequestAbortedError, WalkExecutionError
from mstar.graph import Emission, run_reference
from mstar.runtime.model import Output, Request
from mstar.zoo.toy import ToyModel, ToyPlan, make_toy_inputs, prepare_toy_images
from tests.helpers import Direct

Slot = tuple[str, str]


def grouped(items: list[Any]) -> dict[tuple[str, str], list[Any]]:
    out: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for e in items:
        out[(e.node, e.name)].append(e.data if isinstance(e, Output) else e.value)
    return out


def assert_same(outputs: list[Output], emissions: list[Emission]) -> None:
    got, want = grouped(outputs), grouped(emissions)
    assert got.keys() == want.keys()
    for key in want:
        assert len(got[key]) == len(want[key]), key
        for a, b in zip(got[key], want[key], strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), key


PLACEMENTS = {
    "colocated": {
        n: [0]
        for n in (
            "encoder",
            "lm",
            "vocoder",
            "init",
            "image_encoder",
            "cond",
            "uncond",
            "combine",
            "vae",
        )
    },
    "spread": {
        "encoder": [1],
        "lm": [0],
        "vocoder": [2],
        "init": [2],
        "image_encoder": [1],
        "cond": [0],
        "uncond": [1],
        "combine": [2],
        "vae": [0],
    },
    "replicas": {
        "encoder": [0, 1],
        "lm": [0, 1],
        "vocoder": [2],
        "init": [0],
        "image_encoder": [2],
        "cond": [1],
        "uncond": [2],
        "combine": [0, 1],
        "vae": [2],
    },
}


@pytest.mark.parametrize("placement", PLACEMENTS.values(), ids=PLACEMENTS.keys())
@pytest.mark.parametrize("task", ["speech", "image", "image_edit"])
async def test_outputs_equal_the_reference(placement: dict[str, list[int]], task: str) -> None:
    model = ToyModel(seed=4)
    async with Direct(model, placement) as d:
        for i, text in enumerate(["hello", "composite models", "x"]):
            pictures = [
                torch.randint(
                    0, 256, (9, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)
                )
            ]
            outputs = await d.run(Request(task, {"text": text, "seed": i, "images": pictures}))
            images = prepare_toy_images(pictures, model.config) if task == "image_edit" else None
            inputs = make_toy_inputs(text, model.config, i, images)
            want = run_reference(model.graph(), model._nodes, inputs, ToyPlan(), state=task)
            assert_same(outputs, want)
        d.assert_empty()


async def test_many_concurrent_requests_with_random_aborts_leave_nothing_behind() -> None:
    model = ToyModel(seed=1)
    rng = random.Random(0)
    async with Direct(model, PLACEMENTS["spread"]) as d:
        requests = [
            Request(rng.choice(["speech", "image"]), {"text": f"req {i}", "seed": i})
            for i in range(40)
        ]
        runs = [asyncio.ensure_future(d.run(r)) for r in requests]
        aborted = set()
        for _ in range(15):
            await asyncio.sleep(0)
            victim = rng.choice(requests)
            d.execute(d.core.abort(victim.request_id))
            aborted.add(victim.request_id)
        results = await asyncio.gather(*runs, return_exceptions=True)
        for request, result in zip(requests, results, strict=True):
            if isinstance(result, Exception):
                assert isinstance(result, RequestAbortedError) and request.request_id in aborted
            else:
                inputs = make_toy_inputs(request.data["text"], model.config, request.data["seed"])
                assert_same(
                    result,
                    run_reference(
                        model.graph(), model._nodes, inputs, ToyPlan(), state=request.task
                    ),
                )
        for _ in range(10):  # let in-flight releases land
            await asyncio.sleep(0)
        d.assert_empty()


async def test_a_failing_node_fails_only_its_request() -> None:
    model = ToyModel(seed=2)
    vae = model._nodes["vae"]

    def flaky_vae(inputs: Any) -> Any:
        if float(inputs["x"].sum()) > 0:
            raise RuntimeError("decoder exploded")
        return vae(inputs)

    model._nodes["vae"] = flaky_vae
    async with Direct(model, PLACEMENTS["spread"]) as d:
        results = await asyncio.gather(
            *(d.run(Request("image", {"text": "t", "seed": s})) for s in range(8)),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, Exception)]
        assert failures and len(failures) < 8
        for f in failures:
            assert isinstance(f, WalkExecutionError)
            assert (f.node, f.walk) == ("vae", "image_gen")
            assert "decoder exploded" in str(f)
        assert await d.run(Request("speech", {"text": "still serving"}))
        for _ in range(10):
            await asyncio.sleep(0)
        d.assert_empty()


async def test_invalid_requests_are_rejected_at_submit() -> None:
    async with Direct(ToyModel(), PLACEMENTS["colocated"]) as d:
        with pytest.raises(ValueError, match="task must be one of"):
            d.core.submit(Request("sing", {"text": "la"}))
        with pytest.raises(ValueError, match="must be a non-empty string"):
            d.core.submit(Request("speech", {"text": ""}))
        assert d.core.requests == {}
