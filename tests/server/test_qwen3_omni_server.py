"""Qwen3-Omni (tiny, random weights) behind a real server, asked through the official `openai`
client.

A spoken chat streams transcript deltas and pcm16 chunks at 24 kHz; `/v1/audio/speech` speaks
its input; audio (`input_audio`) and image (`image_url`) parts reach the model decoded.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.server.conftest import RunningServer, qwen3_omni_tiny_spec, running_server

NAME = "qwen3-omni-tiny"
SETTINGS = {"temperature": 0.0, "max_tokens": 8, "seed": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    spec = qwen3_omni_tiny_spec(tmp_path_factory.mktemp("qwen3_omni") / "tiny", 40)
    with running_server(spec, names=(NAME,)) as running:
        yield running


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _wav(seconds: float, rate: int = 16_000) -> str:
    samples = (np.sin(np.arange(int(rate * seconds)) * 0.05) * 8000).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _png() -> str:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(
        buffer, format="PNG"
    )
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _spoken(client: openai.OpenAI, messages: list[dict[str, object]]) -> tuple[str, bytes]:
    stream = client.chat.completions.create(
        model=NAME,
        messages=messages,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},  # type: ignore[arg-type]
        stream=True,
        **SETTINGS,  # type: ignore[arg-type]
    )
    transcript, pcm, rates = [], bytearray(), set()
    for chunk in stream:
        if not chunk.choices or chunk.choices[0].delta.audio is None:
            continue
        audio = chunk.choices[0].delta.audio
        transcript.append(audio.transcript or "")
        if audio.data:
            pcm += base64.b64decode(audio.data)
            rates.add(audio.sample_rate)  # type: ignore[attr-defined]
    assert rates <= {24_000}
    return "".join(transcript), bytes(pcm)


def test_a_spoken_chat_streams_its_transcript_and_speech(server: RunningServer) -> None:
    client = _client(server)
    question = [{"role": "user", "content": "Tell me something."}]
    written = client.chat.completions.create(model=NAME, messages=question, **SETTINGS)  # type: ignore[arg-type]
    text, pcm = _spoken(client, question)
    assert text == written.choices[0].message.content and text
    assert len(pcm) % 2 == 0 and len(pcm) > 2 * 1920  # at least one codec frame of 24 kHz pcm16


def test_audio_and_image_parts_reach_the_model(server: RunningServer) -> None:
    client = _client(server)
    content = [
        {"type": "input_audio", "input_audio": {"data": _wav(1.0, rate=24_000), "format": "wav"}},
        {"type": "image_url", "image_url": {"url": _png()}},
        {"type": "text", "text": "What is this?"},
    ]
    text, pcm = _spoken(client, [{"role": "user", "content": content}])
    assert len(pcm) > 0
    answer = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], **SETTINGS
    )  # type: ignore[arg-type, list-item]
    assert text == answer.choices[0].message.content
    plain = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is this?"}], **SETTINGS
    )  # type: ignore[arg-type]
    assert (
        answer.choices[0].message.content != plain.choices[0].message.content
    )  # the media changed the answer
    with pytest.raises(openai.BadRequestError, match="not a base64 WAV") as info:
        bad = [
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_audio",
                        "input_audio": {"data": "bm90IGEgd2F2", "format": "wav"},
                    }
                ],
            }
        ]
        client.chat.completions.create(model=NAME, messages=bad, **SETTINGS)  # type: ignore[arg-type]
    assert info.value.body["param"] == "messages.0.content.0"  # type: ignore[index]


def test_speech_endpoint_speaks_its_input(server: RunningServer) -> None:
    response = httpx.post(
        f"{server.url}/v1/audio/speech",
        json={"model": NAME, "input": "Hello you", "voice": "chelsie", "response_format": "wav"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    with wave.open(io.BytesIO(response.content)) as wav:
        assert wav.getframerate() == 24_000 and wav.getnframes() > 0
    bad = httpx.post(
        f"{server.url}/v1/audio/speech",
        json={"model": NAME, "input": "x", "voice": "nobody"},
        timeout=60,
    )
    assert bad.status_code == 400 and "unknown speaker" in bad.text


def _check_greedy_logprobs(content: list[Any], num_top: int) -> None:
    """Each token's logprob is <= 0, its alternatives sorted, and (greedy) it is the top one."""
    assert content
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert entry.logprob <= 0 and len(tops) == num_top and tops == sorted(tops, reverse=True)
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (
            entry.token,
            entry.logprob,
        )


def test_the_thinker_text_comes_with_log_probabilities(server: RunningServer) -> None:
    question = [{"role": "user", "content": "Tell me something."}]
    client = _client(server)
    plain = client.chat.completions.create(model=NAME, messages=question, **SETTINGS)  # type: ignore[arg-type]
    answer = client.chat.completions.create(
        model=NAME,
        messages=question,
        logprobs=True,
        top_logprobs=3,
        **SETTINGS,  # type: ignore[arg-type]
    )
    choice = answer.choices[0]
    assert (
        choice.message.content == plain.choices[0].message.content and choice.logprobs is not None
    )
    _check_greedy_logprobs(choice.logprobs.content or [], 3)
    assert len(choice.logprobs.content or []) == answer.usage.completion_tokens  # type: ignore[union-attr]
    stream = client.chat.completions.create(
        model=NAME,
        messages=question,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        **SETTINGS,  # type: ignore[arg-type]
    )
    streamed = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    _check_greedy_logprobs(streamed, 2)
    assert [t.logprob for t in streamed] == pytest.approx(
        [t.logprob for t in choice.logprobs.content or []], abs=1e-5
    )
    native = httpx.post(
        f"{server.url}/generate",
        json={
            "task": "generate",
            "text": "Tell me something.",
            "modalities": ["text"],
            "logprobs": 2,
            "stream": False,
            **SETTINGS,
        },
        timeout=60,
    )
    assert native.status_code == 200, native.text
    lines = [json.loads(line) for line in native.text.splitlines()]
    tokens = [line["logprobs"] for line in lines if line.get("modality") == "text"]
    assert tokens and all(
        t["logprob"] <= 0 and t["top_token_ids"][0] == t["token_id"] and len(t["top_logprobs"]) == 2
        for t in tokens
    )


@pytest.mark.parametrize("voice", ["default", None])
def test_the_default_voice_speaks_audible_audio(server: RunningServer, voice: str | None) -> None:
    body: dict[str, Any] = {"model": NAME, "input": "Hello you", "response_format": "pcm"}
    if voice is not None:
        body["voice"] = voice
    response = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 200, response.text
    samples = np.frombuffer(response.content, "<i2")
    # not the all-zero PCM16
    assert len(samples) > 0 and np.abs(samples).max() > 0 and samples.std() > 0
