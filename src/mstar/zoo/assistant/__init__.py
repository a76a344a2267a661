"""`assistant`: SmolLM2-135M-Instruct streaming its answer, sentence by sentence, to a Piper
voice."""

from __future__ import annotations

from mstar.zoo.assistant.model import AssistantModel, VoiceNode, make_assistant_graph
from mstar.zoo.assistant.sentences import SentenceChunkPolicy
from mstar.zoo.assistant.voice import PiperSpeaker, VoiceSettings

__all__ = [
    "AssistantModel",
    "PiperSpeaker",
    "SentenceChunkPolicy",
    "VoiceNode",
    "VoiceSettings",
    "make_assistant_graph",
]
