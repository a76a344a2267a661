"""Qwen3-Omni's stage pipeline: every request answered in text, then audio, stage by stage."""

from __future__ import annotations

import asyncio

import pytest

from mstar.baselines.qwen3_omni_serving import StagePipeline
from mstar.bench import OutputEvent
from mstar.zoo.qwen3_omni.model import Qwen3OmniModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_stage_pipeline_answers_text_then_audio_in_batches() -> None:
    stage = StagePipeline(Qwen3OmniModel("qwen3-omni-tiny", colocated=True), threads=1)

    async def answer(i: int) -> list[OutputEvent]:
        data = {"text": "Hello there.", "max_tokens": 4, "max_audio_frames": 8, "seed": i}
        return [event async for event in stage.stream(f"concurrency-2-{i}", data)]

    async def main() -> list[list[OutputEvent]]:
        stage.start()
        try:
            return list(await asyncio.gather(answer(0), answer(1)))
        finally:
            stage.close()

    for events in asyncio.run(main()):
        texts = [e for e in events if e.modality == "text"]
        assert 1 <= len(texts) <= 4 and events[: len(texts)] == texts  # all text, then audio
        audio = events[len(texts) :]
        assert [e.modality for e in audio] == ["audio"] and (audio[0].num_samples or 0) > 0
        assert audio[0].sample_rate == 24_000
    stages = [name for name, _, _ in stage.timings]
    assert set(stages) == set(StagePipeline.STAGES)
    assert sum(batch for name, batch, _ in stage.timings if name == "thinker") == 2
