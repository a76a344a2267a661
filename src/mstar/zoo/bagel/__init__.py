"""BAGEL (BAGEL-7B-MoT): a Mixture-of-Transformer-Experts LLM that understands and generates images.

One paged cache holds each request's contexts (text, ViT and VAE image tokens); image
generation is a rectified-flow loop whose steps query up to three of those contexts read-only
(classifier-free guidance), running only the branches a step needs. The dense reference
(`mstar.baselines.bagel.reference_generate`) recomputes every context with its own cache.
"""

from __future__ import annotations

from mstar.zoo.bagel.checkpoint import config_from_checkpoint
from mstar.zoo.bagel.config import BAGEL_CONFIGS, BagelConfig, get_bagel_config
from mstar.zoo.bagel.flow import FlowSpec, guidance
from mstar.zoo.bagel.model import BagelModel, make_bagel_graph
from mstar.zoo.bagel.weights import BagelWeights, ImageInput, TextInput

__all__ = [
    "BAGEL_CONFIGS",
    "BagelConfig",
    "BagelModel",
    "BagelWeights",
    "FlowSpec",
    "ImageInput",
    "TextInput",
    "config_from_checkpoint",
    "get_bagel_config",
    "guidance",
    "make_bagel_graph",
]
