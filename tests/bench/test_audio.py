"""Frame counting in PCM and WAV streams cut at arbitrary byte boundaries."""

from __future__ import annotations

import io
import itertools
import struct
import wave

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mstar.bench.audio import AudioFormat, PcmFrameCounter, WavStreamReader
from mstar.errors import BenchTargetError
from tests.bench.synthetic_server import wav_header


def wav_file(frames: int, rate: int = 16_000, channels: int = 1) -> bytes:
    """A complete WAV file with exact sizes, written by the standard library."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(2 * channels * frames))
    return out.getvalue()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def test_pcm_counter_carries_partial_frames_over() -> None:
    counter = PcmFrameCounter(AudioFormat(sample_rate=24_000))
    assert [counter.feed(b"\x00" * n) for n in (5, 3, 1, 1)] == [2, 2, 0, 1]
    counter.finish()
    stereo = PcmFrameCounter(AudioFormat(sample_rate=24_000, channels=2))
    assert stereo.feed(bytes(10)) == 2
    with pytest.raises(BenchTargetError, match="2 bytes into a frame"):
        stereo.finish()


def test_invalid_pcm_format_is_rejected() -> None:
    with pytest.raises(BenchTargetError):
        AudioFormat(sample_rate=0)


@given(frames=st.integers(0, 500), cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_wav_frames_do_not_depend_on_where_the_stream_is_cut(frames: int, cuts: list[int]) -> None:
    data = wav_file(frames, rate=22_050)
    reader = WavStreamReader()
    assert sum(reader.feed(piece) for piece in split(data, cuts)) == frames
    reader.finish()
    assert reader.format == AudioFormat(sample_rate=22_050)


def test_streaming_header_with_unknown_size_counts_until_the_end() -> None:
    reader = WavStreamReader()
    assert reader.feed(wav_header(8000)) == 0
    assert reader.feed(bytes(801)) == 400
    assert reader.feed(bytes(799)) == 400
    reader.finish()
    assert reader.format is not None and reader.format.sample_rate == 8000


def test_one_wav_file_per_chunk() -> None:
    reader = WavStreamReader()
    stream = wav_file(100, rate=24_000) + wav_file(300, rate=24_000, channels=2)
    assert sum(reader.feed(bytes([b])) for b in stream) == 400
    reader.finish()
    assert reader.format == AudioFormat(sample_rate=24_000, channels=2)


def test_chunks_before_data_are_skipped_with_padding() -> None:
    fmt = struct.pack("<HHIIHH", 3, 1, 48_000, 48_000 * 4, 4, 32)  # float32 mono
    info = b"LIST" + struct.pack("<I", 5) + b"abcde" + b"\x00"  # odd size, one pad byte
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + info
    body += b"data" + struct.pack("<I", 40) + bytes(40)
    data = b"RIFF" + struct.pack("<I", len(body)) + body
    reader = WavStreamReader()
    assert reader.feed(data) == 10
    reader.finish()
    assert reader.format == AudioFormat(sample_rate=48_000, channels=1, sample_width=4)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"ID3\x04" + bytes(20), "not a WAV stream"),
        (b"RIFF\x00\x00\x00\x00WAVEdata\x00\x00\x00\x00", "before its `fmt `"),
        (
            b"RIFF\x00\x00\x00\x00WAVEfmt \x10\x00\x00\x00"
            + struct.pack("<HHIIHH", 2, 1, 8000, 8000, 1, 4),
            "unsupported WAV encoding",
        ),
    ],
)
def test_malformed_wav_is_rejected(data: bytes, message: str) -> None:
    with pytest.raises(BenchTargetError, match=message):
        WavStreamReader().feed(data)


def test_truncated_wav_is_reported_at_the_end() -> None:
    data = wav_file(10)
    reader = WavStreamReader()
    reader.feed(data[:-3])
    with pytest.raises(BenchTargetError):
        reader.finish()
    header_only = WavStreamReader()
    header_only.feed(data[:20])
    with pytest.raises(BenchTargetError):
        header_only.finish()
