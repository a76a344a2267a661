"""Audio for the wire: float samples to PCM16, and WAV headers for whole and streamed files.

A streamed WAV cannot know its length when the header goes out, so its RIFF and `data` sizes
hold the placeholder 0xFFFFFFFF ("until the end of the stream"), which players and decoders
(ffmpeg, libsndfile) read to the end of the stream:

    RIFF <0xFFFFFFFF> WAVE | fmt  <16> PCM, channels, rate, byte rate, block, 16 bits | data <0xFFFFFFFF> samples...
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

__all__ = ["STREAMING_SIZE", "pcm16_bytes", "wav_header"]

STREAMING_SIZE = 0xFFFFFFFF
"""The RIFF and `data` size of a WAV header whose length is unknown (a stream)."""


def pcm16_bytes(samples: Any) -> bytes:
    """Return little-endian signed 16-bit PCM of float samples in [-1, 1] (clipped outside).

    Args:
        samples: A tensor or array of float samples (any shape; flattened, so mono).
    """
    if isinstance(samples, torch.Tensor):
        array = samples.detach().to("cpu", torch.float32).numpy()
    else:
        array = np.asarray(samples, dtype=np.float32)
    scaled = np.rint(np.clip(array.reshape(-1), -1.0, 1.0) * 32767.0)
    return scaled.astype("<i2").tobytes()


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
            raise ValueError(f"{num_data_bytes} data bytes is not a whole number of {block}-byte frames")
        riff_size, data_size = 36 + num_data_bytes, num_data_bytes
    fmt = struct.pack("<HHIIHH", 1, channels, sample_rate, sample_rate * block, block, 16)
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt
        + b"data" + struct.pack("<I", data_size)
    )
