"""A request's thinker prompt, cut into the segments its prefill walks append one after another.

A prompt (token ids with one placeholder per audio or image token) becomes a list of
segments, each one prefill walk of the thinker and one ``talker_prefill`` of the talker::

    ids       <|im_start|>system ... user\\n <audio_start> <audio>*n <audio_end> text
    <|im_start|>assistant\\n
    segments  text ──────────────────────┘  audio ─────┘  text ────────────────────────────────┘
    (last)

A segment holds its ids, which of its positions belong to user turns (what the talker is fed),
its MRoPE coordinates when the prompt holds images (the thinker's, and the talker's for its
kept positions) and its media (log-mel features or image patches). Segments are plain dicts of
tensors and numbers, so they cross processes as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig
from mstar.zoo.qwen3_omni.modules.encoders import audio_token_count, mrope_positions
from mstar.zoo.qwen3_omni.modules.talker import user_positions

__all__ = ["AUDIO_RATE", "MediaInputs", "audio_features", "image_patches", "make_segments"]

AUDIO_RATE = 16_000
"""Sample rate of audio inputs (the feature extractor's)."""


@dataclass(frozen=True, eq=False)
class MediaInputs:
    """A prompt's media in prompt order: log-mel features ``[mel, frames]``; image patches and
    grids."""

    audio: tuple[torch.Tensor, ...] = ()
    images: tuple[tuple[torch.Tensor, tuple[int, int, int]], ...] = ()


def audio_features(config: Qwen3OmniConfig, waveform: Any) -> torch.Tensor:
    """Return the log-mel features ``[mel, frames]`` of a 16 kHz mono waveform (Whisper's
    extractor)."""
    from transformers import WhisperFeatureExtractor

    samples = np.asarray(waveform, dtype=np.float32).reshape(-1)
    if samples.size < 160 or not np.isfinite(samples).all():
        raise ValueError("an audio input must hold at least 10 ms of finite 16 kHz samples")
    mel = int(config.thinker_hf["audio_config"]["num_mel_bins"])
    extractor = WhisperFeatureExtractor(feature_size=mel, sampling_rate=AUDIO_RATE)
    out = extractor(
        samples, sampling_rate=AUDIO_RATE, return_attention_mask=True, padding="longest",
        truncation=False, return_tensors="pt",
    )  # fmt: skip
    frames = int(out["attention_mask"][0].sum())
    return out["input_features"][0, :, :frames].float()


def image_patches(
    config: Qwen3OmniConfig, image: Any, max_pixels: int = 256 * 28 * 28
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Return an RGB image's patches ``[patches, C*T*P*P]`` and grid ``(t, h, w)`` (Qwen2-VL's
    processor)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(
            f"an image input must be uint8 H x W x 3, got {array.dtype} {list(array.shape)}"
        )
    vision = config.thinker_hf["vision_config"]
    patch, merge = int(vision["patch_size"]), int(vision["spatial_merge_size"])
    processor = Qwen2VLImageProcessorPil(
        patch_size=patch, temporal_patch_size=int(vision["temporal_patch_size"]), merge_size=merge,
        min_pixels=(patch * merge) ** 2, max_pixels=max_pixels,
    )  # fmt: skip
    out = processor(images=[Image.fromarray(array)], return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    return out["pixel_values"].float(), (t, h, w)


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """Return the ``[start, end)`` runs of ``token`` in ``ids``."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] != token:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == token:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def make_segments(
    config: Qwen3OmniConfig, ids: Sequence[int], media: MediaInputs
) -> list[dict[str, Any]]:
    """Cut a prompt into its prefill segments (see the module docstring).

    Raises:
        ValueError: The placeholders disagree with the media, or the prompt does not end
            with an open assistant turn.
    """
    ids = [int(i) for i in ids]
    im_start, assistant = (
        config.token_id("im_start_token_id"),
        config.token_id("assistant_token_id"),
    )
    opens = [i for i in range(len(ids) - 1) if ids[i] == im_start and ids[i + 1] == assistant]
    if not opens or len(ids) - opens[-1] < 3:
        raise ValueError(
            "the prompt must end with an open assistant turn ('<|im_start|>assistant\\n')"
        )
    audio_id, image_id = config.token_id("audio_token_id"), config.token_id("image_token_id")
    audio_runs, image_runs = _runs(ids, audio_id), _runs(ids, image_id)
    n_window = int(config.thinker_hf["audio_config"].get("n_window", 50))
    if len(audio_runs) != len(media.audio):
        raise ValueError(
            f"the prompt has {len(audio_runs)} audio placeholders but {len(media.audio)} "
            "audio inputs"
        )
    for (lo, hi), feats in zip(audio_runs, media.audio, strict=True):
        if hi - lo != audio_token_count(int(feats.shape[1]), n_window):
            raise ValueError(
                f"an audio of {feats.shape[1]} frames takes "
                f"{audio_token_count(int(feats.shape[1]), n_window)} placeholders, the "
                f"prompt has {hi - lo}"
            )
    vision = config.thinker_hf["vision_config"]
    merge = int(vision.get("spatial_merge_size", 2))
    per_second = int(config.thinker_hf.get("position_id_per_seconds", 13))
    if len(image_runs) != len(media.images):
        raise ValueError(
            f"the prompt has {len(image_runs)} image placeholders but {len(media.images)} images"
        )
    grids = [grid for _, grid in media.images]
    positions3: torch.Tensor | None = None
    if media.images:
        positions3, _ = mrope_positions(ids, image_id, grids, merge, per_second)
    kept = set(user_positions(ids, config))
    talker3, talker_delta = _talker_positions(config, ids, kept, grids, merge, per_second)
    # Segment boundaries: every media run is a segment of its own.
    media_runs = sorted(
        [(lo, hi, "audio", k) for k, (lo, hi) in enumerate(audio_runs)]
        + [(lo, hi, "image", k) for k, (lo, hi) in enumerate(image_runs)]
    )
    pieces: list[tuple[int, int, str, int]] = []
    cursor = 0
    for lo, hi, kind, k in media_runs:
        if lo > cursor:
            pieces.append((cursor, lo, "text", -1))
        pieces.append((lo, hi, kind, k))
        cursor = hi
    pieces.append((cursor, len(ids), "text", -1))  # the assistant's opening is always text
    segments: list[dict[str, Any]] = []
    talker_at = 0
    for index, (lo, hi, kind, k) in enumerate(pieces):
        keep = [i in kept for i in range(lo, hi)]
        num_kept = sum(keep)
        is_last = index == len(pieces) - 1
        seg: dict[str, Any] = {
            "kind": kind,
            "ids": torch.tensor(ids[lo:hi], dtype=torch.long),
            "keep": torch.tensor(keep, dtype=torch.bool),
            "is_last": is_last,
            "opening": len(ids) - opens[-1] if is_last else 0,  # rows of the assistant turn
            "features": media.audio[k] if kind == "audio" else None,
            "pixels": media.images[k][0] if kind == "image" else None,
            "grid": list(media.images[k][1]) if kind == "image" else None,
            "positions3": None,
            "rope_delta": None,
            "talker_positions3": None,
            "talker_rope_delta": None,
        }
        if kind == "image" and positions3 is not None:
            seg["positions3"] = positions3[:, lo:hi].clone()
            seg["rope_delta"] = int(positions3[0, hi]) - hi if hi < len(ids) else 0
        if talker3 is not None:
            width = num_kept + (9 if is_last else 0)
            seg["talker_positions3"] = talker3[:, talker_at : talker_at + width].clone()
            if is_last:
                seg["talker_rope_delta"] = talker_delta
        talker_at += num_kept
        segments.append(seg)
    return segments


def _talker_positions(
    config: Qwen3OmniConfig,
    ids: list[int],
    kept: set[int],
    grids: list[tuple[int, int, int]],
    merge: int,
    per_second: int,
) -> tuple[torch.Tensor | None, int]:
    """Return the talker prompt's MRoPE coordinates when its user turns hold images (else None, 0).

    The talker's ids are the kept user tokens then ``tts_pad`` for the 9 assistant positions,
    as transformers builds them.
    """
    image_id = config.token_id("image_token_id")
    user_ids = [ids[i] for i in sorted(kept)]
    if image_id not in user_ids:
        return None, 0
    # Only the grids of images inside user turns move the talker's coordinates.
    user_grids = [g for (lo, _), g in zip(_runs(ids, image_id), grids, strict=True) if lo in kept]
    talker_ids = user_ids + [config.token_id("tts_pad_token_id")] * 9
    positions3, delta = mrope_positions(talker_ids, image_id, user_grids, merge, per_second)
    return positions3, delta
