"""The OpenAI-compatible and native APIs against `toy-composite` (speech and image tasks),
with the official `openai` client, httpx, and the benchmark harness's own targets."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import wave
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soxr
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from mstar.bench.audio import WavStreamReader
from mstar.bench.http_targets import GenerateTarget, ImagesTarget, SpeechTarget
from mstar.bench.records import BenchRequest, OutputEvent, Usage
from mstar.runtime import EngineConfig, ModelSpec
from mstar.runtime.engine_config import EngineStats
from mstar.server.metrics import ServerMetrics
from tests.server.conftest import RunningServer, running_server

MODEL = "toy-composite"
RATE = 16_000  # the toy vocoder's sample rate (the native route's)
SERVED_RATE = 24_000  # what the OpenAI routes serve every model at (resampled)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def whole_wav(server: RunningServer, text: str) -> tuple[int, bytes]:
    audio = client(server).audio.speech.create(
        model=MODEL, voice="alloy", input=text, response_format="wav"
    )
    with wave.open(io.BytesIO(audio.content)) as f:
        assert (f.getnchannels(), f.getsampwidth()) == (1, 2)
        return f.getframerate(), f.readframes(f.getnframes())


def test_speed_is_refused_by_a_model_that_declares_no_speed(toy_server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client(toy_server).audio.speech.create(model=MODEL, voice="alloy", input="hi", speed=1.5)
    assert isinstance(bad.value.body, dict) and bad.value.body["param"] == "speed"
    assert "speaks at speed 1.0 only" in bad.value.body["message"]


def test_models_lists_the_one_served_model(toy_server: RunningServer) -> None:
    models = client(toy_server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(toy_server).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(toy_server).models.retrieve("gpt-4o")


def test_speech_as_a_whole_wav_file(toy_server: RunningServer) -> None:
    rate, pcm = whole_wav(toy_server, "Hello from mstar")
    assert rate == SERVED_RATE
    samples = np.frombuffer(pcm, "<i2")
    assert len(samples) > 0 and np.abs(samples).max() > 1000  # the toy speaks sines at 0.3


def test_speech_streamed_to_a_file_with_the_openai_client(
    toy_server: RunningServer, tmp_path: Path
) -> None:
    out = tmp_path / "speech.wav"
    finished_before = toy_server.metric("mstar_time_to_first_audio_seconds_count")
    with client(toy_server).audio.speech.with_streaming_response.create(
        model=MODEL,
        voice="alloy",
        input="Hello from mstar",
        response_format="wav",
        stream_format="audio",
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        response.stream_to_file(out)
    data = out.read_bytes()
    # A streaming WAV: the sizes are the "unknown length" placeholder, then the samples.
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    reader = WavStreamReader()
    frames = reader.feed(data)
    reader.finish()
    assert reader.format is not None and reader.format.sample_rate == SERVED_RATE
    _, whole = whole_wav(toy_server, "Hello from mstar")
    assert data[44:] == whole and frames == len(whole) // 2
    assert toy_server.metric("mstar_time_to_first_audio_seconds_count") > finished_before


def test_speech_as_raw_pcm_and_as_server_sent_events(toy_server: RunningServer) -> None:
    _, whole = whole_wav(toy_server, "pcm please")
    with httpx.Client(base_url=toy_server.url) as http:
        pcm = http.post(
            "/v1/audio/speech",
            json={"input": "pcm please", "response_format": "pcm", "stream": True},
        )
        assert pcm.status_code == 200 and pcm.headers["x-sample-rate"] == str(SERVED_RATE)
        assert pcm.content == whole
        events = http.post(
            "/v1/audio/speech",
            json={"input": "pcm please", "response_format": "pcm", "stream_format": "sse"},
        )
    payloads = [
        json.loads(line[6:]) for line in events.text.splitlines() if line.startswith("data: ")
    ]
    deltas = [p for p in payloads if p["type"] == "speech.audio.delta"]
    assert b"".join(base64.b64decode(p["audio"]) for p in deltas) == whole
    assert payloads[-1] == {
        "type": "speech.audio.done",
        "usage": {"num_samples": len(whole) // 2, "sample_rate": SERVED_RATE},
    }


def test_images_as_base64_png(toy_server: RunningServer) -> None:
    result = client(toy_server).images.generate(
        model=MODEL, prompt="a lighthouse", n=2, response_format="b64_json"
    )
    assert len(result.data) == 2
    for image in result.data:
        assert image.b64_json is not None
        decoded = Image.open(io.BytesIO(base64.b64decode(image.b64_json)))
        assert decoded.format == "PNG" and decoded.size == (8, 8)
    with pytest.raises(openai.BadRequestError, match="8x8"):
        client(toy_server).images.generate(model=MODEL, prompt="a lighthouse", size="512x512")


def test_native_generate_streams_every_modality_as_ndjson(toy_server: RunningServer) -> None:
    _, whole = whole_wav(toy_server, "native")
    with httpx.Client(base_url=toy_server.url) as http:
        speech = http.post("/generate", json={"task": "speech", "data": {"text": "native"}})
        image = http.post("/generate", json={"task": "image", "text": "native", "seed": 3})
    assert speech.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in speech.text.splitlines()]
    audio = [ln for ln in lines if ln.get("modality") == "audio"]
    text = [ln for ln in lines if ln.get("modality") == "text"]
    native = np.frombuffer(b"".join(base64.b64decode(a["data"]) for a in audio), "<i2")
    assert sum(a["num_samples"] for a in audio) == len(native) and {
        a["sample_rate"] for a in audio
    } == {RATE}
    # The OpenAI route's answer is the native one at 24 kHz: as long, and the same sound.
    served = np.frombuffer(whole, "<i2")
    assert len(served) == len(native) * SERVED_RATE // RATE
    resampled = (
        soxr.resample(native.astype(np.float32) / 32767.0, RATE, SERVED_RATE, quality="HQ")
        * 32767.0
    )
    assert np.abs(served - resampled).max() <= 8.0
    assert lines[-1] == {
        "usage": {"completion_tokens": sum(t["num_tokens"] for t in text)},
        "finished": True,
    }
    image_lines = [json.loads(line) for line in image.text.splitlines()]
    png = next(ln for ln in image_lines if ln.get("modality") == "image")
    assert (
        Image.open(io.BytesIO(base64.b64decode(png["data"]))).size
        == (png["width"], png["height"])
        == (8, 8)
    )
    latent = next(ln for ln in image_lines if ln.get("modality") == "latent")
    norms = np.frombuffer(base64.b64decode(latent["data"]), latent["dtype"]).reshape(
        latent["shape"]
    )
    assert latent["shape"] == [6] and np.all(norms > 0)  # one norm per flow step


def test_the_benchmark_harness_reads_this_server(toy_server: RunningServer) -> None:
    """The harness's targets (written against the formats) parse what the server sends."""
    _, whole = whole_wav(toy_server, "bench me")

    async def run() -> tuple[list[object], list[object], list[object]]:
        request = BenchRequest("r1", "bench me")
        async with GenerateTarget(
            toy_server.url, sample_rate=RATE, extra_body={"task": "speech", "stream": True}
        ) as gen:
            native = [e async for e in gen.stream(request)]
        async with SpeechTarget(toy_server.url, response_format="wav", model=MODEL) as speech:
            spoken = [e async for e in speech.stream(request)]
        async with ImagesTarget(toy_server.url, model=MODEL, n=2) as images:
            pictures = [e async for e in images.stream(request)]
        return native, spoken, pictures

    native, spoken, pictures = asyncio.run(run())
    native_samples = sum(
        e.num_samples for e in native if isinstance(e, OutputEvent) and e.modality == "audio"
    )
    spoken_samples = sum(e.num_samples for e in spoken if isinstance(e, OutputEvent))
    assert spoken_samples == len(whole) // 2 == native_samples * SERVED_RATE // RATE
    tokens = sum(
        e.num_tokens for e in native if isinstance(e, OutputEvent) and e.modality == "text"
    )
    assert [u.num_output_tokens for u in native if isinstance(u, Usage)] == [tokens]
    assert [e.modality for e in pictures] == ["image", "image"]  # type: ignore[attr-defined]


