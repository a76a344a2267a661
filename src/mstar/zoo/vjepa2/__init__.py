"""V-JEPA 2-AC: a world model (ViT encoder + action-conditioned predictor) with CEM planning.

The rollout is a `DynamicLoop` over the predictor, a KV-cache node whose engine keeps each
request's frames in the paged KV cache (block-causal: each frame block a full-mask chunk)
and computes only the newest frame block per step; the
upstream loop that recomputes every frame is the baseline
(`mstar.baselines.vjepa2.native_rollout`).
"""

from __future__ import annotations

from mstar.zoo.vjepa2.cem import (
    MAX_CEM_STEPS,
    CEMParams,
    CEMState,
    final_plan,
    l1_energy,
    plan_with,
    refit,
    sample_actions,
)
from mstar.zoo.vjepa2.checkpoint import (
    ENCODER_NUM_HEADS,
    PREDICTOR_NUM_HEADS,
    checkpoint_dtype,
    config_from_checkpoint,
    config_from_parts,
    is_vjepa2_checkpoint,
    load_encoder,
    load_predictor,
    make_random_checkpoint,
    parts_dtype,
    random_state_dicts,
    read_part,
    read_parts,
)
from mstar.zoo.vjepa2.config import (
    VJEPA2_CONFIGS,
    CEMConfig,
    EncoderConfig,
    PredictorConfig,
    VJepa2Config,
    get_vjepa2_config,
)
from mstar.zoo.vjepa2.encoder import VJepa2Encoder
from mstar.zoo.vjepa2.model import (
    EMIT_MODES,
    EncoderNode,
    FrameKVConfig,
    PredictorNode,
    VJepa2Model,
    make_vjepa2_graph,
)
from mstar.zoo.vjepa2.pose import POSE_DIM, integrate_pose
from mstar.zoo.vjepa2.predictor import ACPredictor, FrameInput, PagedACPredictor, block_causal_mask

__all__ = [
    "EMIT_MODES",
    "ENCODER_NUM_HEADS",
    "MAX_CEM_STEPS",
    "POSE_DIM",
    "PREDICTOR_NUM_HEADS",
    "VJEPA2_CONFIGS",
    "ACPredictor",
    "CEMConfig",
    "CEMParams",
    "CEMState",
    "EncoderConfig",
    "EncoderNode",
    "FrameInput",
    "FrameKVConfig",
    "PagedACPredictor",
    "PredictorConfig",
    "PredictorNode",
    "VJepa2Config",
    "VJepa2Encoder",
    "VJepa2Model",
    "block_causal_mask",
    "checkpoint_dtype",
    "config_from_checkpoint",
    "config_from_parts",
    "final_plan",
    "get_vjepa2_config",
    "integrate_pose",
    "is_vjepa2_checkpoint",
    "l1_energy",
    "load_encoder",
    "load_predictor",
    "make_random_checkpoint",
    "make_vjepa2_graph",
    "parts_dtype",
    "plan_with",
    "random_state_dicts",
    "read_part",
    "read_parts",
    "refit",
    "sample_actions",
]
