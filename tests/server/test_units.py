"""The server's pure parts: audio and image encodings, detokenizing, stop strings, admission,
redaction, settings and request validation."""

from __future__ import annotations

import asyncio
import io
import json
import struct
import wave

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from pydantic import ValidationError

from mstar.errors import OverloadedError, ServerConfigError
from mstar.server import (
    AdmissionLimits,
    AdmissionQueue,
    IncrementalDetokenizer,
    SecretRedactor,
    ServerConfig,
    StopStringMatcher,
    is_loopback,
    pcm16_bytes,
    png_bytes,
    wav_header,
)
from mstar.server.protocol import ChatCompletionRequest, SpeechRequest
from tests.server.models import make_byte_tokenizer

# --- audio -----------------------------------------------------------------------------------


def test_pcm16_scales_rounds_and_clips() -> None:
    pcm = pcm16_bytes(torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0]))
    assert struct.unpack("<7h", pcm) == (0, 16384, -16384, 32767, -32767, 32767, -32767)


def test_whole_wav_is_readable_by_the_wave_module() -> None:
    samples = torch.sin(torch.arange(1000, dtype=torch.float32) / 10)
    pcm = pcm16_bytes(samples)
    with wave.open(io.BytesIO(wav_header(22_050, num_data_bytes=len(pcm)) + pcm)) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()) == (
            1,
            2,
            22_050,
            1000,
        )
        assert f.readframes(1000) == pcm


def test_streaming_wav_header_marks_the_length_unknown() -> None:
    header = wav_header(24_000)
    assert len(header) == 44 and header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", header[4:8])[0] == 0xFFFFFFFF
    assert header[36:40] == b"data" and struct.unpack("<I", header[40:44])[0] == 0xFFFFFFFF
    assert struct.unpack("<HHIIHH", header[20:36]) == (1, 1, 24_000, 48_000, 2, 16)
    with pytest.raises(ValueError, match="whole number"):
        wav_header(24_000, num_data_bytes=3)


# --- images ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5, 7), (5, 7, 3), (5, 7, 4)])
def test_png_round_trips(shape: tuple[int, ...]) -> None:
    image = torch.randint(0, 256, shape, dtype=torch.uint8)
    decoded = np.asarray(Image.open(io.BytesIO(png_bytes(image))))
    assert decoded.shape == shape and np.array_equal(decoded, image.numpy())


def test_png_refuses_what_is_not_an_image() -> None:
    with pytest.raises(ValueError, match="uint8"):
        png_bytes(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="shape"):
        png_bytes(torch.zeros(4, 4, 2, dtype=torch.uint8))


# --- detokenizing and stop strings -----------------------------------------------------------

TOKENIZER = make_byte_tokenizer()


def _decode(ids: list[int]) -> str:
    return str(TOKENIZER.decode(ids, skip_special_tokens=True))


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(max_size=40),
    specials=st.lists(st.integers(256, 258), max_size=3),
    cuts=st.lists(st.integers(1, 4), min_size=1, max_size=30),
)
def test_incremental_text_equals_decoding_everything(
    text: str, specials: list[int], cuts: list[int]
) -> None:
    ids = list(TOKENIZER(text, add_special_tokens=False)["input_ids"]) + specials
    detok = IncrementalDetokenizer(_decode)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        step = cuts[k % len(cuts)]
        deltas.append(detok.add(ids[i : i + step]))
        i, k = i + step, k + 1
    deltas.append(detok.flush())
    assert "".join(deltas) == _decode(ids)
    # Deltas never end inside a character: only the final flush may hold U+FFFD at its end.
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_multibyte_characters_wait_for_their_last_byte() -> None:
    detok = IncrementalDetokenizer(_decode)
    euro = list("€".encode())
    assert detok.add([ord("a")]) == "a"
    assert detok.add(euro[:1]) == ""
    assert detok.add(euro[1:2]) == ""
    assert detok.add(euro[2:]) == "€"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=10),
)
def test_stop_strings_cut_at_the_first_match(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopStringMatcher(stops)
    out, i, k = [], 0, 0
    while i < len(text):
        step = cuts[k % len(cuts)]
        out.append(matcher.feed(text[i : i + step]))
        i, k = i + step, k + 1
    out.append(matcher.flush())
    hits = [j for j in (text.find(s) for s in stops) if j >= 0]
    assert "".join(out) == (text[: min(hits)] if hits else text)
    assert matcher.is_stopped == bool(hits)


# --- admission -------------------------------------------------------------------------------


async def test_admission_runs_queues_in_order_then_refuses() -> None:
    queue = AdmissionQueue(AdmissionLimits(max_running=1, max_waiting=2, retry_after_s=7))
    await queue.acquire()
    order: list[int] = []

    async def wait(i: int) -> None:
        await queue.acquire()
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(2)]
    await asyncio.sleep(0)  # let both enter the line (no sequencing depends on timing)
    assert (queue.num_running, queue.num_waiting) == (1, 2)
    with pytest.raises(OverloadedError) as refused:
        await queue.acquire()
    assert refused.value.retry_after_s == 7
    queue.release()
    await waiters[0]
    queue.release()
    await waiters[1]
    assert order == [0, 1] and (queue.num_running, queue.num_waiting) == (1, 0)
    queue.release()
    assert queue.num_running == 0


