"""The Orpheus baselines' equal-work pieces: no end of speech, one seed per request everywhere."""

from __future__ import annotations

import torch

from mstar.baselines.orpheus import FixedLengthAudioProcessor, SpeechWork, request_seed
from mstar.zoo.orpheus import TokenLayout


def test_fixed_length_processor_never_allows_end_of_speech() -> None:
    layout = TokenLayout(tokeniser_length=512, codebook_size=64)
    processor = FixedLengthAudioProcessor(layout, 3)
    for generated in range(15):
        logits = torch.zeros(layout.num_ids)
        processor([0] * (3 + generated), logits)
        start, end = layout.audio_range(generated % 7)
        allowed = torch.isfinite(logits).nonzero().flatten()
        assert allowed.tolist() == list(range(start, end))  # at frame boundaries too


def test_work_counts_whole_frames_and_seeds_are_stable() -> None:
    work = SpeechWork(max_tokens=56, samples_per_frame=2048)
    assert (work.num_frames, work.samples_per_request) == (8, 8 * 2048)
    params = work.sampling(56, 7, (1,))
    assert (params.max_tokens, params.seed, params.stop_token_ids) == (56, 7, (1,))
    assert request_seed("a-1") == request_seed("a-1") != request_seed("a-2")
    assert 0 <= request_seed("a-1") < 2**31
