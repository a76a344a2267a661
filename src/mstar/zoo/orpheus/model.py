"""Orpheus TTS as an mstar model: a Llama speech LM streaming audio tokens into SNAC.

Partition ``LLM`` (KV cache): ``prefill`` samples the first audio token from the prompt;
``decode`` is a `DynamicLoop` over the LLM (the engine's decode loop) until end of speech
or ``max_tokens``. Every sampled token streams to partition ``SNAC`` through
`SlidingWindowChunkPolicy(28, 7)`; walk ``snac_chunk`` fires per window, decodes it (many
requests' windows in one codec call) and emits the new frames' 24 kHz samples. The codec's
per-request progress (`AudioStreamState`) persists from chunk to chunk, so the final chunk
flushes the tail: every generated frame is emitted exactly once.

Request: ``Request("speech", {"text": ... (or "messages": the last user turn is spoken), "voice":
"tara" ("default" or none: `DEFAULT_VOICE`), "max_tokens": ..., "temperature":
..., "top_p": ..., "repetition_penalty": ..., "seed": ...})``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import structlog
import torch

from mstar.engines.interfaces import KVTurn
from mstar.engines.kv_engine import KVCacheEngineConfig
from mstar.errors import CheckpointError
from mstar.graph import (
    EMIT,
    Connection,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    ModelGraph,
    StreamingGraphEdge,
)
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request, SupportsAudioOutput
from mstar.streaming import Chunk, SlidingWindowChunkPolicy
from mstar.zoo.cache import mstar_cache_dir, written_once
from mstar.zoo.hf_checkpoint import DTYPES
from mstar.zoo.llama import LlamaCausalLM
from mstar.zoo.llm import history_turn
from mstar.zoo.orpheus.audio import SAMPLE_RATE
from mstar.zoo.orpheus.checkpoint import (
    load_orpheus_codec,
    load_orpheus_llm,
    make_random_checkpoint,
)
from mstar.zoo.orpheus.codec import SnacCodec
from mstar.zoo.orpheus.config import (
    OrpheusConfig,
    TokenLayout,
    config_from_checkpoint,
    get_orpheus_config,
)
from mstar.zoo.orpheus.constrained import AudioLogitsProcessor
from mstar.zoo.orpheus.stream import AudioStreamState, decode_chunks
from mstar.zoo.orpheus.tokens import DEFAULT_VOICE, OrpheusTokenizer
from mstar.zoo.requests import speech_text, speech_voice

__all__ = ["OrpheusModel", "make_orpheus_graph"]

log = structlog.get_logger(__name__)


def make_orpheus_graph() -> ModelGraph:
    """Return Orpheus' graph: LLM prefill/decode streaming 28/7 windows into SNAC."""
    llm = GraphNode(
        "LLM",
        {"history", "params"},
        [GraphEdge("LLM", "history", persist=True), StreamingGraphEdge("snac_decoder", "tokens")],
        signals={"stop"},
    )
    snac = GraphNode(
        "snac_decoder",
        {"tokens", "state"},
        [
            GraphEdge(EMIT, "audio", modality="audio"),
            GraphEdge("snac_decoder", "state", persist=True),
        ],
    )
    return ModelGraph(
        name="orpheus",
        walks={"prefill": llm, "decode": DynamicLoop(llm, stop="stop"), "snac_chunk": snac},
        partitions={"LLM": ["prefill", "decode"], "SNAC": ["snac_chunk"]},
        connections=[Connection("LLM", "SNAC", "tokens", SlidingWindowChunkPolicy(28, 7))],
        inputs={"LLM": {"history", "params"}, "snac_decoder": {"state"}},
    )


