"""Audio for the wire: float samples to PCM16 (resampled to the rate clients play), and WAV headers.

OpenAI clients play `pcm16` at 24 kHz without reading a rate, so the OpenAI routes serve every
model at `OPENAI_SAMPLE_RATE`: `PcmResampler` converts a model's own rate (the assistant's
Piper voice speaks at 22,050 Hz) with soxr's streaming resampler, whose state carries from one
chunk to the next, so a stream resampled chunk by chunk equals the whole answer resampled at
once (no discontinuity at chunk boundaries).

A streamed WAV cannot know its length when the header goes out, so its RIFF and `data` sizes
hold the placeholder 0xFFFFFFFF ("until the end of the stream"), which players and decoders
(ffmpeg, libsndfile) read to the end of the stream:

    RIFF <0xFFFFFFFF> WAVE | fmt  <16> PCM, channels, rate, byte rate, block, 16 bits | data <0xFFFFFFFF> samples...
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

__all__ = ["OPENAI_SAMPLE_RATE", "STREAMING_SIZE", "PcmResampler", "pcm16_bytes", "wav_header"]

STREAMING_SIZE = 0xFFFFFFFF
"""The RIFF and `data` size of a WAV header whose length is unknown (a stream)."""

OPENAI_SAMPLE_RATE = 24_000
"""The rate of the audio the OpenAI routes serve (what OpenAI clients play `pcm16` at)."""


def _mono_float32(samples: Any) -> np.ndarray:
    if isinstance(samples, torch.Tensor):
        return samples.detach().to("cpu", torch.float32).numpy().reshape(-1)
    return np.asarray(samples, dtype=np.float32).reshape(-1)


def pcm16_bytes(samples: Any) -> bytes:
    """Return little-endian signed 16-bit PCM of float samples in [-1, 1] (clipped outside).

    Args:
        samples: A tensor or array of float samples (any shape; flattened, so mono).
    """
    scaled = np.rint(np.clip(_mono_float32(samples), -1.0, 1.0) * 32767.0)
    return scaled.astype("<i2").tobytes()


class PcmResampler:
    """Turn one answer's float chunks at ``in_rate`` into PCM16 at ``out_rate``, continuously.

    `feed` each chunk as it comes, then `finish` once for the resampler's delay (the last
    few milliseconds). At equal rates the samples pass through unchanged.

    Args:
        in_rate: The model's sample rate.
        out_rate: The rate to serve.
    """

    def __init__(self, in_rate: int, out_rate: int = OPENAI_SAMPLE_RATE) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} and {out_rate}")
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream: Any = None
        if in_rate != out_rate:
            import soxr

            self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")
        self.is_finished = False

    def feed(self, samples: Any) -> bytes:
        """Return the PCM16 that ``samples`` (float, mono) add at the output rate."""
        assert not self.is_finished, "fed after finish"
        array = _mono_float32(samples)
        if self._stream is None:
            return pcm16_bytes(array)
        return pcm16_bytes(self._stream.resample_chunk(np.ascontiguousarray(array), last=False))

    def finish(self) -> bytes:
        """Return the samples the resampler still holds (once, at the end of the answer)."""
        if self.is_finished or self._stream is None:
            self.is_finished = True
            return b""
        self.is_finished = True
        return pcm16_bytes(self._stream.resample_chunk(np.zeros(0, np.float32), last=True))


def wav_header(sample_rate: int, *, num_data_bytes: int | None = None, channels: int = 1) -> bytes:
    """Return a 44-byte PCM16 WAV header.

    Args:
        sample_rate: Frames per second.
        num_data_bytes: Size of the sample data; None for a stream of unknown length.
        channels: Interleaved channels.
    """
    if sample_rate <= 0 or channels <= 0:
        raise ValueError(f"invalid WAV format: sample_rate {sample_rate}, channels {channels}")
    block = 2 * channels
    if num_data_bytes is None:
        riff_size = data_size = STREAMING_SIZE
    else:
        if num_data_bytes < 0 or num_data_bytes % block:
            raise ValueError(
                f"{num_data_bytes} data bytes is not a whole number of {block}-byte frames"
            )
        riff_size, data_size = 36 + num_data_bytes, num_data_bytes
    fmt = struct.pack("<HHIIHH", 1, channels, sample_rate, sample_rate * block, block, 16)
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", data_size)
    )
