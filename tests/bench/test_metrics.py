"""Every metric of DESIGN §7 on synthetic timelines, with exact expected values.

Times are dyadic fractions (0.25, 0.5, ...) so float sums are exact and `==` is fair.
"""

from __future__ import annotations

import pytest

from mstar.bench.metrics import (
    METRIC_DEFINITIONS,
    audio_duration,
    chunk_on_time,
    compute_stats,
    image_latencies,
    inter_token_latencies,
    is_streaming_viable,
    job_completion_time,
    num_output_tokens,
    on_time_fraction,
    real_time_factor,
    request_metrics,
    summarize,
    time_per_output_token,
    time_to_first_audio,
    time_to_first_token,
)
from mstar.bench.records import OutputEvent, RequestRecord, Usage
from mstar.errors import BenchTargetError

RATE = 1000  # audio frames per second in these timelines: 250 frames = 0.25 s


def text(t: float, tokens: int = 1) -> OutputEvent:
    return OutputEvent("text", time_s=t, num_tokens=tokens)


def audio(t: float, seconds: float) -> OutputEvent:
    return OutputEvent("audio", time_s=t, num_samples=int(seconds * RATE), sample_rate=RATE)


def record(
    *events: OutputEvent, e2e: float, usage: Usage | None = None, error: str | None = None
) -> RequestRecord:
    return RequestRecord("r", 0.0, e2e, tuple(events), usage, error)


# --- text: TTFT, ITL, TPOT, E2E ---------------------------------------------------------


def test_text_metrics_follow_the_vllm_definitions() -> None:
    r = record(text(0.25), text(0.5), text(1.0, tokens=3), e2e=1.25)
    assert time_to_first_token(r) == 0.25
    assert inter_token_latencies(r) == [0.25, 0.5]  # one gap per chunk, not per token
    assert num_output_tokens(r) == 5
    assert time_per_output_token(r) == (1.25 - 0.25) / (5 - 1) == 0.25
    assert request_metrics(r).e2e_s == 1.25


def test_server_usage_overrides_counted_tokens_for_tpot() -> None:
    r = record(text(0.25), text(0.5), e2e=1.25, usage=Usage(num_output_tokens=9))
    assert num_output_tokens(r) == 9
    assert time_per_output_token(r) == 1.0 / 8


def test_tpot_needs_two_tokens_and_ttft_needs_text() -> None:
    one = record(text(0.5), e2e=1.0)
    assert time_to_first_token(one) == 0.5
    assert time_per_output_token(one) is None
    assert inter_token_latencies(one) == []
    silent = record(audio(0.5, 0.25), e2e=1.0)
    assert time_to_first_token(silent) is None
    assert time_per_output_token(silent) is None


def test_empty_text_events_are_not_chunks() -> None:
    r = record(text(0.125, tokens=0), text(0.25), text(0.75), e2e=1.0)
    assert time_to_first_token(r) == 0.25
    assert inter_token_latencies(r) == [0.5]


# --- audio: TTFA, duration, RTF ---------------------------------------------------------


def test_audio_ttfa_duration_and_rtf() -> None:
    header_only = OutputEvent("audio", time_s=0.125, num_bytes=44)
    r = record(header_only, audio(0.5, 0.25), audio(0.75, 0.5), audio(1.0, 0.25), e2e=2.0)
    assert time_to_first_audio(r) == 0.5  # the header carried no samples
    assert audio_duration(r) == 1.0
    assert real_time_factor(r) == 2.0  # client E2E / audio duration


def test_rtf_is_undefined_without_audio() -> None:
    r = record(text(0.5), e2e=1.0)
    assert time_to_first_audio(r) is None
    assert audio_duration(r) == 0.0
    assert real_time_factor(r) is None


# --- streaming viability ----------------------------------------------------------------


def test_every_chunk_on_time_is_viable_including_the_exact_boundary() -> None:
    # Chunk 1 arrives exactly when chunk 0 (0.5 s) has played out: on time.
    r = record(audio(1.0, 0.5), audio(1.5, 0.5), audio(1.75, 0.5), e2e=2.0)
    assert chunk_on_time(list(r.events)) == [True, True, True]
    assert is_streaming_viable(r) is True
    assert on_time_fraction(r) == 1.0


def test_one_late_chunk_makes_the_request_unviable() -> None:
    # Chunk 1 comes 0.75 s after chunk 0, which lasts 0.5 s: the listener hears a gap.
    # Chunk 2 is judged against the uninterrupted schedule: 1.0 s received >= 1.0 s waited.
    r = record(audio(1.0, 0.5), audio(1.75, 0.5), audio(2.0, 0.5), e2e=2.5)
    assert chunk_on_time(list(r.events)) == [True, False, True]
    assert is_streaming_viable(r) is False
    assert on_time_fraction(r) == 0.5


def test_a_late_first_chunk_alone_does_not_break_viability() -> None:
    # The first chunk takes 10 s (that is TTFA's business); playback then never starves.
    r = record(audio(10.0, 0.5), audio(10.25, 0.5), audio(10.75, 0.25), e2e=11.0)
    assert time_to_first_audio(r) == 10.0
    assert is_streaming_viable(r) is True
    assert on_time_fraction(r) == 1.0


def test_viability_with_fewer_than_two_chunks() -> None:
    no_audio = record(text(0.5), e2e=1.0)
    assert chunk_on_time([]) == []
    assert is_streaming_viable(no_audio) is None  # nothing played: undefined
    assert on_time_fraction(no_audio) is None
    single = record(audio(3.0, 0.25), e2e=3.5)
    assert is_streaming_viable(single) is True  # nothing can arrive late after it
    assert on_time_fraction(single) is None  # no chunk after the first to judge


