"""All of Qwen3-Omni's weights in one module tree, named as the checkpoint below its prefixes.

```
ours                       checkpoint                    what
thinker_text.model.*       thinker.model.*               thinker text model (paged, `MoEDecoder`)
thinker_text.lm_head       thinker.lm_head               text head
audio_tower.*              thinker.audio_tower.*         transformers' Qwen3OmniMoeAudioEncoder (AuT)
visual.*                   thinker.visual.*              transformers' Qwen3OmniMoeVisionEncoder (DeepStack)
talker_text.model.*        talker.model.*                talker (paged, `MoEDecoder` with a shared expert)
talker_text.codec_head     talker.codec_head             codebook-0 head
text_projection.*          talker.text_projection.*      thinker embeddings -> talker
hidden_projection.*        talker.hidden_projection.*    thinker hidden states (multimodal) -> talker
code_predictor.*           talker.code_predictor.*       codebooks 1..15
code2wav.*                 code2wav.*                    transformers' Qwen3OmniMoeCode2Wav
```

The encoders and Code2Wav are stateless; transformers' modules run them unchanged (parity by
construction, checked by the tests). MoE experts are fused in memory (``experts.gate_up_proj``,
``experts.down_proj``); `mstar.zoo.qwen3_omni.checkpoint` stacks per-expert checkpoints.

Each graph node reads a known part of the tree (`NODE_WEIGHTS`), so a rank loads only its
nodes' parts; the rest stays on the meta device and is never touched. The talker reads one
tensor of the thinker's: its token embedding, for the ``tts_bos`` / ``tts_eos`` / ``tts_pad``
rows it projects (the thinker streams every other embedding it needs)::

    node             reads
    thinker          thinker_text.*
    audio_encoder    audio_tower.*
    vision_encoder   visual.*
    talker           talker_text.*  text_projection.*  hidden_projection.*  code_predictor.*
                     thinker_text.model.embed_tokens.weight
    code2wav         code2wav.*
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig
from mstar.zoo.qwen3_omni.modules.code_predictor import CodePredictor
from mstar.zoo.qwen3_omni.modules.talker import ResizeMLP
from mstar.zoo.qwen3_omni.modules.text import MoEDecoder

__all__ = [
    "NODE_WEIGHTS",
    "Qwen3OmniWeights",
    "make_audio_encoder",
    "make_code2wav",
    "make_vision_encoder",
    "node_weight_names",
]

NODE_WEIGHTS: Mapping[str, tuple[str, ...]] = {
    "thinker": ("thinker_text.",),
    "audio_encoder": ("audio_tower.",),
    "vision_encoder": ("visual.",),
    "talker": (
        "talker_text.",
        "text_projection.",
        "hidden_projection.",
        "code_predictor.",
        "thinker_text.model.embed_tokens.weight",
    ),
    "code2wav": ("code2wav.",),
}
"""The parameters each graph node reads: names of `Qwen3OmniWeights`, by prefix or in full."""


def node_weight_names(weights: nn.Module, nodes: Iterable[str] | None = None) -> list[str]:
    """Return the parameter names of ``weights`` that ``nodes`` read (None: every node's).

    Raises:
        KeyError: An unknown node.
    """
    chosen = list(NODE_WEIGHTS) if nodes is None else list(nodes)
    unknown = [n for n in chosen if n not in NODE_WEIGHTS]
    if unknown:
        raise KeyError(
            f"Qwen3-Omni has no node {unknown[0]!r}; its nodes: {', '.join(NODE_WEIGHTS)}"
        )
    prefixes = tuple(p for n in chosen for p in NODE_WEIGHTS[n])
    return [name for name, _ in weights.named_parameters() if name.startswith(prefixes)]


def _hf_modules() -> Any:
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe

    return modeling_qwen3_omni_moe


def make_audio_encoder(config: Qwen3OmniConfig) -> nn.Module:
    """Build transformers' audio encoder for ``config`` (uninitialised weights)."""
    hf = config.make_hf_config()
    return _hf_modules().Qwen3OmniMoeAudioEncoder._from_config(hf.thinker_config.audio_config)


def make_vision_encoder(config: Qwen3OmniConfig) -> nn.Module:
    """Build transformers' vision encoder for ``config`` (uninitialised weights)."""
    hf = config.make_hf_config()
    return _hf_modules().Qwen3OmniMoeVisionEncoder._from_config(hf.thinker_config.vision_config)


def make_code2wav(config: Qwen3OmniConfig) -> nn.Module:
    """Build transformers' Code2Wav for ``config`` (uninitialised weights)."""
    hf = config.make_hf_config()
    return _hf_modules().Qwen3OmniMoeCode2Wav._from_config(hf.code2wav_config)


class Qwen3OmniWeights(nn.Module):
    """Every component of the model (see the module docstring)."""

    def __init__(self, config: Qwen3OmniConfig) -> None:
        super().__init__()
        self.config = config
        thinker, talker = config.thinker_text, config.talker_text
        self.thinker_text = MoEDecoder(thinker, capture_layer=config.accept_hidden_layer)
        self.audio_tower = make_audio_encoder(config)
        self.visual = make_vision_encoder(config)
        self.talker_text = MoEDecoder(
            talker, embedding_name="codec_embedding", head_name="codec_head", shard_head=False
        )
        inner = talker.intermediate_size
        self.text_projection = ResizeMLP(thinker.hidden_size, inner, talker.hidden_size)
        self.hidden_projection = ResizeMLP(thinker.hidden_size, inner, talker.hidden_size)
        self.code_predictor = CodePredictor(config.code_predictor)
        self.code2wav = make_code2wav(config)

    def to_device_tables(self) -> Qwen3OmniWeights:
        """Move the derived rotary tables next to the weights (after ``.to(device)``).

        A decoder whose head is not loaded here (on the meta device) keeps its tables.
        """
        for decoder in (self.thinker_text, self.talker_text):
            if not decoder.head.weight.is_meta:
                decoder.to_device_tables()
        return self
