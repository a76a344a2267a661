"""Model capabilities are declared by inheriting a `Supports*` protocol, never inferred from
attributes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar.graph import ModelGraph
from mstar.runtime import (
    EngineType,
    Model,
    PreparedRequest,
    Request,
    SupportsAudioOutput,
    SupportsTextOutput,
    supports_audio_output,
    supports_text_output,
)
from mstar.zoo.llm import TextLLM
from mstar.zoo.noop import NoopLoopModel
from mstar.zoo.orpheus.model import OrpheusModel
from mstar.zoo.toy import ToyModel


class _Bare(Model):
    """The base contract only; every method is a stub (these tests never serve it)."""

    def graph(self) -> ModelGraph:
        raise NotImplementedError

    def engine_types(self) -> dict[str, EngineType]:
        return {}

    def submodule(self, node: str, device: torch.device) -> Any:
        raise KeyError(node)

    def preprocess(self, request: Request) -> PreparedRequest:
        return PreparedRequest({})

    def first_walk(self, partition: str, state: Any) -> str | None:
        return None

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        return None


class _LooksLikeText(_Bare):
    """Has every member of `SupportsTextOutput` but does not declare it."""

    tokenizer = None
    eos_token_ids = (0,)

    def detokenize(self, token_ids: list[int]) -> str:
        return ""


class _LooksLikeAudio(_Bare):
    audio_sample_rate = 8000


class _Text(_Bare, SupportsTextOutput):
    tokenizer = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (2,)

    def detokenize(self, token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))


class _Audio(_Bare, SupportsAudioOutput):
    audio_sample_rate = 8000


def test_declared_capabilities_are_reported() -> None:
    text, audio = _Text(), _Audio()
    assert supports_text_output(text) and not supports_audio_output(text)
    assert supports_audio_output(audio) and not supports_text_output(audio)
    assert text.detokenize([1, 2]) == "1 2" and audio.audio_sample_rate == 8000


def test_matching_attributes_without_the_declaration_are_not_a_capability() -> None:
    assert not supports_text_output(_LooksLikeText())
    assert not supports_audio_output(_LooksLikeAudio())
    assert not supports_text_output(_Bare()) and not supports_audio_output(_Bare())


def test_a_declared_capability_must_be_implemented() -> None:
    class HalfText(_Bare, SupportsTextOutput):  # no detokenize, no eos_token_ids
        tokenizer = None

    with pytest.raises(TypeError, match="abstract"):
        HalfText()  # type: ignore[abstract]


def test_zoo_models_declare_what_they_offer() -> None:
    toy = ToyModel()
    assert supports_audio_output(toy) and toy.audio_sample_rate == 16_000
    assert not supports_text_output(toy)  # its text outputs are toy ids, with no tokenizer
    # Protocols with data members refuse issubclass(), so look for the declaration itself.
    assert (
        SupportsAudioOutput in OrpheusModel.__mro__
        and SupportsTextOutput not in OrpheusModel.__mro__
    )
    assert SupportsTextOutput in TextLLM.__mro__ and SupportsAudioOutput not in TextLLM.__mro__
    assert not supports_text_output(NoopLoopModel()) and not supports_audio_output(NoopLoopModel())