class OrpheusLLMNode:
    """The ``LLM`` node: the speech LM on the paged KV cache."""

    def __init__(
        self, model: LlamaCausalLM, engine_config: KVCacheEngineConfig, config: OrpheusConfig
    ) -> None:
        self.model = model
        self.engine_config = engine_config
        self.layout = config.layout
        self.constrained = config.constrained

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        """Generate what is left of ``max_tokens`` (the history rebuilds an empty cache).

        End of speech may close the run only where it stops the request: with ``ignore_eos``
        (no stop ids) it is masked, so the request runs to ``max_tokens``.
        """
        params = inputs["params"]
        processor = (
            AudioLogitsProcessor(
                self.layout,
                params.prompt_len,
                allow_end=self.layout.end_of_speech in params.stop_token_ids,
            )
            if self.constrained and is_first
            else None
        )
        return history_turn(inputs, is_first, logits_processor=processor)

    def outputs(
        self, request_id: str, token_id: int, history: list[int] | None
    ) -> Mapping[str, Any]:
        """Stream the token to the codec; on the walk's last one raise ``stop``, persist the
        history."""
        if history is None:
            return {"tokens": token_id, "stop": False}
        return {"tokens": token_id, "stop": True, "history": torch.tensor(history)}


class SnacNode:
    """The ``snac_decoder`` node: one batched codec call for every request's chunk
    (`SupportsConcurrentCalls`: the codec keeps no state between calls)."""

    supports_concurrent_calls: ClassVar[Literal[True]] = True

    def __init__(self, codec: SnacCodec, layout: TokenLayout, max_batch_size: int | None) -> None:
        self.codec, self.layout, self.max_batch_size = codec, layout, max_batch_size

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Decode each request's chunk; a request with invalid tokens raises (and fails alone)."""
        work = [(_state_from(x["state"]), _ints(x["tokens"])) for x in batch]
        results = decode_chunks(self.codec, self.layout, work, max_batch_size=self.max_batch_size)
        for r in results:
            if r.error is not None:
                raise r.error
        return [{"audio": r.audio, "state": dataclasses.asdict(r.state)} for r in results]


def _ints(chunk: Chunk[Any]) -> Chunk[int]:
    return Chunk(tuple(int(t) for t in chunk.items), chunk.start, chunk.context_len, chunk.is_last)


def _state_from(value: Mapping[str, Any]) -> AudioStreamState:
    return AudioStreamState(**{**value, "codes": tuple(value["codes"])})


