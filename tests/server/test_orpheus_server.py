"""`orpheus-tiny` served over HTTP: speech streamed to a file with the official `openai`
client, identical to the same request through the native NDJSON endpoint."""

from __future__ import annotations

import base64
import io
import json
import struct
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from mstar.zoo import resolve_model
from tests.server.conftest import RunningServer, running_server

MODEL = "orpheus-tiny"
SAMPLING = {"seed": 7, "temperature": 0.0, "max_tokens": 120}


@pytest.fixture(scope="module")
def orpheus_server() -> Iterator[RunningServer]:
    with running_server(resolve_model(MODEL), names=(MODEL,)) as server:
        yield server


def test_orpheus_speech_streams_to_a_file(orpheus_server: RunningServer, tmp_path: Path) -> None:
    oa = openai.OpenAI(base_url=f"{orpheus_server.url}/v1", api_key="unused", max_retries=0)
    out = tmp_path / "tara.wav"
    with oa.audio.speech.with_streaming_response.create(
        model=MODEL,
        voice="tara",
        input="Hello from mstar.",
        response_format="wav",
        stream_format="audio",
        extra_body=SAMPLING,
    ) as response:
        response.stream_to_file(out)
    streamed = out.read_bytes()
    assert struct.unpack("<I", streamed[40:44])[0] == 0xFFFFFFFF  # length unknown while streaming
    assert struct.unpack("<I", streamed[24:28])[0] == 24_000
    whole = oa.audio.speech.create(
        model=MODEL,
        voice="tara",
        input="Hello from mstar.",
        response_format="wav",
        extra_body=SAMPLING,
    )
    with wave.open(io.BytesIO(whole.content)) as f:
        assert f.getframerate() == 24_000
        pcm = f.readframes(f.getnframes())
    assert len(pcm) > 0 and streamed[44:] == pcm
    with httpx.Client(base_url=orpheus_server.url, timeout=60) as http:
        native = http.post(
            "/generate",
            json={"task": "speech", "text": "Hello from mstar.", "voice": "tara", **SAMPLING},
        )
    lines = [json.loads(line) for line in native.text.splitlines()]
    audio = b"".join(base64.b64decode(ln["data"]) for ln in lines if ln.get("modality") == "audio")
    assert audio == pcm
    orpheus_server.wait_idle()  # the last stream's server side may still be closing
    assert orpheus_server.state.admission.num_running == 0
    assert orpheus_server.metric("mstar_time_to_first_audio_seconds_count") == 3
    assert orpheus_server.metric("mstar_audio_real_time_factor_count") == 3
