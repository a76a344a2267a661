"""`assistant`: SmolLM2 writes the answer, a Piper voice speaks it while it is being written.

Partition ``LLM`` (KV cache): SmolLM2-135M-Instruct's ``prefill`` and ``decode`` walks, as
the ``llama`` model runs them; every sampled token is emitted as text (with its
log-probabilities when asked) and its id streams to partition ``Voice`` through
`SentenceChunkPolicy`, which fires on sentence (or clause)
boundaries of the token stream. Walk ``speak`` (stateless engine) detokenizes each chunk and
emits its 22,050 Hz speech. By default the partitions sit on ranks 0 and 1, so the voice
speaks one sentence while the LLM writes the next.

Request: ``Request("generate", {"text": str} | {"messages": [...]} | {"prompt_token_ids":
[...]}, plus sampling keys (max_tokens, temperature, top_p, top_k, repetition_penalty, seed)
and ``modalities``: ["text", "audio"] (default) or ["text"] (the voice does not run)})``.

``Request("speech", {"text": str} | {"messages": [...]}, "voice": "joe" | "default"})`` reads
the text (or the last user turn) aloud without the LLM: partition ``Reader``'s walk ``read``
speaks it whole with the same voice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mstar.engines.sampler import TokenLogprobs
from mstar.graph import (
    EMIT,
    Connection,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    ModelGraph,
    StreamingGraphEdge,
)
from mstar.runtime.model import (
    EngineType,
    Model,
    PreparedRequest,
    Request,
    SupportsAudioOutput,
    SupportsTextOutput,
)
from mstar.runtime.placement import NodeGroup, Placement
from mstar.streaming import Chunk
from mstar.zoo.assistant.sentences import SentenceChunkPolicy
from mstar.zoo.assistant.voice import PiperSpeaker, VoiceSettings
from mstar.zoo.llama import load_llama
from mstar.zoo.llm import LlamaKVNode, TextLLM
from mstar.zoo.requests import speech_text, speech_voice

__all__ = [
    "VOICE",
    "AssistantLLMNode",
    "AssistantModel",
    "ReaderNode",
    "VoiceNode",
    "make_assistant_graph",
]

SYSTEM_PROMPT = "You are a helpful assistant. Answer in a few short, clear sentences."
VOICE = "joe"
"""The name of the assistant's one voice (`en_US-joe-medium`)."""
_MODALITIES = ("text", "audio")
_READ, _SPOKEN, _WRITTEN = "read", "spoken", "written"  # what a request does: its walk plan


def make_assistant_graph(policy: SentenceChunkPolicy) -> ModelGraph:
    """Return the assistant's graph: the LLM's tokens emitted as text and streamed to the voice;
    beside them, the reader (speech requests: a given text read aloud)."""
    llm = GraphNode(
        "llm",
        {"history", "params", "prefix_group"},
        [
            GraphEdge("llm", "history", persist=True),
            GraphEdge(EMIT, "tokens", modality="text"),
            StreamingGraphEdge("voice", "say"),
        ],
        signals={"stop"},
    )
    voice = GraphNode("voice", {"say"}, [GraphEdge(EMIT, "audio", modality="audio")])
    reader = GraphNode("reader", {"text"}, [GraphEdge(EMIT, "audio", modality="audio")])
    return ModelGraph(
        name="assistant",
        walks={
            "prefill": llm,
            "decode": DynamicLoop(llm, stop="stop"),
            "speak": voice,
            "read": reader,
        },
        partitions={"LLM": ["prefill", "decode"], "Voice": ["speak"], "Reader": ["read"]},
        connections=[Connection("LLM", "Voice", "say", policy)],
        inputs={"llm": {"history", "params", "prefix_group"}, "reader": {"text"}},
    )


class AssistantLLMNode(LlamaKVNode):
    """The ``llm`` node: SmolLM2 as the ``llama`` model runs it, also streaming each token id."""

    def outputs(
        self,
        request_id: str,
        token_id: int,
        history: list[int] | None,
        *,
        logprobs: TokenLogprobs | None = None,
    ) -> Mapping[str, Any]:
        """Emit the token (as text) and stream its id to the voice (``say``)."""
        out = super().outputs(request_id, token_id, history, logprobs=logprobs)
        return {**out, "say": token_id}


class VoiceNode:
    """The ``voice`` node: speak each request's chunk of tokens (one after another)."""

    def __init__(self, tokenizer: Any, speaker: PiperSpeaker) -> None:
        self.tokenizer, self.speaker = tokenizer, speaker

    def text(self, chunk: Chunk[Any]) -> str:
        """Return the text of a chunk's new tokens (special tokens dropped)."""
        ids = [int(t) for t in chunk.new_items]
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)) if ids else ""

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Return each chunk's samples; a chunk that cannot be spoken fails its request alone."""
        return [{"audio": torch.from_numpy(self.speaker.speak(self.text(x["say"])))} for x in batch]


class ReaderNode:
    """The ``reader`` node: read each speech request's text aloud, whole."""

    def __init__(self, speaker: PiperSpeaker) -> None:
        self.speaker = speaker

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Return each request's samples."""
        return [{"audio": torch.from_numpy(self.speaker.speak(str(x["text"])))} for x in batch]


