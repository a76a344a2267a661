"""PCM16 bytes and WAV files of Orpheus audio."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.zoo.orpheus import SAMPLE_RATE, pcm16_bytes, wav_bytes, write_wav


def test_pcm16_is_little_endian_truncated_and_clamped() -> None:
    audio = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0, 1e-5])
    data = pcm16_bytes(audio)
    assert len(data) == 2 * 8
    assert np.frombuffer(data, dtype="<i2").tolist() == [
        0,
        16383,
        -16383,
        32767,
        -32767,
        32767,
        -32767,
        0,
    ]
    assert data[2:4] == (16383).to_bytes(2, "little", signed=True)


def test_wav_file_round_trips(tmp_path: Path) -> None:
    audio = torch.sin(torch.arange(4096) / 10) * 0.5
    path = write_wav(tmp_path / "out" / "speech.wav", audio)
    with wave.open(str(path), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, SAMPLE_RATE)
        assert f.getnframes() == 4096
        assert f.readframes(4096) == pcm16_bytes(audio)
    pcm = pcm16_bytes(audio[:100])
    with wave.open(io.BytesIO(wav_bytes(pcm, 16000)), "rb") as f:
        assert (f.getframerate(), f.readframes(100)) == (16000, pcm)
    with pytest.raises(ValueError, match="even number of bytes"):
        wav_bytes(b"\x00\x01\x02")