def test_chunk_durations_use_each_chunks_own_sample_rate() -> None:
    # 0.5 s at 16 kHz then a chunk 0.5 s later: on time; 0.25 s at 48 kHz then 0.5 s later: late.
    a = OutputEvent("audio", time_s=0.0, num_samples=8000, sample_rate=16_000)
    b = OutputEvent("audio", time_s=0.5, num_samples=12_000, sample_rate=48_000)
    c = OutputEvent("audio", time_s=1.25, num_samples=1, sample_rate=48_000)
    assert chunk_on_time([a, b, c]) == [True, True, False]


# --- images and robotics ----------------------------------------------------------------


def test_image_latency_is_one_value_per_image() -> None:
    r = record(
        OutputEvent("image", time_s=1.5, num_images=2),
        OutputEvent("image", time_s=2.0, num_images=1),
        e2e=2.25,
    )
    assert image_latencies(r) == [1.5, 1.5, 2.0]


def test_job_completion_time_is_the_last_job_output() -> None:
    r = record(
        OutputEvent("action", time_s=0.5),
        OutputEvent("action", time_s=1.25),
        OutputEvent("text", time_s=1.375, num_tokens=1),
        e2e=1.5,
    )
    assert job_completion_time(r) == 1.25
    assert job_completion_time(record(text(0.5), e2e=1.0)) is None
    rollout = record(OutputEvent("video", time_s=0.25), OutputEvent("latent", time_s=2.0), e2e=2.5)
    assert job_completion_time(rollout) == 2.0


# --- statistics and aggregation ---------------------------------------------------------


def test_stats_are_mean_and_linear_percentiles() -> None:
    stats = compute_stats([float(v) for v in range(101)])
    assert stats is not None
    assert (stats.count, stats.mean, stats.p50, stats.p95, stats.p99) == (
        101,
        50.0,
        50.0,
        95.0,
        99.0,
    )
    small = compute_stats([4.0, 1.0, 3.0, 2.0])
    assert small is not None
    assert (small.mean, small.p50) == (2.5, 2.5)
    assert small.p99 == pytest.approx(1.0 + 0.99 * 3.0, rel=1e-12)
    assert compute_stats([]) is None


def test_summary_over_mixed_requests() -> None:
    records = [
        # text + audio, viable, 3 tokens by count
        record(text(0.25), text(0.5, tokens=2), audio(0.5, 0.5), audio(1.0, 0.5), e2e=1.5),
        # audio only, chunk 1 late
        record(audio(0.25, 0.5), audio(1.0, 0.5), e2e=2.0),
        # failed: counted, not measured
        record(text(0.25), e2e=0.5, error="BenchTargetError: HTTP 503"),
        # text only, server usage
        record(text(0.75), text(1.0), e2e=1.0, usage=Usage(4)),
    ]
    s = summarize(records, duration_s=4.0)
    assert (s.num_requests, s.num_failed) == (4, 1)
    assert s.requests_per_s == 3 / 4.0
    assert s.num_output_tokens == 3 + 0 + 4
    assert s.output_tokens_per_s == 7 / 4.0
    assert s.audio_s == 2.0
    assert s.audio_s_per_s == 0.5
    assert s.num_images == 0 and s.images_per_s == 0.0
    assert s.e2e_s is not None and s.e2e_s.count == 3 and s.e2e_s.mean == 1.5
    assert s.ttft_s is not None and (s.ttft_s.count, s.ttft_s.p50) == (2, 0.5)
    assert s.itl_s is not None and (s.itl_s.count, s.itl_s.mean) == (2, 0.25)
    # TPOT: (1.5 - 0.25) / 2 and (1.0 - 0.75) / 3
    assert s.tpot_s is not None and s.tpot_s.count == 2
    assert s.tpot_s.mean == pytest.approx((0.625 + 0.25 / 3) / 2, rel=1e-12)
    assert s.ttfa_s is not None and (s.ttfa_s.count, s.ttfa_s.mean) == (2, 0.375)
    assert s.rtf is not None and (s.rtf.count, s.rtf.mean) == (2, 1.75)  # 1.5 / 1.0 and 2.0 / 1.0
    assert s.viable_fraction == 0.5
    assert s.on_time_chunk_fraction == 0.5
    assert s.image_latency_s is None and s.jct_s is None
    assert s.to_dict()["e2e_s"]["p50"] == 1.5


def test_throughput_with_zero_duration_is_zero_not_an_error() -> None:
    s = summarize([], duration_s=0.0)
    assert (s.num_requests, s.requests_per_s, s.e2e_s, s.viable_fraction) == (0, 0.0, None, None)


def test_every_metric_has_a_printed_definition() -> None:
    assert "E2E latency / audio duration" in METRIC_DEFINITIONS["rtf"]
    for key in (
        "e2e_s",
        "ttft_s",
        "itl_s",
        "tpot_s",
        "ttfa_s",
        "viable",
        "image_latency_s",
        "jct_s",
    ):
        assert METRIC_DEFINITIONS[key]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"modality": "smell"},
        {"modality": "audio", "num_samples": 10},  # no sample rate
        {"modality": "text", "num_tokens": -1},
    ],
)
def test_malformed_events_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(BenchTargetError):
        OutputEvent(**kwargs)  # type: ignore[arg-type]
