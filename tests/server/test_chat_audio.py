"""Spoken chat answers over HTTP, as OpenAI's audio-output API gives them, from `assistant`.

The real assistant (SmolLM2 + the Piper voice, its noise at 0) behind a real server, asked
through the official `openai` client: the stream's transcript is the text answer, its pcm16
chunks the speech; a whole answer comes as a WAV; bad audio options are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import soxr

from mstar.runtime.model import ModelSpec
from tests.server.conftest import RunningServer, running_server

pytestmark = pytest.mark.slow  # real weights

QUESTION = [{"role": "user", "content": "Why do we need sleep?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 64}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    spec = ModelSpec(
        "mstar.zoo.assistant.model:AssistantModel", {"noise_scale": 0.0, "noise_w_scale": 0.0}
    )
    with running_server(spec, names=("assistant",)) as running:
        yield running


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_a_stream_speaks_its_transcript_while_it_is_written(server: RunningServer) -> None:
    client = _client(server)
    written = client.chat.completions.create(model="assistant", messages=QUESTION, **GREEDY)  # type: ignore[arg-type]
    text = written.choices[0].message.content
    assert text and written.choices[0].message.audio is None  # a text-only chat: no voice
    stream = client.chat.completions.create(
        model="assistant",
        messages=QUESTION,  # type: ignore[arg-type]
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "pcm16"},
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,  # type: ignore[arg-type]
    )
    transcript, pcm, order, rates = [], bytearray(), [], set()
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices or chunk.choices[0].delta.audio is None:
            continue
        audio = chunk.choices[0].delta.audio
        assert audio.id
        if audio.transcript:
            transcript.append(audio.transcript)
            order.append("text")
        if audio.data:
            pcm += base64.b64decode(audio.data)
            rates.add(audio.sample_rate)  # type: ignore[attr-defined]
            order.append("audio")
    assert "".join(transcript) == text
    assert rates == {24_000}  # what OpenAI clients play pcm16 at, not the voice's 22,050 Hz
    seconds = len(pcm) / 2 / 24_000
    assert 0.035 <= seconds / len(text) <= 0.12
    # Speech came before the text was finished: some transcript follows the first audio chunk.
    assert "text" in order[order.index("audio") :], order
    assert usage is not None and usage.completion_tokens == written.usage.completion_tokens  # type: ignore[union-attr]


def test_a_whole_answer_comes_as_a_wav(server: RunningServer) -> None:
    answer = _client(server).chat.completions.create(
        model="assistant",
        messages=QUESTION,  # type: ignore[arg-type]
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "wav"},
        **GREEDY,  # type: ignore[arg-type]
    )
    message = answer.choices[0].message
    assert message.content is None and message.audio is not None and message.audio.transcript
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24_000)
        assert f.getnframes() / 24_000 > 1.0


def _native_speech(server: RunningServer) -> tuple[np.ndarray, int]:
    """The same spoken answer from the native route, at the voice's own rate (int16 samples)."""
    body = {
        "task": "generate",
        "messages": QUESTION,
        "modalities": ["text", "audio"],
        "stream": False,
        **GREEDY,
    }
    answer = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    lines = [json.loads(line) for line in answer.text.splitlines()]
    audio = [line for line in lines if line.get("modality") == "audio"]
    assert len(audio) > 1  # several sentences: the stream has chunk boundaries to get right
    (rate,) = {line["sample_rate"] for line in audio}
    pcm = b"".join(base64.b64decode(line["data"]) for line in audio)
    return np.frombuffer(pcm, "<i2"), rate


