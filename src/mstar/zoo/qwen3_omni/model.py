"""Qwen3-Omni as an mstar model: a thinker writing, a talker speaking as it writes, Code2Wav voicing
it.

Three partitions run side by side for a request::

    Thinker   prefill_text | prefill_audio = Sequential[audio_encoder, thinker]
              | prefill_vision = Sequential[vision_encoder, thinker]      a walk per prompt segment
              thinker_decode = DynamicLoop(thinker)    the last segment, then the answer: a token
                                                       walk on the engine's loop -> text EMIT
                 └─ thinker_states ~> Talker      FixedChunkPolicy(1): one item per segment / token
    Talker    talker_prefill (one per segment)   the user turns' rows, then the 9 assistant rows
              talker_decode = DynamicLoop(talker) one frame per text item; after the thinker's
                 end, frames until codec EOS (the code predictor draws 15 codes per frame inside)
                 └─ codes ~> Code2Wav              LeftContextChunkPolicy(25, 25)
    Code2Wav  code2wav_chunk                     25 new frames + up to 25 of context -> audio EMIT

The thinker's last answer token is never run (so never spoken), as in transformers. The
talker's walk for the stream's final chunk speaks the rest of the answer to codec EOS inside
the walk (no conductor hop per frame), so the talker partition ends with its stream.

Requests: ``Request("generate", {"prompt_token_ids" | "messages" | "text", "max_tokens",
"temperature", "top_p", "top_k", "repetition_penalty", "seed", "modalities": ["text"] |
["text", "audio"], "speaker" / "voice", "talker_temperature", "max_audio_frames",
"return_codes" (each frame's 16 codes also emitted, as ``latent`` ``talker_codes``), "logprobs"
(0-20 alternatives: each answer token is emitted as a `TokenLogprobs` dict), "audio":
[16 kHz waveforms], "images": [uint8 H x W x 3]})``; message content parts
``{"type": "audio", "audio": waveform}`` and ``{"type": "image", "image": array}`` place media
in a turn. ``Request("speech", {"text" | "messages", "voice"})`` speaks ``text`` (or the last
user turn of ``messages``) as the answer. A ``voice`` / ``speaker`` of "default", or none, is
the config's speaker.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import structlog
import torch
from msgspec import Meta

from mstar.engines.parallel import TensorShard, current_shard
from mstar.errors import CheckpointError, InvalidRequestError
from mstar.graph import (
    EMIT,
    Connection,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    ModelGraph,
    Sequential,
    StreamingGraphEdge,
)
from mstar.runtime.model import (
    EngineType,
    Model,
    PreparedRequest,
    Request,
    SupportsAudioInput,
    SupportsAudioOutput,
    SupportsTextOutput,
)
from mstar.runtime.params import TaskOptions
from mstar.runtime.placement import NodeGroup, Placement
from mstar.streaming import FixedChunkPolicy, LeftContextChunkPolicy
from mstar.zoo.cache import mstar_cache_dir, written_once
from mstar.zoo.hf_checkpoint import checkpoint_dtype
from mstar.zoo.qwen3_omni.checkpoint import (
    RANDOM_INIT_VERSION,
    load_qwen3_omni,
    make_random_checkpoint,
)
from mstar.zoo.qwen3_omni.config import (
    Qwen3OmniConfig,
    config_from_checkpoint,
    get_qwen3_omni_config,
)
from mstar.zoo.qwen3_omni.modules.encoders import audio_token_count
from mstar.zoo.qwen3_omni.modules.weights import NODE_WEIGHTS, Qwen3OmniWeights
from mstar.zoo.qwen3_omni.nodes import (
    AudioEncoderNode,
    Code2WavNode,
    TalkerNode,
    ThinkerNode,
    VisionEncoderNode,
)
from mstar.zoo.qwen3_omni.prompt import MediaInputs, audio_features, image_patches, make_segments
from mstar.zoo.qwen3_omni.tokenizer import AUDIO_PART, IMAGE_PART, CharTokenizer, render_chat
from mstar.zoo.requests import speech_text, speech_voice

__all__ = ["Qwen3OmniModel", "make_qwen3_omni_graph"]

log = structlog.get_logger(__name__)

_PREFILL = {"text": "prefill_text", "audio": "prefill_audio", "image": "prefill_vision"}
_MODALITIES = ("text", "audio")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_qwen3_omni_graph(name: str = "qwen3-omni", chunk_frames: int = 25) -> ModelGraph:
    """Return the thinker -> talker -> Code2Wav graph (see the module docstring)."""
    audio = GraphNode("audio_encoder", {"segments", "cursor"}, [GraphEdge("thinker", "media")])
    vision = GraphNode("vision_encoder", {"segments", "cursor"}, [GraphEdge("thinker", "media")])
    thinker = GraphNode(
        "thinker",
        {"segments", "cursor", "media", "sampling"},
        [
            GraphEdge("thinker", "cursor", persist=True),
            GraphEdge("audio_encoder", "cursor", persist=True),
            GraphEdge("vision_encoder", "cursor", persist=True),
            GraphEdge(EMIT, "text", modality="text"),
            StreamingGraphEdge("talker", "thinker_states"),
        ],
        signals={"stop"},
    )
    talker = GraphNode(
        "talker",
        {"thinker_states", "talker_params"},
        [
            StreamingGraphEdge("code2wav", "codes"),
            GraphEdge(EMIT, "talker_codes", modality="latent"),
        ],
        signals={"stop"},
    )
    code2wav = GraphNode("code2wav", {"codes"}, [GraphEdge(EMIT, "audio", modality="audio")])
    return ModelGraph(
        name=name,
        walks={
            "prefill_text": thinker,
            "prefill_audio": Sequential([audio, thinker]),
            "prefill_vision": Sequential([vision, thinker]),
            "thinker_decode": DynamicLoop(thinker, stop="stop"),
            "talker_prefill": talker,
            "talker_decode": DynamicLoop(talker, stop="stop"),
            "code2wav_chunk": code2wav,
        },
        partitions={
            "Thinker": ["prefill_text", "prefill_audio", "prefill_vision", "thinker_decode"],
            "Talker": ["talker_prefill", "talker_decode"],
            "Code2Wav": ["code2wav_chunk"],
        },
        connections=[
            Connection("Thinker", "Talker", "thinker_states", FixedChunkPolicy(1)),
            Connection(
                "Talker", "Code2Wav", "codes", LeftContextChunkPolicy(chunk_frames, chunk_frames)
            ),
        ],
        inputs={
            "thinker": {"segments", "cursor", "media", "sampling"},
            "audio_encoder": {"segments", "cursor"},
            "vision_encoder": {"segments", "cursor"},
            "talker": {"talker_params"},
        },
    )


@dataclass
class _Plan:
    """A request's walk plan: its prefill walks, whether it speaks, and how far each partition
    got."""

    prefills: list[str]
    num_segments: int
    speaks: bool
    num_thinker_prefills: int = 0
    num_talker_prefills: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Qwen3OmniModel(Model, SupportsTextOutput, SupportsAudioOutput, SupportsAudioInput):
    """Qwen3-Omni (``qwen3-omni-30b-a3b``, ``qwen3-omni-small`` or ``qwen3-omni-tiny``).

    Args:
        config: A config name, a `Qwen3OmniConfig`, or None: the checkpoint's own ``config.json``.
        checkpoint: A directory in the Hugging Face layout (``config.json``, safetensors,
            and for the real model its tokenizer). Without one a config gets random weights,
            written once under the mstar cache; ``qwen3-omni-30b-a3b`` needs it.
        dtype: "float32", "bfloat16" or "auto" (the checkpoint's ``torch_dtype``).
        colocated: Put every node on rank 0 (default: Thinker, Talker and Code2Wav on
            ranks 0, 1 and 2, each stepping on a thread of its own).
        max_tokens: Default answer length (tokens).
        max_audio_frames: Default cap on codec frames per answer.
        max_model_len: Positions of each KV cache.
        codec_batch_size: Most Code2Wav chunks per call (None: every pending chunk of equal
            length on an accelerator, one on a CPU; 1 makes each chunk's samples
            independent of its batch).
        codec_skip_context: Run Code2Wav's ConvNet only over the context frames its kept
            samples read (see `Code2WavNode`; False: the whole chunk, bit-equal to
            transformers' decode).
    """

    audio_sample_rate = 24_000
    system_prompt: str | None = None

    def __init__(
        self,
        config: str | Qwen3OmniConfig | None = "qwen3-omni-tiny",
        *,
        checkpoint: str | None = None,
        dtype: str = "float32",
        colocated: bool = False,
        max_tokens: int | None = None,
        max_audio_frames: int | None = None,
        max_model_len: int = 4096,
        codec_batch_size: int | None = None,
        codec_skip_context: bool = True,
    ) -> None:
        if dtype not in (*_DTYPES, "auto"):
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        if config is None:
            if checkpoint is None:
                raise CheckpointError(
                    "Qwen3-Omni needs a config name or checkpoint= a directory in the "
                    "Hugging Face layout"
                )
            cfg = config_from_checkpoint(checkpoint)
        else:
            cfg = get_qwen3_omni_config(config) if isinstance(config, str) else config
        random = checkpoint is None
        if checkpoint is None:
            if cfg.name == "qwen3-omni-30b-a3b":
                raise CheckpointError(
                    f"{cfg.name} needs checkpoint= a directory in the Hugging Face layout"
                )
            checkpoint = str(_cached_random_checkpoint(cfg))
        path = Path(checkpoint)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"Qwen3-Omni checkpoint {checkpoint!r} has no config.json")
        self.name = cfg.name
        self.config = cfg
        self.checkpoint = str(path)
        if dtype == "auto":
            dtype = checkpoint_dtype(cfg.hf)
        self.dtype = _DTYPES[dtype]
        self.colocated = colocated
        # Random weights answer briefly by default; a checkpoint at the config's length.
        self.max_tokens = max_tokens or (64 if random else cfg.thinker_max_tokens)
        self.max_audio_frames = max_audio_frames or (256 if random else cfg.talker_max_tokens)
        self.max_model_len = max_model_len
        self.codec_batch_size = codec_batch_size
        self.codec_skip_context = codec_skip_context
        self.tokenizer: Any = _load_tokenizer(cfg, path)
        # The character tokenizer of the random-weight configs takes raw prompts.
        self.chat_prompts = (
            not isinstance(self.tokenizer, CharTokenizer)
            and self.tokenizer.chat_template is not None
        )
        self._graph = make_qwen3_omni_graph(cfg.name, cfg.chunk_frames)
        # by device and tensor-parallel shard (rank, world)
        self._weights: dict[tuple[torch.device, TensorShard | None], Qwen3OmniWeights] = {}
        self._loading: dict[Any, threading.Lock] = {}  # ranks load on worker threads
        self._loading_lock = threading.Lock()

    # --- capabilities ------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Return the end-of-turn id."""
        return (self.config.token_id("im_end_token_id"),)

    def detokenize(self, token_ids: list[int]) -> str:
        """Return the text of ``token_ids`` (special tokens dropped)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    # --- the contract ------------------------------------------------------------------------

    def graph(self) -> ModelGraph:
        """Return the thinker -> talker -> Code2Wav graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return KV_CACHE for the thinker and the talker, STATELESS for the encoders and
        Code2Wav."""
        return {
            "thinker": EngineType.KV_CACHE,
            "talker": EngineType.KV_CACHE,
            "audio_encoder": EngineType.STATELESS,
            "vision_encoder": EngineType.STATELESS,
            "code2wav": EngineType.STATELESS,
        }

    def tasks(self) -> tuple[str, ...]:
        """Return ``generate`` (chat, text and speech out) and ``speech`` (speak the given text)."""
        return ("generate", "speech")

    def task_options(self, task: str) -> type[Qwen3OmniOptions]:
        """Both tasks take `Qwen3OmniOptions`."""
        return Qwen3OmniOptions

    def default_placement(self) -> Placement | None:
        """Put the three partitions on ranks 0, 1 and 2, unless ``colocated``."""
        if self.colocated:
            return None
        return Placement(
            (
                NodeGroup(["thinker", "audio_encoder", "vision_encoder"], [0]),
                NodeGroup(["talker"], [1]),
                NodeGroup(["code2wav"], [2]),
            ),
            self._graph.name,
        )

    def load_weights(
        self, device: torch.device, nodes: Iterable[str] | None = None
    ) -> Qwen3OmniWeights:
        """Load the weights ``nodes`` read onto ``device`` (default: every node's).

        One `Qwen3OmniWeights` per device, shared by every node there: each call reads only
        the tensors not loaded there yet (`NODE_WEIGHTS`), so a rank holds the union of its
        nodes' parts, once, and what no node there reads stays on the meta device.
        """
        # A tensor-parallel rank's decoder is its shard (`sharded`, with its group): ranks of one
        # process on one device keep weights of their own.
        key = (device, current_shard())
        with self._loading_lock:
            lock = self._loading.setdefault(key, threading.Lock())
        with lock:
            weights = load_qwen3_omni(
                self.checkpoint, self.config, device=device, dtype=self.dtype, nodes=nodes,
                into=self._weights.get(key),
            )  # fmt: skip
            self._weights[key] = weights
        return weights

    def submodule(self, node: str, device: torch.device) -> Any:
        """Return the node's computation on ``device`` (loading only the weights it reads)."""
        if node not in NODE_WEIGHTS:
            raise KeyError(node)
        weights = self.load_weights(device, [node])
        if node == "thinker":
            return ThinkerNode(weights, self.max_model_len)
        if node == "talker":
            return TalkerNode(weights, self.max_model_len)
        if node == "audio_encoder":
            return AudioEncoderNode(weights)
        if node == "vision_encoder":
            return VisionEncoderNode(weights)
        if node == "code2wav":
            return Code2WavNode(
                weights, self.codec_batch_size, skip_context=self.codec_skip_context
            )
        raise KeyError(node)

    def preprocess(self, request: Request) -> PreparedRequest:
        """Build the prompt (chat template, media placeholders), its segments and the sampling
        settings."""
        if request.task not in ("generate", "speech"):
            raise ValueError(f"task must be 'generate' or 'speech', got {request.task!r}")
        data, params = dict(request.data), request.params
        options = request.options_as(Qwen3OmniOptions)
        forced: list[int] | None = None
        if request.task == "speech":
            text = speech_text(data)
            forced = [
                int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ] + list(self.eos_token_ids)
            data = {**data, "messages": [{"role": "user", "content": text}]}
            data.pop("text", None)
        modalities: list[str] = (
            list(_MODALITIES)
            if request.task == "speech"
            else list(options.modalities or _MODALITIES)
        )
        if "text" not in modalities:  # the options' type holds the rest: "text" and "audio" only
            raise InvalidRequestError(
                f"modalities must be ['text'] or ['text', 'audio'], got {modalities!r}",
                param="modalities",
            )
        speaks = "audio" in modalities
        ids, media = self.prompt(data)
        segments = make_segments(self.config, ids, media)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        thinker_params = params.with_defaults({"temperature": 0.0, "seed": seed})
        sampling = thinker_params.sampling(
            max_tokens=len(forced) if forced else (params.max_tokens or self.max_tokens),
            stop_token_ids=self.eos_token_ids,
            prompt_len=len(ids),
        )
        speaker = speech_voice(data, self.config.speaker)
        speakers = self.config.speaker_ids
        if speaker.lower() not in speakers:
            raise ValueError(f"unknown speaker {speaker!r}; the model has {sorted(speakers)}")
        talker = {
            "seed": int(seed) % 2**63,
            "speaker": speakers[speaker.lower()],
            "max_frames": options.max_audio_frames or self.max_audio_frames,
            "talker_temperature": options.talker_temperature,
            "talker_top_k": options.talker_top_k,
            "talker_top_p": options.talker_top_p,
            "talker_repetition_penalty": options.talker_repetition_penalty,
            "return_codes": options.return_codes,
        }
        inputs: dict[str, dict[str, Any]] = {
            "thinker": {
                "segments": segments,
                "cursor": 0,
                "media": None,
                "sampling": {"params": sampling, "speak": speaks, "forced": forced},
            },
            "audio_encoder": {"segments": segments, "cursor": 0},
            "vision_encoder": {"segments": segments, "cursor": 0},
            "talker": {"talker_params": talker},
        }
        # Every segment but the last is a prefill walk; the last starts the answer's token walk.
        plan = _Plan(
            [_PREFILL[s["kind"]] for s in segments[:-1]],
            len(segments),
            speaks,
            extra={"prompt_len": len(ids)},
        )
        return PreparedRequest(inputs, plan)

    def prompt(self, data: Mapping[str, Any]) -> tuple[list[int], MediaInputs]:
        """Return the prompt ids (placeholders expanded) and its media, in prompt order."""
        audio = [audio_features(self.config, a) for a in data.get("audio") or ()]
        images = [image_patches(self.config, im) for im in data.get("images") or ()]
        if "prompt_token_ids" in data:
            ids = data["prompt_token_ids"]
            if (
                not isinstance(ids, Sequence)
                or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            ):
                raise ValueError("prompt_token_ids must be a non-empty list of integers")
            return [int(i) for i in ids], MediaInputs(tuple(audio), tuple(images))
        messages = data.get("messages")
        for key in ("text", "prompt"):
            if key in data:
                question = data[key]
                if not isinstance(question, str) or not question.strip():
                    raise ValueError(f"{key} must be a non-empty string")
                messages = [{"role": "user", "content": question}]
        if not isinstance(messages, list) or not messages:
            raise ValueError("a request needs prompt_token_ids, messages or text")
        for message in messages:  # media given inside content parts, in order
            content = message.get("content") if isinstance(message, Mapping) else None
            for part in content if isinstance(content, list) else ():
                if part.get("type") == "audio":
                    audio.append(audio_features(self.config, part["audio"]))
                elif part.get("type") == "image":
                    images.append(image_patches(self.config, part["image"]))
        rendered = render_chat(messages)
        n_window = int(self.config.thinker_hf["audio_config"].get("n_window", 50))
        merge = int(self.config.thinker_hf["vision_config"].get("spatial_merge_size", 2))
        pieces = rendered.split(AUDIO_PART)
        if len(pieces) - 1 != len(audio):
            raise ValueError(
                f"the messages place {len(pieces) - 1} audio inputs but {len(audio)} were given"
            )
        text = pieces[0]
        for feats, rest in zip(audio, pieces[1:], strict=True):
            n = audio_token_count(int(feats.shape[1]), n_window)
            text += "<|audio_start|>" + "<|audio_pad|>" * n + "<|audio_end|>" + rest
        pieces = text.split(IMAGE_PART)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"the messages place {len(pieces) - 1} images but {len(images)} were given"
            )
        text = pieces[0]
        for (_, (t, h, w)), rest in zip(images, pieces[1:], strict=True):
            text += (
                "<|vision_start|>"
                + "<|image_pad|>" * (t * h * w // merge**2)
                + "<|vision_end|>"
                + rest
            )
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        return ids, MediaInputs(tuple(audio), tuple(images))

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Thinker: its first prefill; Talker and Code2Wav: theirs, when the answer is spoken."""
        plan: _Plan = state
        if partition == "Thinker":
            return plan.prefills[0] if plan.prefills else "thinker_decode"
        if not plan.speaks:
            return None
        return "talker_prefill" if partition == "Talker" else "code2wav_chunk"

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Thinker: prefills in prompt order, then decode; Talker: a prefill per segment, then
        decode."""
        plan: _Plan = state
        if partition == "Thinker":
            if finished == "thinker_decode":
                return None
            plan.num_thinker_prefills += 1
            done = plan.num_thinker_prefills
            return plan.prefills[done] if done < len(plan.prefills) else "thinker_decode"
        if partition == "Talker":
            if finished == "talker_prefill":
                plan.num_talker_prefills += 1
                if plan.num_talker_prefills < plan.num_segments:
                    return "talker_prefill"
            return "talker_decode"  # one walk per stream chunk; the stream's end ends the partition
        return "code2wav_chunk"


class Qwen3OmniOptions(TaskOptions, frozen=True, kw_only=True):
    """What a Qwen3-Omni request takes beyond `GenerationParams`: the talker's own sampling.

    Attributes:
        modalities: ``["text"]`` or ``["text", "audio"]`` (the default: it speaks).
        max_audio_frames: Codec frames the talker makes at most (default: the model's).
        talker_temperature: The talker's sampling temperature.
        talker_top_k: Its top-k.
        talker_top_p: Its top-p.
        talker_repetition_penalty: Its repetition penalty.
        return_codes: Also emit the talker's codec codes.
    """

    modalities: list[Literal["text", "audio"]] | None = None
    max_audio_frames: Annotated[int, Meta(ge=1)] | None = None
    talker_temperature: Annotated[float, Meta(ge=0.0)] = 0.9
    talker_top_k: Annotated[int, Meta(ge=0)] = 50
    talker_top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    talker_repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.05
    return_codes: bool = False


def _load_tokenizer(cfg: Qwen3OmniConfig, path: Path) -> Any:
    """Return the checkpoint's tokenizer when it ships one, else the character tokenizer."""
    if (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    return CharTokenizer(cfg)


def _cached_random_checkpoint(cfg: Qwen3OmniConfig) -> Path:
    """Return random weights for ``cfg`` under the cache, writing them once (keyed by its
    values)."""
    digest = hashlib.sha256(json.dumps(cfg.hf, sort_keys=True).encode()).hexdigest()[:12]
    return written_once(
        mstar_cache_dir() / "qwen3_omni" / f"{cfg.name}-{RANDOM_INIT_VERSION}-{digest}",
        lambda folder: make_random_checkpoint(cfg, folder, seed=0),
        label=f"random {cfg.name} weights",
    )
