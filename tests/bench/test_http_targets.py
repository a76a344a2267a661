"""HTTP targets against a real server on 127.0.0.1 streaming synthetic outputs of known size."""

from __future__ import annotations

import time
from typing import Any

import pytest

from mstar.bench.http_targets import ChatTarget, GenerateTarget, ImagesTarget, SpeechTarget
from mstar.bench.metrics import (
    audio_duration,
    image_latencies,
    inter_token_latencies,
    job_completion_time,
    num_output_tokens,
    time_to_first_audio,
    time_to_first_token,
)
from mstar.bench.records import BenchRequest, RequestRecord
from mstar.bench.runner import time_request
from mstar.bench.targets import Target
from mstar.errors import BenchConfigError, BenchTargetError
from tests.bench.synthetic_server import FIRST_DELAY_S, IMAGE_BYTES

Server = tuple[str, list[tuple[str, Any]]]


async def send(target: Target, request: BenchRequest) -> RequestRecord:
    async with target:
        return await time_request(target, request, time.perf_counter())


def body_for(server: Server, prompt_field: str, prompt: str) -> dict[str, Any]:
    """The body the server received for the request with this prompt."""
    matches = [b for _, b in server[1] if prompt in str(b.get(prompt_field, b))]
    assert len(matches) == 1
    return matches[0]


def audio_samples(record: RequestRecord) -> tuple[int, set[int]]:
    chunks = [e for e in record.events if e.modality == "audio"]
    return sum(e.num_samples for e in chunks), {e.sample_rate for e in chunks}


async def test_speech_pcm_counts_samples_and_stamps_from_send(synthetic_server: Server) -> None:
    url, _ = synthetic_server
    target = SpeechTarget(url, model="orpheus", voice="tara", extra_body={"speed": 1.0})
    request = BenchRequest("s1", "speech pcm", max_tokens=64, ignore_eos=True)
    record = await send(target, request)
    assert record.error is None
    assert audio_samples(record) == (2400 + 4800 + 2400, {24_000})
    assert audio_duration(record) == 9600 / 24_000
    ttfa = time_to_first_audio(record)
    assert ttfa is not None and ttfa >= FIRST_DELAY_S  # timed from the send, not the first byte
    assert record.e2e_s >= record.events[-1].time_s
    body = body_for(synthetic_server, "input", "speech pcm")
    assert body == {
        "input": "speech pcm",
        "voice": "tara",
        "response_format": "pcm",
        "stream": True,
        "model": "orpheus",
        "max_tokens": 64,
        "ignore_eos": True,
        "speed": 1.0,
    }


async def test_speech_pcm_split_off_frame_boundaries(synthetic_server: Server) -> None:
    url, _ = synthetic_server
    request = BenchRequest(
        "s2", "speech split", params={"test_split": True, "test_chunks": [1001, 7]}
    )
    record = await send(SpeechTarget(url), request)
    assert record.error is None
    assert audio_samples(record)[0] == 1008


async def test_speech_pcm_ending_inside_a_frame_fails_the_request(synthetic_server: Server) -> None:
    url, _ = synthetic_server
    request = BenchRequest("s3", "speech truncated", params={"test_truncate": True})
    record = await send(SpeechTarget(url), request)
    assert record.error is not None and "into a frame" in record.error


async def test_speech_wav_reads_the_rate_from_the_header(synthetic_server: Server) -> None:
    url, _ = synthetic_server
    target = SpeechTarget(url, response_format="wav", sample_rate=24_000)
    record = await send(target, BenchRequest("s4", "speech wav", params={"test_split": True}))
    assert record.error is None
    assert audio_samples(record) == (9600, {16_000})
    assert audio_duration(record) == 9600 / 16_000


def test_speech_rejects_formats_it_cannot_count() -> None:
    with pytest.raises(BenchConfigError, match="pcm"):
        SpeechTarget("http://127.0.0.1:1", response_format="mp3")
    with pytest.raises(BenchConfigError, match="http"):
        ChatTarget("127.0.0.1:8000")


async def test_chat_sse_counts_deltas_and_takes_usage(synthetic_server: Server) -> None:
    url, _ = synthetic_server
    request = BenchRequest("c1", "chat five", max_tokens=5, ignore_eos=True)
    record = await send(ChatTarget(url, model="llm"), request)
    assert record.error is None
    text = [e for e in record.events if e.modality == "text"]
    assert len(text) == 5  # the empty role delta is not a token
    assert [e.num_bytes for e in text] == [3, 3, 3, 3, 3]
    assert record.usage is not None and (
        record.usage.num_output_tokens,
        record.usage.num_prompt_tokens,
    ) == (5, 7)
    assert num_output_tokens(record) == 5
    assert len(inter_token_latencies(record)) == 4
    ttft = time_to_first_token(record)
    assert ttft is not None and ttft >= FIRST_DELAY_S
    body = body_for(synthetic_server, "messages", "chat five")
    assert body["messages"] == [{"role": "user", "content": "chat five"}]
    assert (body["stream"], body["stream_options"], body["max_tokens"], body["ignore_eos"]) == (
        True,
        {"include_usage": True},
        5,
        True,
    )
    assert body["model"] == "llm"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"test_status": 503}, "HTTP 503"),
        ({"test_stream_error": True}, "engine died"),
        ({"test_no_done": True}, "without `data: [DONE]`"),
    ],
)
async def test_chat_failures_fail_the_request(
    synthetic_server: Server, params: dict[str, Any], message: str
) -> None:
    url, _ = synthetic_server
    record = await send(ChatTarget(url), BenchRequest("c2", f"chat fail {params}", params=params))
    assert record.error is not None and message in record.error
    assert record.error.startswith("BenchTargetError")


async def test_images_give_one_latency_per_image(synthetic_server: Server) -> None:
    url, _ = synthetic_server
    record = await send(ImagesTarget(url, n=3, size="64x64"), BenchRequest("i1", "three images"))
    assert record.error is None
    latencies = image_latencies(record)
    assert len(latencies) == 3 and min(latencies) >= FIRST_DELAY_S
    assert [e.num_bytes for e in record.events] == [len(IMAGE_BYTES)] * 3
    body = body_for(synthetic_server, "prompt", "three images")
    assert (body["n"], body["size"], body["response_format"]) == (3, "64x64", "b64_json")


async def test_generate_ndjson_reads_every_modality(synthetic_server: Server) -> None:
    url, _ = synthetic_server
    record = await send(GenerateTarget(url), BenchRequest("g1", "native", max_tokens=5))
    assert record.error is None
    assert [e.modality for e in record.events] == ["text", "audio", "audio", "action", "action"]
    assert record.events[0].num_tokens == 3
    assert audio_samples(record) == (1600 + 800, {16_000})
    assert num_output_tokens(record) == 5  # from the usage line
    jct = job_completion_time(record)
    assert jct is not None and jct == record.events[-1].time_s
    assert body_for(synthetic_server, "prompt", "native") == {"prompt": "native", "max_tokens": 5}


async def test_a_closed_server_fails_requests_without_crashing() -> None:
    record = await send(ChatTarget("http://127.0.0.1:9", timeout_s=5), BenchRequest("x", "nobody"))
    assert record.error is not None and "ConnectError" in record.error


async def test_a_target_used_outside_async_with_raises() -> None:
    target = ChatTarget("http://127.0.0.1:9")
    with pytest.raises(BenchTargetError, match="async with"):
        await target.stream(BenchRequest("x", "y")).__anext__()
