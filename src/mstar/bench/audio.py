"""Count audio frames in PCM and WAV byte streams as they arrive, chunk by chunk.

Network reads split a stream anywhere: in the middle of a sample, or of a WAV header. Both
readers keep what they cannot interpret yet and report only whole frames.

A WAV stream may be one file whose `data` size is a placeholder (0 or 0xFFFFFFFF: length
unknown while streaming), or a sequence of complete WAV files, one per chunk; both work.

    RIFF <size> WAVE | fmt  <16+> fmt-fields | [other chunks] | data <size> samples...
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from mstar.errors import BenchTargetError

__all__ = ["AudioFormat", "PcmFrameCounter", "WavStreamReader"]

_UNKNOWN_SIZES = (0, 0xFFFFFFFF)


@dataclass(frozen=True)
class AudioFormat:
    """The shape of raw PCM: frames per second, channels, bytes per sample."""

    sample_rate: int
    channels: int = 1
    sample_width: int = 2

    def __post_init__(self) -> None:
        if self.sample_rate <= 0 or self.channels <= 0 or self.sample_width <= 0:
            raise BenchTargetError(f"invalid audio format {self!r}")

    @property
    def frame_bytes(self) -> int:
        """Bytes per frame (one sample of every channel)."""
        return self.channels * self.sample_width


class PcmFrameCounter:
    """Count whole frames of raw PCM fed in arbitrary byte pieces."""

    def __init__(self, fmt: AudioFormat) -> None:
        self.format = fmt
        self._pending = 0  # bytes of a frame not yet complete

    def feed(self, data: bytes) -> int:
        """Take the next bytes of the stream; return the frames they complete."""
        total = self._pending + len(data)
        frames, self._pending = divmod(total, self.format.frame_bytes)
        return frames

    def finish(self) -> None:
        """Check that the stream ended on a frame boundary.

        Raises:
            BenchTargetError: The stream ended inside a frame.
        """
        if self._pending:
            raise BenchTargetError(
                f"PCM stream ended {self._pending} bytes into a frame of "
                f"{self.format.frame_bytes} bytes"
            )


class WavStreamReader:
    """Parse WAV headers from a byte stream and count the frames of its `data` chunks."""

    def __init__(self) -> None:
        self._buffer = b""
        self._format: AudioFormat | None = None
        self._counter: PcmFrameCounter | None = None
        self._remaining: int | None = None  # data bytes left; None = until the stream ends
        self._in_data = False

    @property
    def format(self) -> AudioFormat | None:
        """The format of the current WAV file, once its `fmt ` chunk was read."""
        return self._format

    def feed(self, data: bytes) -> int:
        """Take the next bytes of the stream; return the frames they complete.

        Raises:
            BenchTargetError: The bytes are not a WAV stream of integer PCM.
        """
        frames = 0
        while data:
            if self._in_data:
                assert self._counter is not None
                take = len(data) if self._remaining is None else min(len(data), self._remaining)
                frames += self._counter.feed(data[:take])
                data = data[take:]
                if self._remaining is not None:
                    self._remaining -= take
                    if self._remaining == 0:
                        self._counter.finish()
                        self._in_data = False
            else:
                self._buffer += data
                data = self._parse_header()
        return frames

    def finish(self) -> None:
        """Check that the stream ended cleanly (not inside a header or a frame).

        Raises:
            BenchTargetError: The stream was truncated.
        """
        if self._buffer or (self._in_data and self._remaining not in (None, 0)):
            raise BenchTargetError("WAV stream ended inside a header or before its data size")
        if self._format is None:
            raise BenchTargetError("WAV stream ended before any header")
        if self._counter is not None:
            self._counter.finish()

    def _parse_header(self) -> bytes:
        """Consume a complete header from the buffer; return the bytes past it, if any."""
        buf = self._buffer
        if len(buf) < 12:
            return b""
        if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
            raise BenchTargetError(f"not a WAV stream: starts with {buf[:12]!r}")
        pos = 12
        fmt: AudioFormat | None = None
        while True:
            if len(buf) < pos + 8:
                return b""
            chunk_id = buf[pos : pos + 4]
            (size,) = struct.unpack_from("<I", buf, pos + 4)
            body = pos + 8
            if chunk_id == b"data":
                if fmt is None:
                    raise BenchTargetError("WAV `data` chunk before its `fmt ` chunk")
                self._format = fmt
                self._counter = PcmFrameCounter(fmt)
                self._remaining = None if size in _UNKNOWN_SIZES else size
                self._in_data = True
                self._buffer = b""
                return buf[body:]
            if len(buf) < body + size + (size & 1):
                return b""
            if chunk_id == b"fmt ":
                fmt = _parse_fmt(buf[body : body + size])
            pos = body + size + (size & 1)  # RIFF chunks are padded to even sizes


def _parse_fmt(body: bytes) -> AudioFormat:
    if len(body) < 16:
        raise BenchTargetError(f"WAV `fmt ` chunk of {len(body)} bytes; need 16")
    tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
    # 1 = integer PCM, 3 = IEEE float, 0xFFFE = extensible (its sub-format is PCM or float).
    if tag not in (1, 3, 0xFFFE) or bits % 8:
        raise BenchTargetError(f"unsupported WAV encoding (format tag {tag}, {bits} bits)")
    return AudioFormat(sample_rate=rate, channels=channels, sample_width=bits // 8)