def test_errors_have_openai_shape_and_status(toy_server: RunningServer) -> None:
    oa = client(toy_server)
    with pytest.raises(openai.NotFoundError) as missing:
        oa.audio.speech.create(model="tts-1", voice="alloy", input="hi")
    assert (
        missing.value.body["param"] == "model" and missing.value.body["code"] == "model_not_found"
    )  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as unsupported:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "cannot do task 'generate'" in unsupported.value.message
    with pytest.raises(openai.BadRequestError) as bad_format:
        oa.audio.speech.create(model=MODEL, voice="alloy", input="hi", response_format="mp3")
    assert bad_format.value.body["param"] == "response_format"  # type: ignore[index]
    with httpx.Client(base_url=toy_server.url) as http:
        empty = http.post("/v1/audio/speech", json={"input": ""})
        broken = http.post(
            "/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"}
        )
        no_task = http.post("/generate", json={"text": "hi"})
        bad_task = http.post("/generate", json={"task": "generate", "text": "hi"})
        no_route = http.get("/v1/nothing-here")
    assert (empty.status_code, empty.json()["error"]["param"]) == (400, "input")
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    assert (no_task.status_code, no_task.json()["error"]["param"]) == (400, "task")
    assert bad_task.status_code == 400 and bad_task.json()["error"]["code"] == "unsupported_task"
    assert no_route.status_code == 404 and "error" in no_route.json()


