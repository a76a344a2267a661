"""The metrics of DESIGN §7, computed from client-side request timelines.

Everything here is pure: a metric is a function of `RequestRecord`s (and, for throughput, of
the measured phase's wall time). Times are seconds; a record's event times count from the
moment its request was sent. Only successful requests enter latency statistics.

Definitions (the same words are printed with every report):

- **E2E**: from sending the request to the end of its response stream.
- **TTFT**: from sending to the first text chunk.
- **ITL**: the gaps between consecutive text chunks of one request, pooled over requests;
  one gap per chunk even when a chunk carries several tokens (as vLLM `bench serve`).
- **TPOT**: `(E2E - TTFT) / (output_tokens - 1)`, for requests with at least 2 output
  tokens; `output_tokens` is the server's `usage` count when given, else the tokens counted.
- **TTFA**: from sending to the first audio chunk that holds samples.
- **RTF**: client E2E latency / duration of the audio received; below 1 is faster than
  real time.
- **Streaming viability**: see `chunk_on_time`; a request is viable iff all its audio
  chunks are on time.
- **Image latency**: from sending to receiving each image, one value per image.
- **JCT** (job completion time): from sending to the last output of a job modality
  (`action`, `video`, `latent`): the end of a rollout or of an action chunk.
- Statistics: mean, p50, p95, p99 (linear interpolation between closest ranks).
- Throughput: successful requests, output tokens, audio seconds and images per second of
  the measured phase's wall time (first send to last response end).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mstar.bench.records import OutputEvent, RequestRecord

__all__ = [
    "JOB_MODALITIES",
    "METRIC_DEFINITIONS",
    "RequestMetrics",
    "Stats",
    "Summary",
    "audio_chunks",
    "audio_duration",
    "chunk_on_time",
    "compute_stats",
    "image_latencies",
    "inter_token_latencies",
    "job_completion_time",
    "num_output_tokens",
    "on_time_fraction",
    "real_time_factor",
    "request_metrics",
    "summarize",
    "time_per_output_token",
    "time_to_first_audio",
    "time_to_first_token",
    "is_streaming_viable",
]

JOB_MODALITIES = frozenset({"action", "video", "latent"})

METRIC_DEFINITIONS: dict[str, str] = {
    "e2e_s": "E2E: seconds from sending a request to the end of its response stream",
    "ttft_s": "TTFT: seconds from sending to the first text chunk",
    "itl_s": "ITL: seconds between consecutive text chunks (one gap per chunk), pooled",
    "tpot_s": "TPOT: (E2E - TTFT) / (output_tokens - 1), requests with >= 2 output tokens",
    "ttfa_s": "TTFA: seconds from sending to the first audio chunk holding samples",
    "rtf": "RTF: client E2E latency / audio duration received (< 1: faster than real time)",
    "viable": (
        "streaming viability: audio chunk i is on time iff the audio of chunks 0..i-1 lasts "
        "at least as long as the wait from chunk 0 to chunk i; a request is viable iff every "
        "chunk is on time"
    ),
    "image_latency_s": "image latency: seconds from sending to receiving each image",
    "jct_s": "JCT: seconds from sending to the last action/video/latent output of the job",
    "throughput": (
        "throughput: successful requests, output tokens, audio seconds, images per second of "
        "the measured phase's wall time (first send to last end)"
    ),
}


def _chunks(record: RequestRecord, modality: str) -> list[OutputEvent]:
    return [e for e in record.events if e.modality == modality and e.carries_output]


def time_to_first_token(record: RequestRecord) -> float | None:
    """Return the TTFT of a request: the time of its first text chunk, or None without text."""
    chunks = _chunks(record, "text")
    return chunks[0].time_s if chunks else None


def inter_token_latencies(record: RequestRecord) -> list[float]:
    """Return the gaps between consecutive text chunks (empty with fewer than 2 chunks)."""
    times = [e.time_s for e in _chunks(record, "text")]
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def num_output_tokens(record: RequestRecord) -> int:
    """Return the output tokens of a request: the server's usage count, else the tokens seen."""
    if record.usage is not None:
        return record.usage.num_output_tokens
    return sum(e.num_tokens for e in record.events if e.modality == "text")


def time_per_output_token(record: RequestRecord) -> float | None:
    """Return TPOT = (E2E - TTFT) / (output_tokens - 1), or None below 2 tokens or no TTFT."""
    ttft = time_to_first_token(record)
    tokens = num_output_tokens(record)
    if ttft is None or tokens < 2:
        return None
    return (record.e2e_s - ttft) / (tokens - 1)


