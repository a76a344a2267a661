"""Constrained decoding of audio tokens, and their validation without constraints."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.errors import AudioTokenError
from mstar.zoo.orpheus import FRAME_SIZE, AudioLogitsProcessor, TokenLayout, audio_code, audio_codes

REAL = TokenLayout()
MICRO = TokenLayout(tokeniser_length=512, codebook_size=64)


def test_real_layout_has_the_published_ids() -> None:
    assert (REAL.start_of_text, REAL.end_of_text) == (128000, 128009)
    assert REAL.start_of_speech == 128257
    assert REAL.end_of_speech == 128258
    assert (REAL.start_of_human, REAL.end_of_human) == (128259, 128260)
    assert (REAL.start_of_ai, REAL.end_of_ai, REAL.pad) == (128261, 128262, 128263)
    assert REAL.audio_start == 128266
    assert REAL.audio_id(0, 0) == 128266
    assert REAL.audio_id(6, 4095) == 156937
    assert REAL.num_ids == 156938  # the real vocab of 156,940 pads two more
    assert MICRO.num_ids == 970
    assert REAL.split_audio_id(128266 + 3 * 4096 + 9) == (3, 9)
    assert REAL.split_audio_id(156937) == (6, 4095)
    assert REAL.split_audio_id(128265) is None and REAL.split_audio_id(156938) is None


@settings(max_examples=60, deadline=None)
@given(
    prompt_len=st.integers(1, 40),
    generated=st.integers(0, 60),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    allow_end=st.booleans(),
)
def test_only_the_positions_audio_ids_survive(
    prompt_len: int, generated: int, dtype: torch.dtype, allow_end: bool
) -> None:
    """End of speech too between frames, unless the request ignores it (``ignore_eos``)."""
    processor = AudioLogitsProcessor(MICRO, prompt_len, allow_end=allow_end)
    logits = torch.randn(MICRO.num_ids + 3, dtype=dtype)  # a padded vocab too
    before = logits.clone()
    tokens = [0] * (prompt_len + generated)
    out = processor(tokens, logits)
    assert out is logits  # in place: the engine's row is masked without a copy
    position = generated % FRAME_SIZE
    start, end = MICRO.audio_range(position)
    ends = position == 0 and allow_end
    allowed = set(range(start, end)) | ({MICRO.end_of_speech} if ends else set())
    finite = set(torch.isfinite(out).nonzero().flatten().tolist())
    assert finite == allowed
    ranges = processor.vocab_ranges(tokens)
    assert {i for a, b in ranges for i in range(a, b)} == allowed
    kept = sorted(allowed)
    assert torch.equal(out[kept], before[kept])


def test_sampling_under_the_mask_yields_valid_frames() -> None:
    gen = torch.Generator().manual_seed(0)
    prompt = [1, 2, 3]
    processor = AudioLogitsProcessor(MICRO, len(prompt))
    tokens = list(prompt)
    ended_at = None
    for _ in range(400):
        logits = torch.randn(MICRO.num_ids, generator=gen) * 3
        # make end of speech likely, so the boundary rule is exercised
        logits[MICRO.end_of_speech] += 4
        probs = torch.softmax(processor(tokens, logits), dim=-1)
        token = int(torch.multinomial(probs, 1, generator=gen))
        if token == MICRO.end_of_speech:
            ended_at = len(tokens) - len(prompt)
            break
        tokens.append(token)
    assert ended_at is not None and ended_at % FRAME_SIZE == 0
    codes = audio_codes(MICRO, tokens[len(prompt) :])
    assert all(0 <= c < MICRO.codebook_size for c in codes)


def test_processor_rejects_a_request_shorter_than_its_prompt() -> None:
    with pytest.raises(ValueError, match="prompt_len"):
        AudioLogitsProcessor(REAL, 0)
    processor = AudioLogitsProcessor(REAL, 5)
    with pytest.raises(ValueError, match="fewer than its prompt"):
        processor([1, 2], torch.zeros(REAL.num_ids))


def test_audio_code_inverts_audio_id() -> None:
    for index in range(20):
        position = index % FRAME_SIZE
        for code in (0, 1, 4095):
            assert audio_code(REAL, REAL.audio_id(position, code), index) == code
    # The reference decoder's formula: code = N - 10 - (index % 7) * 4096 for <custom_token_N>.
    n = 128266 + 3 * 4096 + 77 - 128256
    assert audio_code(REAL, 128256 + n, 3) == n - 10 - 3 * 4096


@pytest.mark.parametrize(
    ("token", "index", "message"),
    [
        (
            REAL.audio_id(1, 5),
            0,
            r"audio token 0 \(frame 0, position 0\) is 128266\+4096\+5|an audio id for position 1",
        ),
        (REAL.audio_id(0, 5), 13, r"frame 1, position 6.*an audio id for position 0"),
        (9906, 2, r"a text id: expected an id in \[136458, 140554\)"),
        (REAL.end_of_speech, 4, "end of speech where audio was expected"),
        (156939, 0, "not an audio id"),  # a padding id past the layout
        (-1, 0, "not an audio id"),
    ],
)
def test_audio_code_names_what_is_wrong(token: int, index: int, message: str) -> None:
    with pytest.raises(AudioTokenError, match=message):
        audio_code(REAL, token, index)


def test_audio_codes_reports_the_first_bad_index() -> None:
    good = [REAL.audio_id(i % 7, i) for i in range(9)]
    assert audio_codes(REAL, good) == list(range(9))
    assert audio_codes(REAL, good[3:], start_index=3) == list(range(3, 9))
    with pytest.raises(AudioTokenError, match=r"audio token 5 "):
        audio_codes(REAL, [*good[:5], good[0], *good[6:]])
