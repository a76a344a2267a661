"""A new composite model as its author writes it, served by mstar with no glue.

`HumModel` speaks text as tones: a text encoder (UTF-8 bytes as tokens) and a tiny Llama on the
paged KV cache, whose tokens stream in chunks of 4 to a vocoder that turns each into a tone;
its ``speech`` task declares options of its own (`HumOptions`: the voice's pitch and the
speed). The model parses nothing (generation settings and options reach ``preprocess``
typed), checks no length (the engine's published limits do) and is probed for nothing (it
declares `SupportsAudioOutput`). The tests call it through the real `openai` client.

The model's part of this file (graph, nodes, model: `HumOptions` to `HumModel.next_walk`) is
85 lines, against Orpheus's serving part (`mstar.zoo.orpheus.model`, `make_orpheus_graph` to
`OrpheusModel.next_walk`, docstrings included) at 179.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import numpy as np
import openai
import pytest
import torch
from msgspec import Meta

from mstar.engines import KVCacheEngineConfig
from mstar.engines.interfaces import KVTurn
from mstar.graph import (
    EMIT,
    Connection,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    ModelGraph,
    StreamingGraphEdge,
)
from mstar.runtime import ModelSpec
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request, SupportsAudioOutput
from mstar.runtime.params import TaskOptions
from mstar.streaming import FixedChunkPolicy
from mstar.zoo.llm import history_turn
from mstar.zoo.requests import speech_text
from tests.engines.conftest import make_tiny_llama
from tests.server.conftest import running_server

# -- the model -------------------------------------------------------------------------------


class HumOptions(TaskOptions, frozen=True):
    """What a ``speech`` request may ask of the voice."""

    voice: Literal["low", "high"] = "low"
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0


def hum_graph() -> ModelGraph:
    lm = GraphNode(
        "lm",
        {"history", "params"},
        [GraphEdge("lm", "history", persist=True), StreamingGraphEdge("vocoder", "tokens")],
        signals={"stop"},
    )
    vocoder = GraphNode("vocoder", {"tokens", "tone"}, [GraphEdge(EMIT, "audio", modality="audio")])
    return ModelGraph(
        name="hum",
        walks={"prefill": lm, "decode": DynamicLoop(lm, stop="stop"), "vocode": vocoder},
        partitions={"LM": ["prefill", "decode"], "Voice": ["vocode"]},
        connections=[Connection("LM", "Voice", "tokens", FixedChunkPolicy(4))],
        inputs={"lm": {"history", "params"}, "vocoder": {"tone"}},
    )


class LMNode:
    """A token walk over the request's history (the engine samples and stops)."""

    def __init__(self, model: Any, engine_config: KVCacheEngineConfig) -> None:
        self.model, self.engine_config = model, engine_config

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        return history_turn(inputs, is_first)

    def outputs(
        self, request_id: str, token_id: int, history: list[int] | None
    ) -> Mapping[str, Any]:
        if history is None:
            return {"tokens": token_id, "stop": False}
        return {"tokens": token_id, "stop": True, "history": torch.tensor(history)}


def vocoder(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Each new token of a chunk as a tone: pitch by token and voice, length by speed."""
    out = []
    for x in batch:
        base, samples = x["tone"]["base"], int(x["tone"]["samples"])
        t = np.arange(samples) / HumModel.audio_sample_rate
        tones = [
            0.3 * np.sin(2 * np.pi * base * (1 + tok / 64) * t) for tok in x["tokens"].new_items
        ]
        out.append({"audio": np.concatenate(tones or [np.zeros(0)]).astype(np.float32)})
    return out


class HumModel(Model, SupportsAudioOutput):
    name = "hum"
    audio_sample_rate = 16_000

    def __init__(self) -> None:
        self.engine_config = KVCacheEngineConfig(max_model_len=128, num_blocks=64, block_size=16)

    def graph(self) -> ModelGraph:
        return hum_graph()

    def engine_types(self) -> dict[str, EngineType]:
        return {"lm": EngineType.KV_CACHE, "vocoder": EngineType.STATELESS}

    def tasks(self) -> tuple[str, ...]:
        return ("speech",)

    def task_options(self, task: str) -> type[HumOptions]:
        return HumOptions

    def submodule(self, node: str, device: torch.device) -> Any:
        return (
            LMNode(make_tiny_llama(seed=7).to(device), self.engine_config)
            if node == "lm"
            else vocoder
        )

    def preprocess(self, request: Request) -> PreparedRequest:
        options = request.options_as(HumOptions)
        prompt = [1, *(b % 62 + 2 for b in speech_text(request.data).encode())]
        params = request.params.with_defaults({"temperature": 0.0})
        sampling = params.sampling(
            max_tokens=params.max_tokens or 16, stop_token_ids=(0,), prompt_len=len(prompt)
        )
        tone = {"base": 220.0 if options.voice == "low" else 440.0, "samples": 800 / options.speed}
        return PreparedRequest(
            {"lm": {"history": torch.tensor(prompt), "params": sampling}, "vocoder": {"tone": tone}}
        )

    def first_walk(self, partition: str, state: Any) -> str | None:
        return "prefill" if partition == "LM" else "vocode"

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        return ("decode" if finished == "prefill" else None) if partition == "LM" else "vocode"


# -- served, through the real client ---------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Any:
    with running_server(
        ModelSpec("tests.runtime.test_model_author:HumModel", {}), names=("hum",)
    ) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _speak(client: Any, **kwargs: Any) -> np.ndarray:
    kwargs.setdefault("voice", "low")
    reply = client.audio.speech.create(model="hum", input=kwargs.pop("input", "hello"), **kwargs)
    with wave.open(io.BytesIO(reply.content)) as wav:
        assert wav.getframerate() == 24_000 and wav.getnchannels() == 1
        return np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16)


def test_the_options_and_settings_reach_the_model_typed(client: Any) -> None:
    low = _speak(client, voice="low", extra_body={"max_tokens": 6, "ignore_eos": True})
    # 6 tones, resampled to 24 kHz
    assert low.size == pytest.approx(6 * 800 * 24_000 / 16_000, abs=48)
    fast = _speak(client, voice="low", speed=2.0, extra_body={"max_tokens": 6, "ignore_eos": True})
    assert fast.size == pytest.approx(low.size / 2, abs=48)
    high = _speak(client, voice="high", extra_body={"max_tokens": 6, "ignore_eos": True})
    assert high.size == low.size and not np.array_equal(high, low)
    # Greedy by the model's default: the same request, the same audio.
    assert np.array_equal(
        _speak(client, voice="low", extra_body={"max_tokens": 6, "ignore_eos": True}), low
    )


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"voice": "shout"}, "voice", "must be one of 'high', 'low'"),
        ({"speed": 9.0}, "speed", "speed"),
        ({"extra_body": {"max_tokens": 500}}, "max_tokens", "128"),  # the engine's published limit
        ({"extra_body": {"temperature": -1}}, "temperature", "temperature"),
    ],
)
def test_bad_requests_name_their_field(
    client: Any, kwargs: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        _speak(client, **kwargs)
    body = error.value.body
    assert isinstance(body, dict) and body.get("param") in (param, f"data.{param}"), body
    assert words in str(body.get("message")), body
