"""pi0.5: a PaliGemma prefix in the paged KV cache and a flow-matching action expert over it.

The prefix (camera images through SigLIP, then the prompt with the binned state) is written once
per request with full bidirectional attention; each of the ten Euler steps runs the action
tokens through the action expert, reading the prefix read-only, every robot's step in one batch.
The naive loop that recomputes prefix and suffix at every step is the reference
(`mstar.baselines.pi05.naive_sample_actions`).
"""

from __future__ import annotations

from mstar.zoo.pi05.config import (
    PI05_CONFIGS,
    GemmaConfig,
    Pi05Config,
    VisionConfig,
    get_pi05_config,
)
from mstar.zoo.pi05.modules import ActionInput, Pi05Weights, PrefixInput
from mstar.zoo.pi05.nodes import LLMNode, VisionNode

__all__ = [
    "PI05_CONFIGS",
    "ActionInput",
    "GemmaConfig",
    "LLMNode",
    "Pi05Config",
    "Pi05Weights",
    "PrefixInput",
    "VisionConfig",
    "VisionNode",
    "get_pi05_config",
]
