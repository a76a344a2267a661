"""Streaming audio: which frames each chunk of Orpheus tokens emits, and decoding them batched.

The LLM's tokens reach the codec through ``SlidingWindowChunkPolicy(28, 7)``: a window of 4
frames every frame. Like the reference streamer, a full window emits its second frame
(samples 2048:4096 of its 8192), which then has a frame of left and two of right context.
Unlike it, nothing is lost: the first window also emits frame 0, and the end of the stream
emits the frames no window emitted yet. With ``F`` complete frames (``F >= 4``)::

    frames         0    1    2    3    4   ...  F-4  F-3  F-2  F-1
    window [0,4)  [e0   e1   .    .]                                   first window: frames 0, 1
    window [1,5)       [.    e2   .    .]                              each later one: frame k+1
      ...
    window [F-4,F)                          [.    eF-3  .    .  ]
    end of stream: window [F-4,F) again     [.    .    eF-2 eF-1]      the tail: frames F-2, F-1

and with ``F < 4`` the end of the stream decodes all ``F`` frames at once and emits them.
Every complete frame is emitted exactly once, in order: ``F * 2048`` samples in all. Tokens
of a trailing incomplete frame (``max_tokens`` reached mid-frame, or end of speech mid-frame
without constrained decoding) are dropped. Tokens after end of speech are ignored.

Against one decode of all frames at once: SNAC's receptive field is about 3 frames each way,
so a stream of at most 4 frames (one window) is the same audio; in longer streams the first
and last frames keep nearly all their context, while the middle frames (one frame of left
and two of right context, as in the reference streamer) differ slightly (0.2-0.7 % RMS with
random weights).

The rule reads the token stream, not the chunk geometry, so it holds for any chunking; in
particular for the final chunk of a sliding window, which may carry no items at all (when the
last window ended the stream). The end of the stream therefore needs the last window's codes,
which `AudioStreamState` keeps: a request's state is a few dozen integers, passed in and
returned by `plan_chunk`.

A window's noise seed is ``window_seed(state.noise_seed, first_frame)``, so a window gets the
same noise wherever and however often it is decoded (the tail re-decodes the last window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.errors import AudioTokenError
from mstar.streaming import Chunk
from mstar.zoo.orpheus.codec import SnacCodec
from mstar.zoo.orpheus.config import FRAME_SIZE, TokenLayout
from mstar.zoo.orpheus.constrained import audio_code

__all__ = [
    "WINDOW_FRAMES",
    "AudioStreamState",
    "AudioWindow",
    "StreamResult",
    "decode_chunks",
    "decode_windows",
    "plan_chunk",
    "plan_tokens",
    "window_seed",
]

WINDOW_FRAMES = 4
"""Frames per codec window (28 tokens)."""

_EMIT_LAG = 2  # a window [f, f+4) emits up to frame f+1: two frames of right context


def window_seed(noise_seed: int, first_frame: int) -> int:
    """Return the noise seed of the window starting at ``first_frame`` (a 63-bit mix)."""
    mixed = (noise_seed * 0x9E3779B97F4A7C15 + first_frame * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    mixed ^= mixed >> 31
    return mixed & (2**63 - 1)


@dataclass(frozen=True, slots=True)
class AudioStreamState:
    """One request's progress through its token stream (small, immutable, plain data).

    Attributes:
        noise_seed: Base of the request's codec noise seeds.
        num_items: Stream items consumed (including end of speech and anything after it).
        num_audio_tokens: Audio tokens seen before end of speech.
        num_emitted_frames: Frames emitted so far.
        codes: Codes from frame ``max(0, F - 4)`` on (``F`` complete frames), partial frame last.
        is_ended: End of speech was seen.
        is_done: The final chunk was consumed.
    """

    noise_seed: int = 0
    num_items: int = 0
    num_audio_tokens: int = 0
    num_emitted_frames: int = 0
    codes: tuple[int, ...] = ()
    is_ended: bool = False
    is_done: bool = False

    @property
    def num_frames(self) -> int:
        """Count the complete frames seen."""
        return self.num_audio_tokens // FRAME_SIZE

    @property
    def codes_start_frame(self) -> int:
        """Return the frame of ``codes[0]``."""
        return max(0, self.num_frames - WINDOW_FRAMES)


@dataclass(frozen=True, slots=True)
class AudioWindow:
    """Frames to decode and the frames of them to emit.

    Attributes:
        codes: ``7 * num_frames`` codes, frame after frame.
        first_frame: The stream frame of ``codes[0]``.
        emit_start: First frame to emit (absolute).
        emit_end: One past the last frame to emit (absolute).
        seed: The window's noise seed.
    """

    codes: tuple[int, ...]
    first_frame: int
    emit_start: int
    emit_end: int
    seed: int

    @property
    def num_frames(self) -> int:
        """Count the frames decoded."""
        return len(self.codes) // FRAME_SIZE

    def sample_slice(self, samples_per_frame: int) -> slice:
        """Return the emitted samples within the decoded window."""
        return slice(
            (self.emit_start - self.first_frame) * samples_per_frame,
            (self.emit_end - self.first_frame) * samples_per_frame,
        )


def plan_chunk(
    state: AudioStreamState, chunk: Chunk[Any], layout: TokenLayout
) -> tuple[AudioStreamState, list[AudioWindow]]:
    """Consume one chunk; return the new state and the windows to decode, in emission order.

    Items are token ids (ints or one-element tensors). With ``SlidingWindowChunkPolicy(28, 7)``
    a chunk yields at most one window, except a final chunk, which may yield the tail too.

    Raises:
        AudioTokenError: A token is not a valid audio id for its frame position.
        ValueError: The chunk does not continue the stream, or the stream was already done.
    """
    if state.is_done:
        raise ValueError("this audio stream already consumed its final chunk")
    new_start = chunk.start + chunk.context_len
    if new_start != state.num_items:
        raise ValueError(
            f"the chunk brings items from {new_start}, but the stream consumed {state.num_items}"
        )
    codes = list(state.codes)
    base = state.codes_start_frame  # the frame of codes[0]
    num_audio = state.num_audio_tokens
    emitted = state.num_emitted_frames
    is_ended = state.is_ended
    windows: list[AudioWindow] = []

    def add_window(first: int, end: int, emit_end: int) -> None:
        nonlocal emitted
        offset = (first - base) * FRAME_SIZE
        window_codes = tuple(codes[offset : offset + (end - first) * FRAME_SIZE])
        seed = window_seed(state.noise_seed, first)
        windows.append(AudioWindow(window_codes, first, emitted, emit_end, seed))
        emitted = emit_end

    for item in chunk.new_items:
        if is_ended:
            continue  # nothing after end of speech is audio
        token = int(item)
        if token == layout.end_of_speech:
            is_ended = True
            continue
        codes.append(audio_code(layout, token, num_audio))
        num_audio += 1
        frames, rest = divmod(num_audio, FRAME_SIZE)
        if rest == 0 and frames >= WINDOW_FRAMES:
            add_window(frames - WINDOW_FRAMES, frames, frames - _EMIT_LAG)
    frames = num_audio // FRAME_SIZE
    if chunk.is_last and emitted < frames:
        add_window(max(0, frames - WINDOW_FRAMES), frames, frames)
    keep_from = max(0, frames - WINDOW_FRAMES)
    new_state = AudioStreamState(
        noise_seed=state.noise_seed,
        num_items=chunk.end,
        num_audio_tokens=num_audio,
        num_emitted_frames=emitted,
        codes=tuple(codes[(keep_from - base) * FRAME_SIZE :]),
        is_ended=is_ended,
        is_done=chunk.is_last,
    )
    return new_state, windows


def plan_tokens(
    token_ids: Sequence[int], layout: TokenLayout, noise_seed: int = 0
) -> list[AudioWindow]:
    """Return the windows of a whole token stream, as the streaming path decodes them."""
    chunk = Chunk(tuple(token_ids), 0, 0, True)
    return plan_chunk(AudioStreamState(noise_seed=noise_seed), chunk, layout)[1]


def decode_windows(
    codec: SnacCodec, windows: Sequence[AudioWindow], *, max_batch_size: int | None = None
) -> list[torch.Tensor]:
    """Decode windows (from any requests) and return each one's emitted audio, in order.

    Windows with the same number of frames (all but the ends of streams shorter than four
    frames) run in one batched codec call, or in calls of at most ``max_batch_size``.
    """
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    by_size: dict[int, list[int]] = {}
    for i, window in enumerate(windows):
        by_size.setdefault(window.num_frames, []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(windows)
    spf = codec.samples_per_frame
    for num_frames, same_size in by_size.items():
        step = max_batch_size or len(same_size)
        for begin in range(0, len(same_size), step):
            indices = same_size[begin : begin + step]
            frames = torch.tensor([windows[i].codes for i in indices], dtype=torch.long)
            frames = frames.view(len(indices), num_frames, FRAME_SIZE)
            audio = codec.decode(frames, [windows[i].seed for i in indices])
            for row, i in enumerate(indices):
                # A copy, not a view: the chunk must not keep the whole batch's audio alive.
                out[i] = audio[row, windows[i].sample_slice(spf)].clone()
    return out


@dataclass(frozen=True, slots=True)
class StreamResult:
    """What one request's chunk produced: its next state and audio, or the error that failed it.

    Attributes:
        state: The state after the chunk (unchanged on error).
        audio: Float samples in ``[-1, 1]`` to emit now (possibly empty).
        error: Why the request failed, or None.
    """

    state: AudioStreamState
    audio: torch.Tensor
    error: AudioTokenError | None = None


def decode_chunks(
    codec: SnacCodec,
    layout: TokenLayout,
    batch: Sequence[tuple[AudioStreamState, Chunk[Any]]],
    *,
    max_batch_size: int | None = None,
) -> list[StreamResult]:
    """Plan every request's chunk, decode all their windows in one batch, return each one's audio.

    A request whose tokens are invalid gets a result with ``error`` set; the others go on.
    ``max_batch_size`` caps the windows of one codec call (see `decode_windows`).
    """
    plans: list[tuple[AudioStreamState, list[AudioWindow]] | AudioTokenError] = []
    for state, chunk in batch:
        try:
            plans.append(plan_chunk(state, chunk, layout))
        except AudioTokenError as exc:
            plans.append(exc)
    windows = [w for plan in plans if not isinstance(plan, AudioTokenError) for w in plan[1]]
    decoded = iter(decode_windows(codec, windows, max_batch_size=max_batch_size))
    results: list[StreamResult] = []
    for (state, _), plan in zip(batch, plans, strict=True):
        if isinstance(plan, AudioTokenError):
            results.append(StreamResult(state, torch.empty(0), plan))
            continue
        new_state, request_windows = plan
        pieces = [next(decoded) for _ in request_windows]
        audio = torch.cat(pieces) if pieces else torch.empty(0)
        results.append(StreamResult(new_state, audio))
    return results
