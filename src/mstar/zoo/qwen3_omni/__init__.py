"""Qwen3-Omni: an MoE thinker writing text, an MoE talker speaking it, Code2Wav making the audio.

The thinker (text, audio and image prompts; interleaved MRoPE; DeepStack) and the talker
(a shared-expert MoE fed by projections of the thinker's states) run on mstar's paged KV
engine; the code predictor draws the 15 residual codebooks of each frame in a nested loop with
a per-frame cache; Code2Wav turns frames into 24 kHz audio in left-context chunks. Parity with
transformers' `Qwen3OmniMoeForConditionalGeneration` is tested on shared random weights.
"""

from __future__ import annotations

from mstar.zoo.qwen3_omni.checkpoint import load_qwen3_omni, make_random_checkpoint
from mstar.zoo.qwen3_omni.config import (
    QWEN3_OMNI_CONFIGS,
    CodePredictorConfig,
    MoETextConfig,
    Qwen3OmniConfig,
    get_qwen3_omni_config,
)
from mstar.zoo.qwen3_omni.model import Qwen3OmniModel, make_qwen3_omni_graph
from mstar.zoo.qwen3_omni.modules.text import EmbedsInput, MoEDecoder
from mstar.zoo.qwen3_omni.modules.weights import Qwen3OmniWeights

__all__ = [
    "QWEN3_OMNI_CONFIGS",
    "CodePredictorConfig",
    "EmbedsInput",
    "MoEDecoder",
    "MoETextConfig",
    "Qwen3OmniConfig",
    "Qwen3OmniModel",
    "Qwen3OmniWeights",
    "get_qwen3_omni_config",
    "load_qwen3_omni",
    "make_qwen3_omni_graph",
    "make_random_checkpoint",
]