def test_responses_carry_a_request_id(toy_server: RunningServer) -> None:
    with httpx.Client(base_url=toy_server.url) as http:
        ids = {http.get("/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)


def test_metrics_show_every_family(toy_server: RunningServer) -> None:
    whole_wav(toy_server, "metrics")
    with httpx.Client(base_url=toy_server.url) as http:
        text = http.get("/metrics").text
    for family in (
        "mstar_requests_running",
        "mstar_requests_waiting",
        "mstar_requests_finished_total",
        "mstar_e2e_request_latency_seconds",
        "mstar_time_to_first_token_seconds",
        "mstar_time_to_first_audio_seconds",
        "mstar_audio_real_time_factor",
        "mstar_inter_token_latency_seconds",
        "mstar_inter_chunk_latency_seconds",
        "mstar_generated_tokens_total",
        "mstar_generated_audio_seconds_total",
        "mstar_generated_images_total",
        "mstar_engine_walk_step_seconds",
        "mstar_engine_walk_inputs_total",
        "mstar_transport_tensor_bytes_total",
        "mstar_engine_phase_seconds",
    ):
        assert f"# TYPE {family} " in text, family
    m = toy_server.metric
    assert m("mstar_requests_finished_total", task="speech", status="completed") >= 1
    assert (
        m("mstar_audio_real_time_factor_count") >= 1
        and m("mstar_generated_audio_seconds_total") > 0
    )
    assert m("mstar_inter_chunk_latency_seconds_count", modality="audio") >= 1
    assert m("mstar_time_to_first_token_seconds_count") >= 1  # the toy's speech LM emits its tokens
    assert toy_server.wait_idle() and m("mstar_requests_running") == 0
    # engine families, per (rank, node): the vocoder ran steps with at least one input each
    assert m("mstar_engine_steps", rank="0", node="vocoder") >= 1
    assert m("mstar_engine_batch_size_mean", rank="0", node="vocoder") >= 1
    assert m("mstar_engine_step_seconds", rank="0", node="lm") > 0
    assert "mstar_engine_phase_seconds{" not in text  # the toy's engines are stateless: no phases
    # step times per (node, walk): the lm serves two walks; one step at a time, they add up
    walk_steps = {
        w: m("mstar_engine_walk_step_seconds_count", rank="0", node="lm", walk=w)
        for w in ("prefill", "decode")
    }
    assert walk_steps["prefill"] >= 1 and walk_steps["decode"] >= 1
    assert (
        m("mstar_engine_walk_step_seconds_bucket", rank="0", node="lm", walk="decode", le="+Inf")
        == walk_steps["decode"]
    )
    assert m("mstar_engine_walk_inputs_total", rank="0", node="vocoder", walk="vocode") >= 1
    # one process: tensors pass by reference, nothing crosses a transport
    assert (
        m(
            "mstar_transport_tensor_bytes_total",
            process="conductor",
            transport="ipc",
            direction="sent",
        )
        == 0
    )


def test_metrics_show_the_phases_of_kv_cache_steps() -> None:
    metrics = ServerMetrics(MODEL)
    phases = {"schedule": 0.5, "prepare": 0.25, "forward": 2.0, "logits": 1.0, "update": 0.125}
    kv_node = {
        "steps": 4.0,
        "batched": 8.0,
        "step_seconds": 4.0,
        "kv_blocks_total": 16.0,
        "kv_blocks_used": 4.0,
    }
    kv_node |= {f"phase_{name}_seconds": seconds for name, seconds in phases.items()}
    stateless = {"steps": 2.0, "batched": 2.0, "step_seconds": 1.0}
    metrics.set_engine_stats(EngineStats(nodes={0: {"llm": kv_node}, 1: {"codec": stateless}}))
    samples = {
        (s.labels["rank"], s.labels["node"], s.labels["phase"]): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        if family.name == "mstar_engine_phase_seconds"
        for s in family.samples
    }
    assert samples == {("0", "llm", name): seconds for name, seconds in phases.items()}
    assert (
        metrics.registry.get_sample_value(
            "mstar_engine_step_seconds", {"model": MODEL, "rank": "1", "node": "codec"}
        )
        == 1.0
    )


def test_metrics_count_tensor_bytes_of_every_process() -> None:
    config = EngineConfig(worker_processes=True)
    with running_server(
        ModelSpec("mstar.zoo.toy:ToyModel"), names=(MODEL,), engine_config=config
    ) as server:
        rate, pcm = whole_wav(server, "bytes across processes")
        assert rate == SERVED_RATE and pcm
        with httpx.Client(base_url=server.url) as http:
            text = http.get("/metrics").text
    samples = {
        (s.labels["process"], s.labels["transport"], s.labels["direction"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "mstar_transport_tensor_bytes"
        for s in family.samples
    }
    # the conductor sends the prompt to the worker process, which sends tokens and audio back
    assert samples["conductor", "ipc", "sent"] == samples["rank0", "ipc", "received"] > 0
    # (the audio crosses as float32 samples at the vocoder's rate: 4 bytes for each 1.5 served PCM16
    # samples)
    assert (
        samples["rank0", "ipc", "sent"]
        == samples["conductor", "ipc", "received"]
        >= len(pcm) * 2 * RATE // SERVED_RATE
    )
    assert {k[1] for k in samples} == {"ipc", "tcp", "shm", "cuda_ipc"}
