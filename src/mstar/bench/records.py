"""The data a benchmark moves around: requests sent, output events received, per-request records.

A target turns a `BenchRequest` into a stream of `OutputEvent`s (and optionally one `Usage`).
The client stamps each event with the time it was received, measured from the moment the
request was sent, and files the whole timeline as a `RequestRecord`. Every metric in
`mstar.bench.metrics` is a pure function of such records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mstar.errors import BenchTargetError

__all__ = [
    "MODALITIES",
    "BenchRequest",
    "OutputEvent",
    "RequestRecord",
    "Usage",
]

# The modality tags an `EMIT` edge may carry (DESIGN §2).
MODALITIES = frozenset({"text", "audio", "image", "video", "action", "latent"})


@dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark, sent identically to every target.

    Attributes:
        request_id: Unique within a run.
        prompt: The text prompt (chat message, speech input, image prompt).
        max_tokens: Fixed output length, or None for the target's default.
        ignore_eos: Keep generating past end-of-sequence up to `max_tokens`, so that systems
            compare on equal work.
        params: Extra request fields passed to the target as they are (voice, size, n,
            temperature, ...).
    """

    request_id: str
    prompt: str
    max_tokens: int | None = None
    ignore_eos: bool = False
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict of the request."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class OutputEvent:
    """One piece of output received by the client: a text delta, an audio chunk, an image...

    Targets yield events with `time_s` left at 0; the client replaces it with the time the
    event was received, in seconds since the request was sent.

    Attributes:
        modality: One of `MODALITIES`.
        time_s: Seconds from sending the request to receiving this event.
        num_tokens: Text tokens in this event.
        num_samples: Audio frames (samples per channel) in this event.
        sample_rate: Audio frames per second; required when `num_samples` > 0.
        num_images: Images completed by this event.
        num_bytes: Payload bytes received for this event (informational).
    """

    modality: str
    time_s: float = 0.0
    num_tokens: int = 0
    num_samples: int = 0
    sample_rate: int = 0
    num_images: int = 0
    num_bytes: int = 0

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise BenchTargetError(
                f"unknown output modality {self.modality!r}; use one of {sorted(MODALITIES)}"
            )
        if min(self.num_tokens, self.num_samples, self.num_images, self.num_bytes) < 0:
            raise BenchTargetError(f"negative count in output event {self!r}")
        if self.num_samples > 0 and self.sample_rate <= 0:
            raise BenchTargetError(
                f"audio event with {self.num_samples} samples needs a positive sample_rate"
            )

    @property
    def audio_s(self) -> float:
        """Seconds of audio this event carries (0 for other modalities)."""
        return self.num_samples / self.sample_rate if self.num_samples else 0.0

    @property
    def carries_output(self) -> bool:
        """Whether the event holds output of its modality (a WAV header alone does not)."""
        if self.modality == "text":
            return self.num_tokens > 0
        if self.modality == "audio":
            return self.num_samples > 0
        if self.modality == "image":
            return self.num_images > 0
        return True

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict, leaving out zero counts."""
        out: dict[str, Any] = {"modality": self.modality, "time_s": self.time_s}
        for key in ("num_tokens", "num_samples", "sample_rate", "num_images", "num_bytes"):
            value = getattr(self, key)
            if value:
                out[key] = value
        return out


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts reported by the server itself (OpenAI `usage`); they override counting."""

    num_output_tokens: int
    num_prompt_tokens: int | None = None


@dataclass(frozen=True)
class RequestRecord:
    """The client-side timeline of one request.

    Attributes:
        request_id: The request's id.
        start_s: When it was sent, in seconds since the measured phase began.
        e2e_s: Seconds from sending it to the end of its response (stream exhausted).
        events: Output events received, in order, stamped relative to sending.
        usage: Server-reported token counts, when the target gives them.
        error: Why the request failed, or None when it succeeded.
    """

    request_id: str
    start_s: float
    e2e_s: float
    events: tuple[OutputEvent, ...] = ()
    usage: Usage | None = None
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        """Whether the request succeeded."""
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict of the record."""
        return {
            "request_id": self.request_id,
            "start_s": self.start_s,
            "e2e_s": self.e2e_s,
            "error": self.error,
            "usage": None if self.usage is None else asdict(self.usage),
            "events": [event.to_dict() for event in self.events],
        }
