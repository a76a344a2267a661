"""Streaming audio over `SlidingWindowChunkPolicy(28, 7)`: every frame emitted exactly once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from snac import SNAC

from mstar.errors import AudioTokenError
from mstar.streaming import Chunk, SlidingWindowChunkPolicy, StreamBuffer
from mstar.zoo.orpheus import (
    AudioStreamState,
    SnacCodec,
    SnacConfig,
    TokenLayout,
    decode_chunks,
    decode_windows,
    pcm16_bytes,
    plan_chunk,
    plan_tokens,
    window_seed,
)

LAYOUT = TokenLayout(tokeniser_length=1024, codebook_size=4096)
SPF = 2048

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def codec() -> SnacCodec:
    config = SnacConfig(encoder_dim=4, decoder_dim=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        snac = SNAC(**config.to_json_dict()).eval()
    return SnacCodec(snac, config)


def _codes(num_tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (num_tokens,), generator=gen).tolist()


def _tokens(codes: list[int]) -> list[int]:
    return [LAYOUT.audio_id(i % 7, c) for i, c in enumerate(codes)]


def _expected_windows(num_frames: int) -> list[tuple[int, int, int, int]]:
    """(first frame, end frame, first emitted, end emitted) of each decode, in order."""
    if num_frames == 0:
        return []
    if num_frames < 4:
        return [(0, num_frames, 0, num_frames)]
    middle = [(k, k + 4, k + 1, k + 2) for k in range(1, num_frames - 3)]
    return [(0, 4, 0, 2), *middle, (num_frames - 4, num_frames, num_frames - 2, num_frames)]


def _chunks(items: list[object], put_sizes: list[int]) -> list[Chunk[object]]:
    buffer: StreamBuffer[object] = StreamBuffer(SlidingWindowChunkPolicy(28, 7))
    chunks: list[Chunk[object]] = []
    i = 0
    sizes = iter(put_sizes)
    while i < len(items):
        size = next(sizes, 1)
        buffer.put(items[i : i + size])
        i += size
        chunks.extend(buffer.pop_ready())
    buffer.close()
    chunks.extend(buffer.pop_ready())
    assert buffer.is_drained and chunks[-1].is_last
    return chunks


def _stream_windows(
    items: list[object], put_sizes: list[int], seed: int = 0
) -> list[tuple[int, int, int, int]]:
    state = AudioStreamState(noise_seed=seed)
    got = []
    for chunk in _chunks(items, put_sizes):
        state, windows = plan_chunk(state, chunk, LAYOUT)
        if not chunk.is_last:
            assert len(windows) <= 1  # the 28/7 window never needs two decodes before the end
        got += [
            (w.first_frame, w.first_frame + w.num_frames, w.emit_start, w.emit_end) for w in windows
        ]
        for w in windows:
            assert w.seed == window_seed(seed, w.first_frame)
    assert state.is_done
    return got


@settings(max_examples=150, deadline=None)
@given(
    num_frames=st.integers(0, 12),
    partial=st.integers(0, 6),
    end_of_speech=st.booleans(),
    put_sizes=st.lists(st.integers(1, 30), max_size=40),
)
def test_every_complete_frame_is_emitted_once_in_order(
    num_frames: int, partial: int, end_of_speech: bool, put_sizes: list[int]
) -> None:
    items: list[object] = _tokens(_codes(7 * num_frames + partial, seed=num_frames))
    if end_of_speech:
        items.append(LAYOUT.end_of_speech)
    windows = _stream_windows(items, put_sizes)
    assert windows == _expected_windows(num_frames)
    emitted = [f for _, _, start, end in windows for f in range(start, end)]
    assert emitted == list(range(num_frames))


def test_windows_are_the_reference_streamers() -> None:
    # The reference decodes buffer[-28:] at every 7th audio token from the 28th: window k is
    # frames [k, k+4), fired by the chunk that completes frame k+3.
    items: list[object] = _tokens(_codes(7 * 9, seed=1))
    state = AudioStreamState()
    fired = []
    for chunk in _chunks(items, [1] * len(items)):
        state, windows = plan_chunk(state, chunk, LAYOUT)
        if not chunk.is_last and windows:
            (window,) = windows
            assert window.codes == tuple(_codes(7 * 9, seed=1)[chunk.start : chunk.end])
            fired.append(window.first_frame)
    assert fired == [0, 1, 2, 3, 4, 5]


def test_end_of_speech_and_what_follows_it_are_not_audio() -> None:
    codes = _codes(7 * 5 + 3, seed=2)
    items: list[object] = [*_tokens(codes), LAYOUT.end_of_speech, 5, 6, 7]  # junk after the end
    assert _stream_windows(items, [4] * 20) == _expected_windows(5)
    state, _ = plan_chunk(AudioStreamState(), Chunk(tuple(items), 0, 0, True), LAYOUT)
    assert (state.num_audio_tokens, state.num_frames, state.is_ended) == (38, 5, True)


def test_tensor_items_are_accepted() -> None:
    tokens = _tokens(_codes(7 * 4, seed=3))
    items: list[object] = [torch.tensor([t]) for t in tokens]
    assert _stream_windows(items, [7] * 4) == _expected_windows(4)


@pytest.mark.parametrize("num_frames", [0, 1, 3, 4, 5, 9])
def test_streamed_audio_is_the_windows_decoded_directly(codec: SnacCodec, num_frames: int) -> None:
    codes = _codes(7 * num_frames + 2, seed=num_frames)  # 2 tokens of a frame that never completes
    state = AudioStreamState(noise_seed=11)
    pieces = []
    for chunk in _chunks(list(_tokens(codes)), [3] * 40):
        (result,) = decode_chunks(codec, LAYOUT, [(state, chunk)])
        assert result.error is None
        state = result.state
        pieces.append(result.audio)
    streamed = torch.cat(pieces)
    assert streamed.shape == (SPF * num_frames,)
    frames = torch.tensor(codes[: 7 * num_frames]).view(1, num_frames, 7)
    direct = [
        codec.decode(frames[:, first:end], [window_seed(11, first)])[
            0, (a - first) * SPF : (b - first) * SPF
        ]
        for first, end, a, b in _expected_windows(num_frames)
    ]
    assert torch.equal(streamed, torch.cat(direct) if direct else torch.empty(0))
    # The same stream planned at once (non-streaming) decodes the same windows.
    offline = plan_tokens(_tokens(codes), LAYOUT, noise_seed=11)
    assert [(w.first_frame, w.emit_start, w.emit_end) for w in offline] == [
        (first, a, b) for first, _, a, b in _expected_windows(num_frames)
    ]


def test_middle_frames_are_what_the_reference_streamer_emits(codec: SnacCodec) -> None:
    # The reference emits samples 2048:4096 of window k, i.e. frames 1 .. F-3; so do we.
    num_frames = 8
    codes = _codes(7 * num_frames, seed=5)
    results = []
    state = AudioStreamState(noise_seed=3)
    for chunk in _chunks(list(_tokens(codes)), [7] * num_frames):
        (result,) = decode_chunks(codec, LAYOUT, [(state, chunk)])
        state = result.state
        results.append(result.audio)
    ours = torch.cat(results)
    frames = torch.tensor(codes).view(1, num_frames, 7)
    reference = torch.cat(
        [
            codec.decode(frames[:, k : k + 4], [window_seed(3, k)])[0, 2048:4096]
            for k in range(num_frames - 3)
        ]
    )
    assert torch.equal(ours[SPF : (num_frames - 2) * SPF], reference)


@pytest.mark.parametrize("max_batch_size", [None, 1, 5])
def test_concurrent_streams_in_one_batch_match_each_alone(
    codec: SnacCodec, max_batch_size: int | None
) -> None:
    lengths = [7 * (i % 7) + (3 * i) % 7 for i in range(16)]  # 0 to 6 frames, partial frames
    streams = [
        _chunks(list(_tokens(_codes(n, seed=100 + i))), [7] * 40) for i, n in enumerate(lengths)
    ]
    states = [AudioStreamState(noise_seed=i) for i in range(16)]
    batched: list[list[torch.Tensor]] = [[] for _ in range(16)]
    step = 0
    while any(step < len(s) for s in streams):
        active = [i for i in range(16) if step < len(streams[i])]
        pairs = [(states[i], streams[i][step]) for i in active]
        results = decode_chunks(codec, LAYOUT, pairs, max_batch_size=max_batch_size)
        for i, result in zip(active, results, strict=True):
            states[i] = result.state
            batched[i].append(result.audio)
        step += 1
    for i in range(16):
        state = AudioStreamState(noise_seed=i)
        alone = []
        for chunk in streams[i]:
            (result,) = decode_chunks(codec, LAYOUT, [(state, chunk)])
            state = result.state
            alone.append(result.audio)
        together, single = torch.cat(batched[i]), torch.cat(alone)
        assert together.shape == (SPF * (lengths[i] // 7),)
        if max_batch_size == 1:
            assert torch.equal(together, single)  # one window per call: bitwise as alone
        torch.testing.assert_close(together, single, rtol=0, atol=1e-5)
        a = np.frombuffer(pcm16_bytes(together), dtype="<i2").astype(np.int32)
        b = np.frombuffer(pcm16_bytes(single), dtype="<i2").astype(np.int32)
        assert int(np.abs(a - b).max(initial=0)) <= 1  # PCM16 may differ by one step


def test_a_bad_token_fails_only_its_request(codec: SnacCodec) -> None:
    good = Chunk(tuple(_tokens(_codes(28, seed=6))), 0, 0, False)
    bad_tokens = _tokens(_codes(28, seed=7))
    bad_tokens[9] = LAYOUT.audio_id(0, 1)  # position 2 expected
    bad = Chunk(tuple(bad_tokens), 0, 0, False)
    ok, failed = decode_chunks(
        codec, LAYOUT, [(AudioStreamState(), good), (AudioStreamState(), bad)]
    )
    assert ok.error is None and ok.audio.shape == (2 * SPF,)
    assert isinstance(failed.error, AudioTokenError)
    assert "audio token 9 (frame 1, position 2)" in str(failed.error)
    assert failed.state == AudioStreamState() and failed.audio.numel() == 0


def test_chunks_must_continue_the_stream() -> None:
    tokens = tuple(_tokens(_codes(35, seed=8)))
    state, _ = plan_chunk(AudioStreamState(), Chunk(tokens[:28], 0, 0, False), LAYOUT)
    with pytest.raises(ValueError, match="brings items from 14, but the stream consumed 28"):
        plan_chunk(state, Chunk(tokens[7:21], 7, 7, False), LAYOUT)
    state, _ = plan_chunk(state, Chunk(tokens[7:35], 7, 21, True), LAYOUT)
    with pytest.raises(ValueError, match="already consumed its final chunk"):
        plan_chunk(state, Chunk((), 35, 0, True), LAYOUT)


def test_state_stays_small() -> None:
    items = _tokens(_codes(7 * 200 + 5, seed=9))
    state = AudioStreamState()
    for chunk in _chunks(list(items), [7] * 300):
        state, _ = plan_chunk(state, chunk, LAYOUT)
        assert len(state.codes) <= 7 * 4 + 6


@pytest.mark.parametrize("num_frames", [1, 2, 3, 4, 9])
def test_streamed_audio_against_one_decode_of_all_frames(num_frames: int) -> None:
    # SNAC's receptive field is +-3 frames. A stream of at most 4 frames is one window: the
    # same as decoding everything at once. Longer streams: the first and last frames keep all
    # their context; the middle ones (one frame of left, two of right context, as the
    # reference streamer) differ slightly.
    config = SnacConfig(encoder_dim=4, decoder_dim=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        snac = SNAC(**config.to_json_dict()).eval()
    quiet = SnacCodec(snac, config, noise="off")
    codes = _codes(7 * num_frames, seed=20 + num_frames)
    streamed = torch.cat(decode_windows(quiet, plan_tokens(_tokens(codes), LAYOUT)))
    full = quiet.decode(torch.tensor(codes).view(1, num_frames, 7))[0]
    if num_frames <= 4:
        torch.testing.assert_close(streamed, full, rtol=0, atol=1e-5)
        return
    per_frame = (streamed - full).view(num_frames, SPF).norm(dim=1) / full.view(
        num_frames, SPF
    ).norm(dim=1)
    assert per_frame[0] < 1e-5 and per_frame[-1] < 1e-5
    assert per_frame[1] < 1e-3 and per_frame[-2] < 1e-3
    assert float(per_frame.max()) < 2e-2


def test_max_batch_size_must_be_positive(codec: SnacCodec) -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        decode_windows(codec, plan_tokens(_tokens(_codes(28, seed=0)), LAYOUT), max_batch_size=0)
