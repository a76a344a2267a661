"""The Orpheus baselines' equal-work pieces: whole frames, one seed per request everywhere."""

from __future__ import annotations

from mstar.baselines.orpheus import SpeechWork, request_seed


def test_work_counts_whole_frames_and_seeds_are_stable() -> None:
    work = SpeechWork(max_tokens=56, samples_per_frame=2048)
    assert (work.num_frames, work.samples_per_request) == (8, 8 * 2048)
    params = work.sampling(56, 7, (1,))
    assert (params.max_tokens, params.seed, params.stop_token_ids) == (56, 7, (1,))
    assert request_seed("a-1") == request_seed("a-1") != request_seed("a-2")
    assert 0 <= request_seed("a-1") < 2**31