def audio_chunks(record: RequestRecord) -> list[OutputEvent]:
    """Return the audio events that hold samples, in arrival order."""
    return _chunks(record, "audio")


def time_to_first_audio(record: RequestRecord) -> float | None:
    """Return the TTFA of a request: the time of its first audio chunk, or None without audio."""
    chunks = audio_chunks(record)
    return chunks[0].time_s if chunks else None


def _seconds(samples_by_rate: dict[int, int]) -> float:
    # Sum whole samples per rate and divide once: adding per-chunk float durations drifts.
    return sum(samples / rate for rate, samples in samples_by_rate.items())


def audio_duration(record: RequestRecord) -> float:
    """Return the seconds of audio a request received."""
    samples_by_rate: dict[int, int] = {}
    for chunk in audio_chunks(record):
        samples_by_rate[chunk.sample_rate] = (
            samples_by_rate.get(chunk.sample_rate, 0) + chunk.num_samples
        )
    return _seconds(samples_by_rate)


def real_time_factor(record: RequestRecord) -> float | None:
    """Return RTF = client E2E latency / audio duration, or None when no audio came."""
    duration = audio_duration(record)
    return record.e2e_s / duration if duration > 0 else None


def chunk_on_time(chunks: Sequence[OutputEvent]) -> list[bool]:
    """Judge each audio chunk of one request on time or late for gapless playback.

    Let chunks 0..n-1 arrive at times t_0 <= ... <= t_{n-1} carrying d_0..d_{n-1} seconds
    of audio. Playback starts when chunk 0 arrives and then runs without pause. Chunk i is
    on time iff

        d_0 + d_1 + ... + d_{i-1} >= t_i - t_0

    that is, the audio received before chunk i covers the wait since the first chunk, so the
    listener has not run out of audio when chunk i arrives (arriving exactly as the buffer
    runs dry counts as on time). Chunk 0 is on time by definition: how late it is, is TTFA's
    concern, not viability's. Each chunk is judged against the uninterrupted schedule that
    started at t_0, even after an earlier chunk was late (as VoxServe does).

    Args:
        chunks: Audio events that hold samples, in arrival order.

    Returns:
        One flag per chunk; empty for no chunks.
    """
    flags: list[bool] = []
    received: dict[int, int] = {}  # samples received so far, by sample rate
    for i, chunk in enumerate(chunks):
        flags.append(i == 0 or _seconds(received) >= chunk.time_s - chunks[0].time_s)
        received[chunk.sample_rate] = received.get(chunk.sample_rate, 0) + chunk.num_samples
    return flags


def is_streaming_viable(record: RequestRecord) -> bool | None:
    """Return whether every audio chunk of a request is on time (see `chunk_on_time`).

    Edge cases: no audio chunk gives None (nothing was played, so viability is undefined and
    the request is left out of the viable fraction); a single chunk gives True (nothing can
    arrive late after it); a late first chunk alone does not make a request unviable.
    """
    flags = chunk_on_time(audio_chunks(record))
    return all(flags) if flags else None


def on_time_fraction(record: RequestRecord) -> float | None:
    """Return the fraction of chunks 1..n-1 on time, or None with fewer than 2 chunks."""
    flags = chunk_on_time(audio_chunks(record))
    if len(flags) < 2:
        return None
    return sum(flags[1:]) / (len(flags) - 1)


def image_latencies(record: RequestRecord) -> list[float]:
    """Return one latency per image received: the time of the event completing it."""
    return [e.time_s for e in _chunks(record, "image") for _ in range(e.num_images)]


def job_completion_time(record: RequestRecord) -> float | None:
    """Return the time of the last action/video/latent output, or None without one."""
    times = [e.time_s for e in record.events if e.modality in JOB_MODALITIES]
    return max(times) if times else None


@dataclass(frozen=True)
class RequestMetrics:
    """Every per-request metric of one successful request."""

    e2e_s: float
    ttft_s: float | None
    itl_s: tuple[float, ...]
    tpot_s: float | None
    num_output_tokens: int
    ttfa_s: float | None
    audio_s: float
    rtf: float | None
    is_viable: bool | None
    on_time_fraction: float | None
    image_latencies_s: tuple[float, ...]
    jct_s: float | None


