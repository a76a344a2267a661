"""The serving quick start's commands, run as written (only the URL and the chat model differ:
a test server on a free port, and a tiny Llama standing in for SmolLM2)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import subprocess
import wave
from pathlib import Path

import pytest
from PIL import Image

from tests.server.conftest import RunningServer

README_URL = "http://127.0.0.1:8000"
README_CHAT_MODEL = "smollm2-135m"

CURL_MODELS = "curl -s http://127.0.0.1:8000/v1/models"
CURL_SPEECH = """curl -s http://127.0.0.1:8000/v1/audio/speech \\
  -H "Content-Type: application/json" \\
  -d '{"model": "toy-composite", "input": "Hello from mstar!", "response_format": "wav", "stream": true}' \\
  -o hello.wav"""  # noqa: E501 (a table or diagram)
CURL_IMAGE = """curl -s http://127.0.0.1:8000/v1/images/generations \\
  -H "Content-Type: application/json" \\
  -d '{"model": "toy-composite", "prompt": "a lighthouse at dusk"}'"""
CURL_EDIT = """curl -s http://127.0.0.1:8000/v1/images/edits -F model=toy-composite \\
  -F image=@photo.png -F prompt="the same lighthouse at night\""""
CURL_GENERATE = """curl -sN http://127.0.0.1:8000/generate \\
  -H "Content-Type: application/json" \\
  -d '{"task": "speech", "text": "Hello from mstar!"}'"""
CURL_CHAT = """curl -sN http://127.0.0.1:8000/v1/chat/completions \\
  -H "Content-Type: application/json" \\
  -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "stream": true}'"""  # noqa: E501 (a table or diagram)
CURL_METRICS = (
    "curl -s http://127.0.0.1:8000/metrics | grep mstar_time_to_first_audio_seconds_count"
)

PYTHON_SPEECH = """
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
with client.audio.speech.with_streaming_response.create(
    model="toy-composite", voice="default", input="Hello from mstar!",
    response_format="wav", stream_format="audio",  # audio is sent as it is produced
) as response:
    response.stream_to_file("hello.wav")
"""
PYTHON_CHAT = """
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
stream = client.chat.completions.create(
    model="smollm2-135m",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=32,
    stream=True,
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
"""


def shell(command: str, server: RunningServer, cwd: Path, model: str | None = None) -> str:
    command = command.replace(README_URL, server.url)
    if model is not None:
        command = command.replace(README_CHAT_MODEL, model)
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def python(snippet: str, server: RunningServer, cwd: Path, model: str | None = None) -> str:
    snippet = snippet.replace(README_URL, server.url)
    if model is not None:
        snippet = snippet.replace(README_CHAT_MODEL, model)
    out = io.StringIO()
    here = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(snippet, "quickstart", "exec"), {})
    finally:
        os.chdir(here)
    return out.getvalue()


def wav_frames(path: Path) -> int:
    data = path.read_bytes()
    with wave.open(io.BytesIO(data)) as f:  # a streamed WAV: read the frames that are there
        return len(f.readframes(10**9)) // 2


@pytest.mark.skipif(
    subprocess.run(["which", "curl"], capture_output=True).returncode != 0, reason="needs curl"
)
def test_curl_examples(
    toy_server: RunningServer, llama_server: RunningServer, tmp_path: Path
) -> None:
    assert json.loads(shell(CURL_MODELS, toy_server, tmp_path))["data"][0]["id"] == "toy-composite"
    shell(CURL_SPEECH, toy_server, tmp_path)
    assert wav_frames(tmp_path / "hello.wav") > 0
    image = json.loads(shell(CURL_IMAGE, toy_server, tmp_path))["data"][0]["b64_json"]
    assert Image.open(io.BytesIO(base64.b64decode(image))).format == "PNG"
    (tmp_path / "photo.png").write_bytes(base64.b64decode(image))
    edited = json.loads(shell(CURL_EDIT, toy_server, tmp_path))["data"][0]["b64_json"]
    assert Image.open(io.BytesIO(base64.b64decode(edited))).format == "PNG"
    lines = [json.loads(line) for line in shell(CURL_GENERATE, toy_server, tmp_path).splitlines()]
    assert any(ln.get("modality") == "audio" for ln in lines) and lines[-1]["finished"]
    events = shell(CURL_CHAT, llama_server, tmp_path, model="tiny-chat").split("\n\n")
    assert events[0].startswith("data: {") and events[-2] == "data: [DONE]"
    assert shell(CURL_METRICS, toy_server, tmp_path).startswith(
        "mstar_time_to_first_audio_seconds_count"
    )


def test_openai_client_examples(
    toy_server: RunningServer, llama_server: RunningServer, tmp_path: Path
) -> None:
    python(PYTHON_SPEECH, toy_server, tmp_path)
    assert wav_frames(tmp_path / "hello.wav") > 0
    tokens = llama_server.metric("mstar_generated_tokens_total")
    python(PYTHON_CHAT, llama_server, tmp_path, model="tiny-chat")  # prints the random model's text
    assert llama_server.metric("mstar_generated_tokens_total") > tokens