class OrpheusModel(Model, SupportsAudioOutput):
    """Orpheus TTS (``orpheus-3b``, ``orpheus-small`` or ``orpheus-tiny``).

    Args:
        config: A config name, an `OrpheusConfig`, or None: read from the checkpoints' own
            ``config.json`` files (`config_from_checkpoint`).
        checkpoint: HF Llama checkpoint directory of the speech LM.
        snac_dir: SNAC checkpoint directory.
        dtype: The LM's weights: "float32", "bfloat16", "float16", "auto" (its ``torch_dtype``);
            None: float32 on a CPU, the checkpoint's on CUDA. SNAC runs in float32.
        constrained: Mask logits to the audio ids valid per frame position (default: the
            config's; on for the random-weight configs).
        engine_config: `KVCacheEngineConfig` fields for the LLM.
        codec_batch_size: Most windows per codec call (batching helps on GPUs, not on 2 CPU cores).

    Without checkpoint directories the small configs get random weights, generated once in
    the real formats under the mstar cache; ``orpheus-3b`` needs its directories.
    """

    audio_sample_rate = SAMPLE_RATE

    def __init__(
        self,
        config: str | OrpheusConfig | None = "orpheus-tiny",
        *,
        checkpoint: str | None = None,
        snac_dir: str | None = None,
        dtype: str | None = None,
        constrained: bool | None = None,
        engine_config: Mapping[str, Any] | None = None,
        codec_batch_size: int | None = 4,
    ) -> None:
        if dtype not in (None, "auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        if config is None:
            if checkpoint is None or snac_dir is None:
                raise CheckpointError(
                    "Orpheus needs a config name, or checkpoint= (the speech LM) and snac_dir="
                )
            cfg = config_from_checkpoint(checkpoint, snac_dir)
        elif isinstance(config, str):
            cfg = get_orpheus_config(config, llm_dir=checkpoint, snac_dir=snac_dir)
        else:
            cfg = (
                config
                if checkpoint is None and snac_dir is None
                else config.with_checkpoints(str(checkpoint), str(snac_dir))
            )
        if cfg.llm_dir is None and cfg.name != "orpheus-3b":
            cfg = _cached_random_checkpoint(cfg)
        cfg.require_checkpoints()
        if constrained is not None:
            cfg = dataclasses.replace(cfg, constrained=constrained)
        self.name = cfg.name
        self.config = cfg
        if dtype == "auto":
            dtype = cfg.llm.torch_dtype or "float32"
        self.dtype = getattr(torch, dtype) if dtype else None
        # Prompt plus Orpheus' longest generation fit in 4096 positions; size the cache for that.
        self.engine_config = KVCacheEngineConfig(
            **{"max_model_len": 4096, **dict(engine_config or {})}
        )
        self.codec_batch_size = codec_batch_size
        self.tokenizer = OrpheusTokenizer(cfg.layout)
        self._graph = make_orpheus_graph()

    def graph(self) -> ModelGraph:
        """Return the LLM -> SNAC graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return KV_CACHE for the LLM, STATELESS for the codec."""
        return {"LLM": EngineType.KV_CACHE, "snac_decoder": EngineType.STATELESS}

    def tasks(self) -> tuple[str, ...]:
        """Return the one task."""
        return ("speech",)

    def submodule(self, node: str, device: torch.device) -> Any:
        """Load the LLM or the codec onto ``device``."""
        if node == "LLM":
            llm = load_orpheus_llm(self.config, device=device, dtype=self.dtype)
            return OrpheusLLMNode(llm, self.engine_config, self.config)
        if node == "snac_decoder":
            codec = load_orpheus_codec(self.config, device=device)
            return SnacNode(codec, self.config.layout, self.codec_batch_size)
        raise KeyError(node)

    def preprocess(self, request: Request) -> PreparedRequest:
        """Format the prompt; collect sampling settings (Orpheus' defaults otherwise)."""
        if request.task != "speech":
            raise ValueError(f"task must be 'speech', got {request.task!r}")
        data = request.data
        prompt = self.tokenizer.format_prompt(speech_text(data), speech_voice(data, DEFAULT_VOICE))
        cfg = self.config
        params = request.params.with_defaults(
            {
                "temperature": cfg.temperature,
                "top_p": cfg.top_p,
                "repetition_penalty": cfg.repetition_penalty,
            }
        )
        max_tokens = params.max_tokens if params.max_tokens is not None else cfg.max_tokens
        sampling = params.sampling(
            max_tokens=max_tokens,
            stop_token_ids=(self.config.layout.end_of_speech,),
            prompt_len=len(prompt),
        )
        seed = params.seed or 0
        state = dataclasses.asdict(AudioStreamState(noise_seed=cfg.noise_seed + seed))
        inputs: dict[str, dict[str, Any]] = {
            "LLM": {"history": torch.tensor(prompt), "params": sampling},
            "snac_decoder": {"state": state},
        }
        return PreparedRequest(inputs)

    def first_walk(self, partition: str, state: Any) -> str | None:
        """LLM starts with prefill; SNAC with a chunk."""
        return "prefill" if partition == "LLM" else "snac_chunk"

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """LLM: decode after prefill, then done; SNAC: one walk per chunk until the stream ends."""
        if partition == "LLM":
            return "decode" if finished == "prefill" else None
        return "snac_chunk"


def _cached_random_checkpoint(cfg: OrpheusConfig) -> OrpheusConfig:
    """Return ``cfg`` pointing at random weights under the cache, writing them once (keyed by its
    values)."""
    digest = hashlib.sha256(
        repr((cfg.llm, cfg.snac, cfg.layout, cfg.initializer_range)).encode()
    ).hexdigest()[:12]
    root = written_once(
        mstar_cache_dir() / "orpheus" / f"{cfg.name}-{digest}",
        lambda folder: make_random_checkpoint(cfg, folder, seed=0),
        label=f"random {cfg.name} weights",
    )
    return cfg.with_checkpoints(root / "llm", root / "snac")
