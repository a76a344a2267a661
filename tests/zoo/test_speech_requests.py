"""A speech task reads ``messages`` as well as ``text``, and "default" (or no voice) is the model's
own voice.

Each speaking tiny model, seeded, in the embedded `AsyncEngine`: the last user turn of a chat
is spoken exactly as the same words sent as ``text``; ``voice: "default"`` and no voice speak
exactly as the model's default voice named.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mstar.runtime import AsyncEngine, EngineConfig, Request
from mstar.zoo import resolve_model
from mstar.zoo.orpheus.tokens import DEFAULT_VOICE
from mstar.zoo.qwen3_omni.config import get_qwen3_omni_config
from mstar.zoo.requests import speech_text

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TEXT = "hello there"
CHAT = [
    {"role": "system", "content": "You read aloud."},
    {"role": "user", "content": "not this one"},
    {"role": "assistant", "content": "ok"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}],
    },
]
# (model, its default voice by name, settings that make a request deterministic)
MODELS = [
    ("toy-composite", None, {"seed": 1}),
    ("orpheus-tiny", DEFAULT_VOICE, {"seed": 1, "max_tokens": 42}),
    (
        "qwen3-omni-tiny",
        get_qwen3_omni_config("qwen3-omni-tiny").speaker,
        {"seed": 1, "max_audio_frames": 20},
    ),
]


def test_speech_text_is_the_text_or_the_last_user_turn() -> None:
    assert speech_text({"text": TEXT}) == speech_text({"messages": CHAT}) == TEXT
    for bad, message in (
        ({}, "needs text"),
        ({"messages": [{"role": "system", "content": "x"}]}, "no user turn"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "no text to speak"),
        ({"messages": "hello"}, "list of"),
    ):
        with pytest.raises(ValueError, match=message):
            speech_text(bad)


def _audio(outputs: list[Any]) -> np.ndarray:
    pieces = [
        torch.as_tensor(np.asarray(o.data)).reshape(-1) for o in outputs if o.modality == "audio"
    ]
    assert pieces, "no audio"
    return torch.cat(pieces).numpy()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "voice", "settings"), MODELS, ids=[m[0] for m in MODELS])
async def test_messages_and_the_default_voice_speak_as_text_and_the_named_voice(
    name: str, voice: str | None, settings: dict[str, Any]
) -> None:
    kwargs = {"colocated": True} if name == "qwen3-omni-tiny" else {}
    async with await AsyncEngine.start(
        resolve_model(name, **kwargs), config=EngineConfig(worker_processes=False)
    ) as engine:

        async def speak(**data: Any) -> np.ndarray:
            return _audio(await engine.run(Request("speech", {**settings, **data})))

        reference = await speak(text=TEXT)
        assert np.abs(reference).max() > 0
        np.testing.assert_array_equal(await speak(messages=CHAT), reference)
        np.testing.assert_array_equal(await speak(text=TEXT, voice="default"), reference)
        if voice is not None:
            np.testing.assert_array_equal(await speak(text=TEXT, voice=voice), reference)