def test_the_24_khz_stream_is_the_whole_answer_resampled_at_once(server: RunningServer) -> None:
    native, native_rate = _native_speech(server)
    assert native_rate == 22_050
    stream = _client(server).chat.completions.create(
        model="assistant", messages=QUESTION, modalities=["text", "audio"],  # type: ignore[arg-type]
        audio={"voice": "joe", "format": "pcm16"}, stream=True, **GREEDY,  # type: ignore[arg-type]
    )  # fmt: skip
    pcm = bytearray()
    for chunk in stream:
        if (
            chunk.choices
            and chunk.choices[0].delta.audio is not None
            and chunk.choices[0].delta.audio.data
        ):
            pcm += base64.b64decode(chunk.choices[0].delta.audio.data)
    served = np.frombuffer(bytes(pcm), "<i2").astype(np.float64)
    # The stream holds the answer's duration at 24 kHz, sample for sample.
    assert len(served) == round(len(native) * 24_000 / native_rate)
    whole = soxr.resample(native.astype(np.float32) / 32767.0, native_rate, 24_000, quality="HQ")
    # PCM16 clips the filter's overshoot of a full-scale peak
    whole = np.clip(whole, -1.0, 1.0) * 32767.0
    # Resampled chunk by chunk, continuously: equal to resampling it whole (PCM16 rounding aside),
    # with no click where one sentence's chunk meets the next.
    error = np.abs(served - whole)
    assert error.max() <= 8.0, (int(error.argmax()), float(error.max()))
    assert np.abs(served).max() > 1000


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"modalities": ["audio"]}, "modalities"),
        ({"modalities": ["text", "video"]}, "modalities.1"),
        ({"modalities": ["text", "audio"], "audio": {"format": "mp3"}}, "audio.format"),
        (
            {"modalities": ["text", "audio"], "audio": {"format": "wav"}, "stream": True},
            "audio.format",
        ),
        ({"modalities": ["text", "audio"], "n": 2}, "n"),
    ],
)
def test_bad_audio_options_are_400s_naming_the_field(
    server: RunningServer, extra: dict[str, object], param: str
) -> None:
    body = {"model": "assistant", "messages": QUESTION, **extra}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_model_without_a_voice_says_so(llama_server: RunningServer) -> None:
    body = {"messages": QUESTION, "modalities": ["text", "audio"], "max_tokens": 4}
    answer = httpx.post(f"{llama_server.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "modalities"
    assert "no audio output" in answer.json()["error"]["message"]


def test_log_probabilities_come_with_a_spoken_answer(server: RunningServer) -> None:
    answer = _client(server).chat.completions.create(
        model="assistant",
        messages=QUESTION,  # type: ignore[arg-type]
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "wav"},
        logprobs=True,
        top_logprobs=2,
        **GREEDY,  # type: ignore[arg-type]
    )
    choice = answer.choices[0]
    assert choice.message.audio is not None and choice.logprobs is not None
    content = choice.logprobs.content or []
    # Every sampled token, the end of turn included, carries its log-probability.
    assert (
        "".join(t.token for t in content).removesuffix("<|im_end|>")
        == choice.message.audio.transcript
    )
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


SPOKEN = "Sleep lets the brain rest. It also helps the body heal."


def _native_read(server: RunningServer, **data: object) -> np.ndarray:
    """The speech task from the native route, at the voice's own 22,050 Hz (int16 samples)."""
    answer = httpx.post(
        f"{server.url}/generate", json={"task": "speech", "stream": False, **data}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    audio = [json.loads(line) for line in answer.text.splitlines() if '"audio"' in line]
    assert {line["sample_rate"] for line in audio} == {22_050}
    return np.frombuffer(b"".join(base64.b64decode(line["data"]) for line in audio), "<i2")


def test_the_speech_route_reads_a_text_aloud_at_24_khz(server: RunningServer) -> None:
    client = _client(server)
    native = _native_read(server, text=SPOKEN)
    whole = soxr.resample(native.astype(np.float32) / 32767.0, 22_050, 24_000, quality="HQ")
    whole = np.clip(whole, -1.0, 1.0) * 32767.0
    wav_bytes = client.audio.speech.create(
        model="assistant", voice="default", input=SPOKEN, response_format="wav"
    ).content
    with wave.open(io.BytesIO(wav_bytes)) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24_000)
        samples = np.frombuffer(f.readframes(f.getnframes()), "<i2")
    with client.audio.speech.with_streaming_response.create(
        model="assistant",
        voice="joe",
        input=SPOKEN,
        response_format="pcm",
        stream_format="audio",  # type: ignore[arg-type]
    ) as response:
        streamed = np.frombuffer(b"".join(response.iter_bytes()), "<i2")
    for served in (samples, streamed):
        assert len(served) == round(len(native) * 24_000 / 22_050)
        assert np.abs(served.astype(np.float64) - whole).max() <= 8.0
    # The last user turn of a chat is read as the same text; no voice is the default voice.
    chat = [{"role": "user", "content": "not this"}, {"role": "user", "content": SPOKEN}]
    np.testing.assert_array_equal(_native_read(server, messages=chat), native)
    bad = httpx.post(
        f"{server.url}/v1/audio/speech",
        json={"model": "assistant", "input": "x", "voice": "alloy"},
        timeout=30,
    )
    assert bad.status_code == 400 and "unknown voice" in bad.text


def test_a_realtime_session_gets_a_spoken_answer_and_no_audio_in(server: RunningServer) -> None:
    """The assistant over /v1/realtime: a text turn is answered in speech with its transcript;
    audio input is an error event naming the missing audio encoder."""

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        async with client.realtime.connect(model="assistant") as conn:
            assert (await conn.recv()).session.output_modalities == ["audio"]
            silence = base64.b64encode(bytes(4800)).decode("ascii")
            await conn.input_audio_buffer.append(audio=silence)
            assert (await conn.recv()).error.code == "audio_input_not_supported"
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 24})
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Why do we need sleep?"}],
            }
            await conn.conversation.item.create(item=item)
            async for event in conn:
                if event.type == "conversation.item.done":
                    break
            await conn.response.create()
            events = []
            async for event in conn:
                events.append(event)
                if event.type == "response.done":
                    break
        audio = b"".join(
            base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
        )
        transcript = "".join(
            e.delta for e in events if e.type == "response.output_audio_transcript.delta"
        )
        done = events[-1].response
        assert done.status == "completed" and done.output[0].content[0].transcript == transcript
        assert len(transcript.split()) >= 3 and len(audio) > 24_000  # words, and half a second

    asyncio.run(main())
