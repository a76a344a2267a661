"""`mstar serve` and `mstar run` as a user runs them: a real server process, clear errors."""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import structlog
import torch
import transformers
from PIL import Image

from mstar.cli import main
from tests.server.models import save_tiny_chat_llama

KEY = "sk-cli-test-8d2f71"
BAD_PLACEMENT = """
model: toy-composite
node_groups:
  - {node_names: [encoder, lm, no_such_node], ranks: [0]}
"""


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """The commands configure logging for the process: put it back after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()


# --- mstar serve -----------------------------------------------------------------------------


def test_serve_refuses_a_public_address_without_a_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MSTAR_API_KEY", raising=False)
    assert main(["serve", "toy-composite", "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "no-such-model"], "unknown model 'no-such-model'"),
        (["serve", "/no/such/checkpoint"], "no checkpoint at '/no/such/checkpoint'"),
        (["serve", "toy-composite", "--config", "/no/such/placement.yaml"], "does not exist"),
        (["serve", "os:system"], "not in the zoo and not allow-listed"),
        (["serve", "os:system", "--allow-model-factory", "mymodels"], "--allow-model-factory"),
    ],
)
def test_serve_explains_bad_arguments(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_serve_explains_a_placement_that_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    placement = tmp_path / "bad.yaml"
    placement.write_text(BAD_PLACEMENT)
    assert (
        main(
            [
                "serve",
                "toy-composite",
                "--config",
                str(placement),
                "--port",
                "0",
                "--log-level",
                "error",
            ]
        )
        == 2
    )
    assert "unknown node 'no_such_node'" in capsys.readouterr().err


def _read_lines(stream: io.TextIOBase, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


def _is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.TransportError:  # not accepting yet, or slow to answer while the model loads
        return False


def test_serve_runs_a_real_deterministic_server_until_interrupted() -> None:
    env = {**os.environ, "MSTAR_API_KEY": KEY}
    command = [sys.executable, "-m", "mstar.cli", "serve", "toy-composite", "--port", "0"]
    proc = subprocess.Popen(
        [*command, "--deterministic"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        url = None
        while url is None:  # the first lines say where it listens (bounded by the get timeout)
            seen.append(lines.get(timeout=90))
            event = json.loads(seen[-1])
            url = event.get("url") if event["event"] == "server_bound" else None
        deadline = time.monotonic() + 90
        while not _is_healthy(url):  # the model loads in the background
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").json()["deterministic"] is True
        assert httpx.post(f"{url}/v1/audio/speech", json={"input": "hi"}).status_code == 401
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        with oa.audio.speech.with_streaming_response.create(
            model="toy-composite",
            voice="alloy",
            input="Hello from the command line",
            response_format="wav",
        ) as response:
            request_id = response.headers["x-request-id"]
            audio = response.read()
        with wave.open(io.BytesIO(audio)) as f:
            assert f.getframerate() == 24_000 and f.getnframes() > 0
        assert "mstar_time_to_first_audio_seconds_count" in httpx.get(f"{url}/metrics").text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=30)  # it ends with the pipe
    while not lines.empty():
        seen.append(lines.get())
    output = "".join(seen)
    assert KEY not in output
    events = [json.loads(line) for line in seen]  # not a terminal: every line is JSON
    mine = {e["event"] for e in events if e.get("request_id") == request_id}
    assert {"request_started", "request_finished"} <= mine
    assert {"model_ready", "engine_stopping", "server_stopped"} <= {e["event"] for e in events}
    (started,) = [e for e in events if e["event"] == "engine_started"]
    assert started["deterministic"] is True  # the startup log says which mode runs


# --- mstar run -------------------------------------------------------------------------------


def test_run_speech_to_wav_and_image_to_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wav_path, png_path = tmp_path / "hello.wav", tmp_path / "picture.png"
    assert (
        main(
            ["run", "toy-composite", "--task", "speech", "--text", "Hello", "--out", str(wav_path)]
        )
        == 0
    )
    with wave.open(str(wav_path)) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (
            1,
            2,
            16_000,
        ) and f.getnframes() > 0
    assert (
        main(
            [
                "run",
                "toy-composite",
                "--task",
                "image",
                "--text",
                "a lighthouse",
                "--param",
                "seed=4",
                "--out",
                str(png_path),
            ]
        )
        == 0
    )
    assert Image.open(png_path).size == (8, 8)
    err = capsys.readouterr().err
    assert f"wrote {wav_path}" in err and f"wrote {png_path}" in err


def test_run_text_goes_to_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_tiny_chat_llama(tmp_path / "llama")
    args = [
        "run",
        str(path),
        "--task",
        "generate",
        "--text",
        "Once upon",
        "--no-chat-template",
        "--param",
        "max_tokens=6",
        "--param",
        "temperature=0",
        "--param",
        "ignore_eos=true",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tokenizer("Once upon")["input_ids"]
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    ids = model.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out == tokenizer.decode(ids[0, len(prompt) :], skip_special_tokens=True) + "\n"


def test_run_explains_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    placement = tmp_path / "bad.yaml"
    placement.write_text(BAD_PLACEMENT)
    no_weights = save_tiny_chat_llama(tmp_path / "no-weights")
    for weights in no_weights.glob("*.safetensors"):
        weights.unlink()
    cases = [
        (["run", "toy-composite", "--task", "dance", "--text", "x"], "has no task 'dance'"),
        (["run", "toy-composite", "--task", "speech", "--text", "x"], "pass --out FILE.wav"),
        (
            ["run", "toy-composite", "--task", "speech", "--text", "x", "--config", str(placement)],
            "unknown node",
        ),
        (["run", "toy-composite", "--task", "speech", "--param", "oops"], "KEY=VALUE"),
        (["run", str(no_weights), "--task", "generate", "--text", "x"], "no-weights"),
    ]
    for args, message in cases:
        code = main(args)
        err = capsys.readouterr().err
        assert code in (1, 2) and message in err, (args, err)