def request_metrics(record: RequestRecord) -> RequestMetrics:
    """Compute every per-request metric of one record."""
    return RequestMetrics(
        e2e_s=record.e2e_s,
        ttft_s=time_to_first_token(record),
        itl_s=tuple(inter_token_latencies(record)),
        tpot_s=time_per_output_token(record),
        num_output_tokens=num_output_tokens(record),
        ttfa_s=time_to_first_audio(record),
        audio_s=audio_duration(record),
        rtf=real_time_factor(record),
        is_viable=is_streaming_viable(record),
        on_time_fraction=on_time_fraction(record),
        image_latencies_s=tuple(image_latencies(record)),
        jct_s=job_completion_time(record),
    )


@dataclass(frozen=True)
class Stats:
    """Distribution summary of one metric: count, mean, p50, p95, p99."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float


def compute_stats(values: Sequence[float]) -> Stats | None:
    """Return count, mean and linear-interpolated p50/p95/p99 of `values`, or None if empty."""
    if not values:
        return None
    array = np.asarray(values, dtype=np.float64)
    p50, p95, p99 = np.percentile(array, [50.0, 95.0, 99.0])
    return Stats(len(values), float(array.mean()), float(p50), float(p95), float(p99))


@dataclass(frozen=True)
class Summary:
    """Aggregates of one (target, load point) phase; None where no request had the metric."""

    num_requests: int
    num_failed: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    audio_s_per_s: float
    images_per_s: float
    num_output_tokens: int
    audio_s: float
    num_images: int
    e2e_s: Stats | None
    ttft_s: Stats | None
    itl_s: Stats | None
    tpot_s: Stats | None
    ttfa_s: Stats | None
    rtf: Stats | None
    viable_fraction: float | None
    on_time_chunk_fraction: float | None
    image_latency_s: Stats | None
    jct_s: Stats | None

    def stats(self, name: str) -> Stats | None:
        """Return the `Stats` field called `name` (e.g. "e2e_s")."""
        value = getattr(self, name)
        if value is not None and not isinstance(value, Stats):
            raise KeyError(f"{name!r} is not a distribution metric")
        return value

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict; distributions become nested dicts."""
        out: dict[str, Any] = {}
        for key, value in vars(self).items():
            out[key] = vars(value).copy() if isinstance(value, Stats) else value
        return out


def summarize(records: Sequence[RequestRecord], duration_s: float) -> Summary:
    """Aggregate the records of one measured phase lasting `duration_s` seconds.

    Failed requests count in `num_failed` and nowhere else. The viable fraction is over
    requests with at least one audio chunk; the on-time chunk fraction pools chunks 1..n-1
    of all requests.
    """
    ok = [request_metrics(r) for r in records if r.is_ok]
    tokens = sum(m.num_output_tokens for m in ok)
    audio_s = sum(m.audio_s for m in ok)
    images = sum(len(m.image_latencies_s) for m in ok)
    viable = [m.is_viable for m in ok if m.is_viable is not None]
    all_flags = [flag for r in records if r.is_ok for flag in chunk_on_time(audio_chunks(r))[1:]]

    def per_s(amount: float) -> float:
        return amount / duration_s if duration_s > 0 else 0.0

    def present(values: Sequence[float | None]) -> list[float]:
        return [v for v in values if v is not None]

    return Summary(
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        requests_per_s=per_s(len(ok)),
        output_tokens_per_s=per_s(tokens),
        audio_s_per_s=per_s(audio_s),
        images_per_s=per_s(images),
        num_output_tokens=tokens,
        audio_s=audio_s,
        num_images=images,
        e2e_s=compute_stats([m.e2e_s for m in ok]),
        ttft_s=compute_stats(present([m.ttft_s for m in ok])),
        itl_s=compute_stats([gap for m in ok for gap in m.itl_s]),
        tpot_s=compute_stats(present([m.tpot_s for m in ok])),
        ttfa_s=compute_stats(present([m.ttfa_s for m in ok])),
        rtf=compute_stats(present([m.rtf for m in ok])),
        viable_fraction=sum(viable) / len(viable) if viable else None,
        on_time_chunk_fraction=sum(all_flags) / len(all_flags) if all_flags else None,
        image_latency_s=compute_stats([t for m in ok for t in m.image_latencies_s]),
        jct_s=compute_stats(present([m.jct_s for m in ok])),
    )
