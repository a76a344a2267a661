"""Audio output: PCM16 bytes and WAV files (mono, 16-bit; Orpheus speaks at 24 kHz)."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import torch

__all__ = ["SAMPLE_RATE", "pcm16_bytes", "wav_bytes", "write_wav"]

SAMPLE_RATE = 24000
"""Orpheus' output rate (SNAC 24 kHz)."""


def pcm16_bytes(audio: torch.Tensor) -> bytes:
    """Return float audio in ``[-1, 1]`` as PCM16 little-endian bytes.

    Samples are clamped, scaled by 32767 and truncated toward zero, as the reference
    streamer converts them.
    """
    pcm = (audio.detach().reshape(-1).float().clamp(-1.0, 1.0) * 32767).to(torch.int16)
    return pcm.cpu().numpy().astype("<i2").tobytes()


def _to_pcm(audio: torch.Tensor | bytes) -> bytes:
    if isinstance(audio, torch.Tensor):
        return pcm16_bytes(audio)
    if len(audio) % 2:
        raise ValueError(f"PCM16 data must have an even number of bytes, got {len(audio)}")
    return bytes(audio)


def wav_bytes(audio: torch.Tensor | bytes, sample_rate: int = SAMPLE_RATE) -> bytes:
    """Return a complete mono 16-bit WAV file holding ``audio`` (float samples or PCM16 bytes)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(_to_pcm(audio))
    return buffer.getvalue()


def write_wav(
    path: str | Path, audio: torch.Tensor | bytes, sample_rate: int = SAMPLE_RATE
) -> Path:
    """Write ``audio`` (float samples or PCM16 bytes) to a mono 16-bit WAV file; return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(wav_bytes(audio, sample_rate))
    return path
