"""Step times per walk: a mixed batch counts in full under each of its walks."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.engines.stateless import StatelessEngine, StatelessEngineConfig
from mstar.engines.step_times import STEP_TIME_BUCKETS, WalkStepTimes

from .conftest import make_tiny_llama


def test_a_mixed_step_counts_under_every_walk_present() -> None:
    times = WalkStepTimes()
    times.record(0.012, ["decode", "decode", "prefill"])
    times.record(0.0001, ["decode"])
    times.record(99.0, [])  # a step that ran nothing records nothing
    decode, prefill = times.by_walk["decode"], times.by_walk["prefill"]
    assert (decode.steps, decode.inputs, prefill.steps, prefill.inputs) == (2, 3, 1, 1)
    assert decode.seconds == pytest.approx(0.0121) and prefill.seconds == pytest.approx(0.012)
    # buckets: 0.0001 <= 0.0005 (first), 0.012 in (0.01, 0.025]
    assert (
        decode.bucket_counts[0] == 1 and decode.bucket_counts[STEP_TIME_BUCKETS.index(0.025)] == 1
    )
    assert (
        sum(decode.bucket_counts) == 2 and len(decode.bucket_counts) == len(STEP_TIME_BUCKETS) + 1
    )


def test_bounds_are_inclusive_and_the_last_bucket_takes_the_rest() -> None:
    times = WalkStepTimes()
    times.record(STEP_TIME_BUCKETS[3], ["w"])
    times.record(STEP_TIME_BUCKETS[-1] * 2, ["w"])
    counts = times.by_walk["w"].bucket_counts
    assert counts[3] == 1 and counts[-1] == 1 and sum(counts) == 2


def test_decode_only_steps_are_counted_by_rows_with_the_keys_they_attend() -> None:
    """Two prompts (5 and 9 tokens) prefill in one step, then decode three more tokens each in
    two-row steps; a third, alone later, decodes in one-row steps. Prefill steps count apart."""
    engine = KVCacheEngine(
        make_tiny_llama(), KVCacheEngineConfig(block_size=4, num_blocks=32, max_num_seqs=4)
    )
    engine.add_request("a", list(range(1, 6)), SamplingParams.greedy(4))
    engine.add_request("b", list(range(1, 10)), SamplingParams.greedy(4))
    while engine.has_unfinished():
        engine.step()
    stats = engine.runner.phases.snapshot()
    # each decode step's rows attend their context: a (5 tokens) 6, 7, 8; b (9) 10, 11, 12
    assert (stats["decode2_steps"], stats["decode2_keys"]) == (3, 6 + 7 + 8 + 10 + 11 + 12)
    assert stats["decode2_seconds"] > 0 and "decode1_steps" not in stats
    engine.add_request("c", list(range(1, 4)), SamplingParams.greedy(3))
    while engine.has_unfinished():
        engine.step()
    stats = engine.runner.phases.snapshot()
    assert (stats["decode1_steps"], stats["decode1_keys"]) == (2, 4 + 5)
    assert stats["decode2_steps"] == 3


class Echo:
    """A batched node that returns its inputs and records batch sizes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        self.sizes.append(len(batch))
        return [{"y": item["x"]} for item in batch]


async def test_the_stateless_engine_attributes_its_steps_to_walks() -> None:
    node = Echo()
    config = StatelessEngineConfig(max_batch_size=8)
    async with StatelessEngine("codec", node, config) as engine:
        # one batch of 8: five inputs of one walk, three of another
        walks = ["vocode"] * 5 + ["encode"] * 3
        await asyncio.gather(
            *(engine.submit(f"r{i}", {"x": i}, walk) for i, walk in enumerate(walks))
        )
        await engine.submit("alone", {"x": 0}, "encode")
    assert node.sizes == [8, 1]
    vocode, encode = engine.walk_times.by_walk["vocode"], engine.walk_times.by_walk["encode"]
    assert (vocode.steps, vocode.inputs) == (1, 5)
    assert (encode.steps, encode.inputs) == (2, 4)
    # the mixed step counts in full under both walks: their seconds add up to more than the node's
    assert vocode.seconds + encode.seconds > engine.step_seconds >= encode.seconds