async def test_a_cancelled_waiter_gives_up_its_place() -> None:
    queue = AdmissionQueue(AdmissionLimits(max_running=1, max_waiting=1))
    await queue.acquire()
    waiter = asyncio.create_task(queue.acquire())
    await asyncio.sleep(0)
    assert queue.num_waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert queue.num_waiting == 0
    queue.release()
    assert queue.num_running == 0


def test_admission_limits_are_checked() -> None:
    with pytest.raises(ServerConfigError, match="max_running"):
        AdmissionLimits(max_running=0)
    with pytest.raises(ServerConfigError, match="max_waiting"):
        AdmissionLimits(max_waiting=-1)


# --- secure defaults, redaction --------------------------------------------------------------


def test_only_loopback_binds_without_an_api_key() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert (
        not is_loopback("0.0.0.0")
        and not is_loopback("example.com")
        and not is_loopback("10.1.2.3")
    )
    assert ServerConfig().host == "127.0.0.1"
    with pytest.raises(ServerConfigError, match="--api-key"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", api_key="k").api_key == "k"
    assert "k3y" not in repr(ServerConfig(api_key="k3y"))


def test_redactor_removes_keys_bearers_and_configured_secrets() -> None:
    redact = SecretRedactor(["s3cr3t-value"])
    event = {
        "event": "calling with Bearer abc.def and s3cr3t-value inside",
        "authorization": "Bearer xyz",
        "api_key": "whatever",
        "headers": {"Authorization": "Bearer q", "accept": "json"},
        "completion_tokens": 5,
        "args": ["s3cr3t-value", 3],
    }
    out = redact(None, "info", dict(event))
    rendered = json.dumps(out)
    for secret in ("abc.def", "xyz", "whatever", "Bearer q", "s3cr3t-value"):
        assert secret not in rendered
    assert out["completion_tokens"] == 5 and out["headers"]["accept"] == "json"


# --- request validation ----------------------------------------------------------------------


def test_validation_names_the_field() -> None:
    with pytest.raises(ValidationError) as bad:
        ChatCompletionRequest.model_validate({"messages": [{"role": "robot", "content": "x"}]})
    assert bad.value.errors()[0]["loc"] == ("messages", 0, "role")
    with pytest.raises(ValidationError, match="less than or equal to 16"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "n": 17}
        )
    with pytest.raises(ValidationError, match=r"speed must be in \[0.25, 4.0\]"):
        SpeechRequest.model_validate({"input": "x", "speed": 4.5})
    assert SpeechRequest.model_validate({"input": "x", "speed": 2.0}).model_data() == {
        "text": "x",
        "speed": 2.0,
    }
    assert "speed" not in SpeechRequest.model_validate({"input": "x"}).model_data()