class AssistantModel(Model, SupportsTextOutput, SupportsAudioOutput):
    """SmolLM2-135M-Instruct answering through a Piper voice.

    Args:
        system_prompt: The system message put before a conversation that has none.
        max_tokens: Default answer length.
        chunk_max_tokens: Most tokens the voice waits for before it speaks a clause.
        noise_scale, noise_w_scale, length_scale: Voice settings (None: the voice's own);
            0 and 0 make speech a pure function of the text.
        voice_threads: onnxruntime threads of the voice.
        colocated: Put both partitions on rank 0 (default: voice on rank 1, side by side).
        engine_config: `KVCacheEngineConfig` fields for the LLM.
    """

    def __init__(
        self,
        *,
        system_prompt: str = SYSTEM_PROMPT,
        max_tokens: int = 160,
        chunk_max_tokens: int = 48,
        noise_scale: float | None = None,
        noise_w_scale: float | None = None,
        length_scale: float | None = None,
        voice_threads: int = 1,
        colocated: bool = False,
        engine_config: Mapping[str, Any] | None = None,
    ) -> None:
        from mstar.zoo.smollm2 import smollm2_checkpoint_dir

        self.name = "assistant"
        self.llm = TextLLM(
            smollm2_checkpoint_dir(),
            name="assistant",
            engine_config={"max_model_len": 2048, **dict(engine_config or {})},
        )
        self.tokenizer, self.chat_prompts = self.llm.tokenizer, self.llm.chat_prompts
        self.system_prompt, self.max_tokens, self.colocated = system_prompt, max_tokens, colocated
        self.voice_settings = VoiceSettings(noise_scale, noise_w_scale, length_scale, voice_threads)
        self.policy = SentenceChunkPolicy.for_tokenizer(self.tokenizer, max_tokens=chunk_max_tokens)
        self._graph = make_assistant_graph(self.policy)
        self.audio_sample_rate = _voice_sample_rate()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Return SmolLM2's end-of-turn ids."""
        return self.llm.eos_token_ids

    def detokenize(self, token_ids: list[int]) -> str:
        """Return the text of ``token_ids``."""
        return self.llm.detokenize(token_ids)

    def graph(self) -> ModelGraph:
        """Return the LLM -> voice graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return KV_CACHE for the LLM, STATELESS for the voice."""
        return {
            "llm": EngineType.KV_CACHE,
            "voice": EngineType.STATELESS,
            "reader": EngineType.STATELESS,
        }

    def tasks(self) -> tuple[str, ...]:
        """Return ``generate`` (an answer, written and spoken) and ``speech`` (a text read
        aloud)."""
        return ("generate", "speech")

    def default_placement(self) -> Placement | None:
        """Put the voice and the reader on rank 1 (their own step thread), unless ``colocated``."""
        if self.colocated:
            return None
        return Placement(
            (NodeGroup(["llm"], [0]), NodeGroup(["voice", "reader"], [1])), self._graph.name
        )

    def submodule(self, node: str, device: torch.device) -> Any:
        """Load SmolLM2 or the voice."""
        if node == "llm":
            llm = self.llm
            weights = load_llama(llm.checkpoint_dir, device=device, dtype=llm.dtype)
            return AssistantLLMNode(weights, llm.engine_config)
        if node == "voice":
            return VoiceNode(self.tokenizer, PiperSpeaker(settings=self.voice_settings))
        if node == "reader":
            return ReaderNode(PiperSpeaker(settings=self.voice_settings))
        raise KeyError(node)

    def preprocess(self, request: Request) -> PreparedRequest:
        """Put the question in a conversation with the system prompt; tokenize it with the chat
        template."""
        if request.task == "speech":
            voice = speech_voice(request.data, VOICE)
            if voice != VOICE:
                raise ValueError(
                    f"unknown voice {voice!r}: the assistant speaks with one voice, "
                    f"{VOICE!r} (or 'default')"
                )
            return PreparedRequest({"reader": {"text": speech_text(request.data)}}, state=_READ)
        if request.task != "generate":
            raise ValueError(f"task must be 'generate' or 'speech', got {request.task!r}")
        data = dict(request.data)
        modalities = data.pop("modalities", None) or list(_MODALITIES)
        if (
            not isinstance(modalities, list | tuple)
            or "text" not in modalities
            or any(m not in _MODALITIES for m in modalities)
        ):
            raise ValueError(
                f"modalities must be ['text'] or ['text', 'audio'], got {modalities!r}"
            )
        for key in ("text", "prompt"):
            if key in data:
                question = data.pop(key)
                if not isinstance(question, str) or not question.strip():
                    raise ValueError(f"{key} must be a non-empty string")
                data["messages"] = [{"role": "user", "content": question}]
        messages = data.get("messages")
        if (
            isinstance(messages, list)
            and self.system_prompt
            and not any(isinstance(m, Mapping) and m.get("role") == "system" for m in messages)
        ):
            data["messages"] = [{"role": "system", "content": self.system_prompt}, *messages]
        # Sampling the request leaves unset is SmolLM2's own (its checkpoint's
        # generation_config.json).
        params = request.params.with_defaults({"max_tokens": self.max_tokens})
        prepared = self.llm.preprocess(Request("generate", data, request.request_id, params=params))
        return PreparedRequest(
            prepared.inputs, state=_SPOKEN if "audio" in modalities else _WRITTEN
        )

    def first_walk(self, partition: str, state: Any) -> str | None:
        """LLM: prefill; Voice: speak, when audio was asked for; Reader: read, for a speech
        request."""
        if state == _READ:
            return "read" if partition == "Reader" else None
        if partition == "LLM":
            return "prefill"
        return "speak" if partition == "Voice" and state == _SPOKEN else None

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """LLM: decode after prefill, then done; Voice: one walk per chunk until the stream ends;
        Reader: done."""
        if partition == "LLM":
            return "decode" if finished == "prefill" else None
        return "speak" if partition == "Voice" else None


def _voice_sample_rate() -> int:
    import json

    from mstar.zoo.assistant.voice import default_voice_paths

    _, config_path = default_voice_paths()
    return int(json.loads(config_path.read_text(encoding="utf-8"))["audio"]["sample_rate"])
