"""Qwen3-Omni configs: the Hugging Face `config.json` of the whole model, and typed views of it.

A config is the published `Qwen3OmniMoeConfig` dict (``thinker_config``, ``talker_config``,
``code2wav_config`` and the top-level token ids), so a checkpoint's own ``config.json`` is a
config, and transformers' reference model is built from the same data. The parts mstar runs
itself (the thinker's and the talker's text models, the code predictor) are read into typed
dataclasses; the encoders and Code2Wav are transformers' modules, built from their sub-dicts.

Three named configs:

- ``qwen3-omni-tiny``: tests (hidden 64 thinker, 32 talker, a handful of experts);
- ``qwen3-omni-small``: meaningful on a CPU (a 256-wide thinker, a 128-wide talker,
  the real 16 codebooks and 1,920 samples per codec frame);
- ``qwen3-omni-30b-a3b``: the published sizes (Qwen3-Omni-30B-A3B-Instruct).

The small configs keep every structural fact of the real one: 16 codebooks, codec vocab =
codebook + 1,024 specials (generation suppresses the top 1,024 ids but EOS), the special-token
layout of both vocabularies, interleaved MRoPE sections summing to ``head_dim / 2``, and the
upsampling rates ``[8, 5, 4, 3] x [2, 2]`` (12.5 Hz frames at 24 kHz).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.hf_checkpoint import load_hf_config

__all__ = [
    "QWEN3_OMNI_CONFIGS",
    "CodePredictorConfig",
    "MoETextConfig",
    "Qwen3OmniConfig",
    "config_from_checkpoint",
    "get_qwen3_omni_config",
]

SAMPLE_RATE = 24_000


@dataclass(frozen=True, slots=True)
class MoETextConfig:
    """A Qwen3-MoE decoder (the thinker's text model, or the talker's).

    Attributes:
        shared_expert_intermediate_size: Width of the shared expert (its output is gated by a
            sigmoid); 0 for none (the thinker).
        decoder_sparse_step: Every this many layers is MoE (1: all); `mlp_only_layers` are dense.
        mrope_section: Channels (of ``head_dim / 2``) rotated by time, height and width;
            interleaved (channel ``i`` takes height if ``i % 3 == 1``, width if ``i % 3 == 2``,
            within ``3 * section``; time otherwise).
        all_moe: Every layer is MoE whatever `mlp_only_layers` says (the talker).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    mrope_section: tuple[int, int, int]
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 32_768
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    all_moe: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if sum(self.mrope_section) != self.head_dim // 2:
            raise UnsupportedModelError(
                f"mrope_section {list(self.mrope_section)} must sum to head_dim / 2 = "
                f"{self.head_dim // 2}"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got "
                f"{self.num_experts_per_tok}"
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` routes through experts (else a dense SiLU MLP)."""
        if self.all_moe:
            return True
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, all_moe: bool = False) -> MoETextConfig:
        """Read a ``text_config`` dict (thinker or talker)."""
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        section = rope.get("mrope_section") or [24, 20, 20]
        if len(section) != 3:
            raise UnsupportedModelError(f"mrope_section must have 3 entries, got {section}")
        try:
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                intermediate_size=int(raw.get("intermediate_size", 0)),
                num_experts=int(
                    raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
                ),
                num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                mrope_section=(int(section[0]), int(section[1]), int(section[2])),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position=int(raw.get("max_position_embeddings", 32_768)),
                shared_expert_intermediate_size=int(
                    raw.get("shared_expert_intermediate_size") or 0
                ),
                decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
                all_moe=all_moe,
            )
        except KeyError as exc:
            raise UnsupportedModelError(
                f"Qwen3-Omni text config lacks the field {exc.args[0]!r}"
            ) from exc


@dataclass(frozen=True, slots=True)
class CodePredictorConfig:
    """The talker's code predictor: a small dense decoder drawing codebooks 1..G-1 of a frame."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_code_groups: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> CodePredictorConfig:
        """Read a ``code_predictor_config`` dict."""
        rope = dict(raw.get("rope_parameters") or {})
        heads = int(raw["num_attention_heads"])
        if raw.get("sliding_window") is not None and raw.get("use_sliding_window"):
            raise UnsupportedModelError(
                "a code predictor with sliding-window layers is not supported"
            )
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            intermediate_size=int(raw["intermediate_size"]),
            num_code_groups=int(raw["num_code_groups"]),
            # transformers' default when a config names none
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        )


@dataclass(frozen=True)
class Qwen3OmniConfig:
    """A whole Qwen3-Omni model: the HF config dict and typed views of the parts mstar runs.

    Attributes:
        name: The config's name.
        hf: The ``Qwen3OmniMoeConfig`` dict (as in a checkpoint's ``config.json``).
        speaker: The default voice (a key of the talker's ``speaker_id``).
        thinker_max_tokens: Default text tokens per answer.
        talker_max_tokens: Default codec frames per answer.
        chunk_frames: Codec frames per Code2Wav chunk (and frames of left context).
    """

    name: str
    hf: dict[str, Any] = field(hash=False, compare=False)
    speaker: str = "ethan"
    thinker_max_tokens: int = 1024
    talker_max_tokens: int = 4096
    chunk_frames: int = 25

    def __post_init__(self) -> None:
        for key in ("thinker_config", "talker_config", "code2wav_config"):
            if not isinstance(self.hf.get(key), dict):
                raise UnsupportedModelError(f"a Qwen3-Omni config needs a {key!r} dict")
        if self.speaker not in self.speaker_ids:
            raise UnsupportedModelError(
                f"unknown speaker {self.speaker!r}; the model has {sorted(self.speaker_ids)}"
            )
        if self.accept_hidden_layer > self.thinker_text.num_layers:
            raise UnsupportedModelError(
                f"accept_hidden_layer {self.accept_hidden_layer} exceeds the thinker's "
                f"{self.thinker_text.num_layers} layers"
            )

    # -- sub-dicts ---------------------------------------------------------------------------------

    @property
    def thinker_hf(self) -> dict[str, Any]:
        """Return the ``thinker_config`` dict."""
        return dict(self.hf["thinker_config"])

    @property
    def talker_hf(self) -> dict[str, Any]:
        """Return the ``talker_config`` dict."""
        return dict(self.hf["talker_config"])

    @property
    def code2wav_hf(self) -> dict[str, Any]:
        """Return the ``code2wav_config`` dict."""
        return dict(self.hf["code2wav_config"])

    # -- typed parts
    # --------------------------------------------------------------------------------

    @property
    def thinker_text(self) -> MoETextConfig:
        """Return the thinker's text model."""
        return MoETextConfig.from_hf(self.thinker_hf["text_config"])

    @property
    def talker_text(self) -> MoETextConfig:
        """Return the talker's text model (every layer MoE with a shared expert)."""
        return MoETextConfig.from_hf(self.talker_hf["text_config"], all_moe=True)

    @property
    def code_predictor(self) -> CodePredictorConfig:
        """Return the code predictor."""
        return CodePredictorConfig.from_hf(self.talker_hf["code_predictor_config"])

    # -- token ids
    # ----------------------------------------------------------------------------------

    def token_id(self, name: str) -> int:
        """Return a top-level or thinker token id (``im_start_token_id``, ``audio_token_id``,
        ...)."""
        if name in self.hf:
            return int(self.hf[name])
        thinker = self.hf["thinker_config"]
        if name in thinker:
            return int(thinker[name])
        raise UnsupportedModelError(f"the config has no {name!r}")

    def codec_id(self, name: str) -> int:
        """Return a talker codec id (``codec_bos_id``, ``codec_eos_token_id``, ...)."""
        return int(self.hf["talker_config"][name])

    @property
    def speaker_ids(self) -> dict[str, int]:
        """Return the voices by lower-case name."""
        raw = self.hf["talker_config"].get("speaker_id") or {}
        return {str(k).lower(): int(v) for k, v in raw.items()}

    @property
    def accept_hidden_layer(self) -> int:
        """Return which captured thinker hidden state feeds the talker (0: the embeddings; k: layer
        k-1's output)."""
        return int(self.hf["talker_config"]["accept_hidden_layer"])

    @property
    def num_code_groups(self) -> int:
        """Return the codebooks per frame (16)."""
        return int(self.hf["talker_config"]["num_code_groups"])

    @property
    def codebook_size(self) -> int:
        """Return the codes per codebook."""
        return int(self.hf["code2wav_config"].get("codebook_size", 2048))

    @property
    def samples_per_frame(self) -> int:
        """Return the audio samples Code2Wav makes per codec frame (1,920 at 24 kHz)."""
        c2w = self.hf["code2wav_config"]
        total = 1
        for rate in list(c2w.get("upsample_rates", (8, 5, 4, 3))) + list(
            c2w.get("upsampling_ratios", (2, 2))
        ):
            total *= int(rate)
        return total

    @property
    def sample_rate(self) -> int:
        """Return the output audio's sample rate."""
        return SAMPLE_RATE

    def make_hf_config(self) -> Any:
        """Build transformers' `Qwen3OmniMoeConfig` from this config (for the reference and for
        saving)."""
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
            Qwen3OmniMoeConfig,
        )

        return Qwen3OmniMoeConfig(**copy.deepcopy(self.hf))


# -- named configs ---------------------------------------------------------------------------------


def _hf_dict(
    *,
    text_vocab: int,
    thinker: dict[str, Any],
    audio: dict[str, Any],
    vision: dict[str, Any],
    talker_text: dict[str, Any],
    code_predictor: dict[str, Any],
    code2wav: dict[str, Any],
    codebook: int,
    accept_hidden_layer: int,
    token_ids: dict[str, int],
) -> dict[str, Any]:
    """Assemble a `Qwen3OmniMoeConfig` dict whose token ids follow the published layout."""
    specials = codebook + 100  # codec specials sit at codebook + 100.. in the real model (2148..)
    thinker_hidden = int(thinker["hidden_size"])
    return {
        "model_type": "qwen3_omni_moe",
        "enable_audio_output": True,
        **{k: v for k, v in token_ids.items() if k in _TOP_LEVEL_IDS},
        "thinker_config": {
            "model_type": "qwen3_omni_moe_thinker",
            "audio_config": {
                "model_type": "qwen3_omni_moe_audio_encoder",
                "output_dim": thinker_hidden,
                **audio,
            },
            "vision_config": {
                "model_type": "qwen3_omni_moe_vision_encoder",
                "out_hidden_size": thinker_hidden,
                **vision,
            },
            "text_config": {
                "model_type": "qwen3_omni_moe_text",
                "vocab_size": text_vocab,
                **thinker,
            },
            "position_id_per_seconds": 13,
            **{k: v for k, v in token_ids.items() if k in _THINKER_IDS},
        },
        "talker_config": {
            "model_type": "qwen3_omni_moe_talker",
            "text_config": {
                "model_type": "qwen3_omni_moe_talker_text",
                "vocab_size": codebook + 1024,
                **talker_text,
            },
            "code_predictor_config": {
                "model_type": "qwen3_omni_moe_talker_code_predictor",
                "vocab_size": codebook,
                "num_code_groups": 16,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
                **code_predictor,
            },
            "num_code_groups": 16,
            "thinker_hidden_size": thinker_hidden,
            "accept_hidden_layer": accept_hidden_layer,
            "codec_pad_id": specials,
            "codec_bos_id": specials + 1,
            "codec_eos_token_id": specials + 2,
            "codec_nothink_id": specials + 7,
            "codec_think_bos_id": specials + 8,
            "codec_think_eos_id": specials + 9,
            "speaker_id": {
                "chelsie": specials + 153,
                "ethan": specials + 154,
                "aiden": specials + 155,
            },
            "position_id_per_seconds": 13,
            "spatial_merge_size": int(vision.get("spatial_merge_size", 2)),
            **{k: v for k, v in token_ids.items() if k in _TALKER_IDS},
        },
        "code2wav_config": {"codebook_size": codebook, "num_quantizers": 16, **code2wav},
    }


_TOP_LEVEL_IDS = frozenset(
    {
        "im_start_token_id",
        "im_end_token_id",
        "tts_pad_token_id",
        "tts_bos_token_id",
        "tts_eos_token_id",
        "system_token_id",
        "user_token_id",
        "assistant_token_id",
    }
)
_THINKER_IDS = frozenset(
    {
        "audio_token_id",
        "image_token_id",
        "video_token_id",
        "audio_start_token_id",
        "vision_start_token_id",
        "user_token_id",
    }
)
_TALKER_IDS = frozenset(
    {
        "audio_token_id",
        "image_token_id",
        "video_token_id",
        "audio_start_token_id",
        "vision_start_token_id",
    }
)

# The published ids (Qwen3-Omni's tokenizer).
REAL_TOKEN_IDS: dict[str, int] = {
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
    "system_token_id": 8948,
    "user_token_id": 872,
    "assistant_token_id": 77091,
    "audio_token_id": 151675,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "audio_start_token_id": 151669,
    "vision_start_token_id": 151652,
}


# Small vocabularies keep the same roles at the top of the vocabulary.
def _small_token_ids(vocab: int) -> dict[str, int]:
    top = vocab - 32
    return {
        "im_start_token_id": top,
        "im_end_token_id": top + 1,
        "tts_pad_token_id": top + 2,
        "tts_bos_token_id": top + 3,
        "tts_eos_token_id": top + 4,
        "audio_token_id": top + 5,
        "image_token_id": top + 6,
        "video_token_id": top + 7,
        "audio_start_token_id": top + 8,
        "vision_start_token_id": top + 9,
        "system_token_id": 20,
        "user_token_id": 21,
        "assistant_token_id": 22,
    }


def _tiny() -> dict[str, Any]:
    vocab = 160
    return _hf_dict(
        text_vocab=vocab,
        thinker={
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [2, 3, 3],
                "interleaved": True,
            },
        },
        audio={
            "num_mel_bins": 20,
            "encoder_layers": 2,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 32,
            "d_model": 32,
            "downsample_hidden_size": 32,
            "n_window": 50,
            "n_window_infer": 100,
            "max_source_positions": 1500,
        },
        vision={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 1,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [1],
        },
        talker_text={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [1, 1, 2],
                "interleaved": True,
            },
        },
        code_predictor={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 64,
        },
        code2wav={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "sliding_window": 72,
            "decoder_dim": 32,
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
        },
        codebook=32,
        accept_hidden_layer=2,
        token_ids=_small_token_ids(vocab),
    )


def _small() -> dict[str, Any]:
    vocab = 4096
    return _hf_dict(
        text_vocab=vocab,
        thinker={
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 128,
            "norm_topk_prob": True,
            "max_position_embeddings": 8192,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [6, 5, 5],
                "interleaved": True,
            },
        },
        audio={
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 512,
            "d_model": 128,
            "downsample_hidden_size": 64,
            "n_window": 50,
            "n_window_infer": 800,
        },
        vision={
            "depth": 2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0, 1],
        },
        talker_text={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 16,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "max_position_embeddings": 8192,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [6, 5, 5],
                "interleaved": True,
            },
        },
        code_predictor={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
        },
        code2wav={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "sliding_window": 72,
            "decoder_dim": 128,
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
        },
        codebook=2048,
        accept_hidden_layer=2,
        token_ids=_small_token_ids(vocab),
    )


def _real() -> dict[str, Any]:
    return _hf_dict(
        text_vocab=152_064,
        thinker={
            "hidden_size": 2048,
            "intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "max_position_embeddings": 65_536,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [24, 20, 20],
                "interleaved": True,
            },
        },
        audio={
            "num_mel_bins": 128,
            "encoder_layers": 32,
            "encoder_attention_heads": 20,
            "encoder_ffn_dim": 5120,
            "d_model": 1280,
            "downsample_hidden_size": 480,
            "n_window": 50,
            "n_window_infer": 800,
        },
        vision={
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
        talker_text={
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "num_hidden_layers": 20,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 384,
            "shared_expert_intermediate_size": 768,
            "max_position_embeddings": 65_536,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [24, 20, 20],
                "interleaved": True,
            },
        },
        code_predictor={
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 5,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
        },
        code2wav={},
        codebook=2048,
        accept_hidden_layer=24,
        token_ids=REAL_TOKEN_IDS,
    )


QWEN3_OMNI_CONFIGS: dict[str, Any] = {
    "qwen3-omni-tiny": _tiny,
    "qwen3-omni-small": _small,
    "qwen3-omni-30b-a3b": _real,
}


def get_qwen3_omni_config(name: str, **overrides: Any) -> Qwen3OmniConfig:
    """Return a named config (``overrides`` set `Qwen3OmniConfig` fields).

    Raises:
        UnsupportedModelError: Unknown name.
    """
    factory = QWEN3_OMNI_CONFIGS.get(name)
    if factory is None:
        raise UnsupportedModelError(
            f"unknown Qwen3-Omni config {name!r}; known: {', '.join(QWEN3_OMNI_CONFIGS)}"
        )
    return Qwen3OmniConfig(name=name, hf=factory(), **overrides)


def config_from_checkpoint(path: str | Path) -> Qwen3OmniConfig:
    """Return the config of a checkpoint directory: its own ``config.json``, named after the
    directory.

    The default voice is ``ethan`` when the talker has it, else its first ``speaker_id``.

    Raises:
        CheckpointError: No ``config.json``, another ``model_type``, no talker (the Thinking
            and Captioner variants, ``enable_audio_output`` false), or a part mstar cannot run.
    """
    path = Path(path)
    hf = load_hf_config(path)
    where = repr(str(path / "config.json"))
    if hf.get("model_type") != "qwen3_omni_moe":
        raise CheckpointError(
            f"{where} has model_type {hf.get('model_type')!r}, not 'qwen3_omni_moe'"
        )
    if not hf.get("enable_audio_output", True) or not isinstance(hf.get("talker_config"), dict):
        raise CheckpointError(
            f"{where} has no talker (enable_audio_output is false: a Thinking or Captioner "
            "checkpoint); mstar serves Qwen3-Omni with its talker and Code2Wav only"
        )
    speakers = [str(k).lower() for k in hf["talker_config"].get("speaker_id") or ()]
    if not speakers:
        raise CheckpointError(f"{where}: talker_config has no speaker_id")
    try:
        config = Qwen3OmniConfig(
            name=path.name, hf=hf, speaker="ethan" if "ethan" in speakers else speakers[0]
        )
        # errors now, not at load
        _ = (config.thinker_text, config.talker_text, config.code_predictor)
    except (UnsupportedModelError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    return config
