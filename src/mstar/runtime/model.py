"""The model contract: what a composite model supplies so the runtime can serve it.

A model is its graph and walks, the engine type of each node, a factory for each node's
computation, request pre- and post-processing, and the per-request walk state machine.
Nothing model-specific lives in the runtime.

What a model offers beyond that base contract is declared, never probed: each capability is a
``Supports*`` protocol below, which a model class inherits (``class MyLLM(Model,
SupportsTextOutput)``), and callers ask the matching ``supports_*()`` function before using it.

The capabilities, in one place:

| capability | declared by | checked with |
|---|---|---|
| a tokenizer and text output | `SupportsTextOutput` (the model) | `supports_text_output` |
| audio output | `SupportsAudioOutput` (the model) | `supports_audio_output` |
| audio input (user turns that speak) | `SupportsAudioInput` (the model) | `supports_audio_input` |
| an action policy (openpi's WebSocket protocol) | `SupportsActionPolicy` (the model) | `supports_action_policy` |
| several nodes on one engine (one KV cache) | `SupportsSharedEngines` (the model) | `supports_shared_engines` |
| narrowed logits | `SupportsNarrowLogits` (a node's `PagedModel`) | `supports_narrow_logits` |
| positions of its own (step chunks on decode steps too) | `SupportsStepChunks` (a node's `PagedModel`) | `supports_step_chunks` |
| its own (native) decode loop | a `KVNode` (token walks) | `supports_token_walks` |
| forward firings, per-request node state | `ForwardKVNode` (``forward_walks = True``; `release`) | `supports_forward_walks` |

The last four live with the engines that use them (`mstar.engines`) and are re-exported here.
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

import enum
import importlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Literal,
    Protocol,
    TypeGuard,
    TypeVar,
    runtime_checkable,
)

import torch

from mstar.engines.interfaces import (
    ForwardKVNode,
    KVNode,
    SupportsNarrowLogits,
    SupportsStepChunks,
    supports_forward_walks,
    supports_narrow_logits,
    supports_step_chunks,
    supports_token_walks,
)
from mstar.errors import ModelLoadError
from mstar.graph import Emission, ModelGraph
from mstar.runtime.params import GenerationParams, TaskOptions, parse_struct

if TYPE_CHECKING:
    from mstar.runtime.placement import Placement

__all__ = [
    "EngineType",
    "ForwardKVNode",
    "KVNode",
    "Model",
    "ModelSpec",
    "Output",
    "PreparedRequest",
    "Request",
    "SupportsActionPolicy",
    "SupportsAudioInput",
    "SupportsAudioOutput",
    "SupportsNarrowLogits",
    "SupportsSharedEngines",
    "SupportsStepChunks",
    "SupportsTextOutput",
    "supports_action_policy",
    "supports_audio_input",
    "supports_audio_output",
    "supports_forward_walks",
    "supports_narrow_logits",
    "supports_shared_engines",
    "supports_step_chunks",
    "supports_text_output",
    "supports_token_walks",
]


class EngineType(enum.StrEnum):
    """Which engine runs a node."""

    KV_CACHE = "kv_cache"
    STATELESS = "stateless"


_O = TypeVar("_O", bound=TaskOptions)


@dataclass
class Request:
    """One client request: a task name and its data (text, images, parameters).

    ``params``, the generation settings among the data, are parsed as the request is made (a
    bad one raises `InvalidRequestError` naming it); ``options``, the task's declared options
    (`Model.task_options`), where the engine takes the request (`parse_options`). A model's
    ``preprocess`` reads both typed, and the rest of ``data`` (prompts, images) itself.
    """

    task: str
    data: dict[str, Any] = field(default_factory=dict)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    params: GenerationParams = None  # type: ignore[assignment]  # parsed from data when not given
    options: Any = None

    def __post_init__(self) -> None:
        if self.params is None:
            self.params = GenerationParams.from_data(self.data)

    def options_as(self, cls: type[_O]) -> _O:
        """Return the task's options as ``cls`` (parsed from ``data`` once, if the engine did
        not)."""
        if not isinstance(self.options, cls):
            self.options = parse_struct(cls, self.data)
        return self.options


@dataclass
class PreparedRequest:
    """What preprocessing makes of a request: node inputs and the state machine's state."""

    inputs: dict[str, dict[str, Any]]
    state: Any = None


@dataclass(frozen=True)
class Output:
    """One output streamed to the client (after the model's postprocessing)."""

    request_id: str
    modality: str
    name: str
    data: Any
    node: str
    walk: str


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model in any process: an import path and keyword arguments.

    Worker processes are started with ``spawn`` and build their own copy of the model
    from this spec (nothing is pickled).
    """

    factory: str  # "package.module:callable"
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def build(self) -> Model:
        """Import the factory and call it.

        Raises:
            ModelLoadError: The factory cannot be imported or does not return a `Model`.
        """
        module_name, _, attr = self.factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ModelLoadError(f"cannot import model factory {self.factory!r}: {exc}") from exc
        model = factory(**dict(self.kwargs))
        if not isinstance(model, Model):
            raise ModelLoadError(f"{self.factory!r} returned {type(model).__name__}, not a Model")
        model.spec = self
        return model


class Model(ABC):
    """A composite model, declared once (DESIGN.md §2.2)."""

    name: str = "model"
    spec: ModelSpec | None = None  # how to rebuild it in a worker process, when known

    @abstractmethod
    def graph(self) -> ModelGraph:
        """Return the model's graph, walks and partitions."""

    @abstractmethod
    def engine_types(self) -> Mapping[str, EngineType]:
        """Return the engine type of every node."""

    @abstractmethod
    def submodule(self, node: str, device: torch.device) -> Any:
        """Return the computation for ``node`` on ``device``.

        For a `EngineType.STATELESS` node, a `mstar.engines.stateless.BatchedNode`.
        """

    @abstractmethod
    def preprocess(self, request: Request) -> PreparedRequest:
        """Turn a client request into node inputs and state (raise ValueError if invalid)."""

    @abstractmethod
    def first_walk(self, partition: str, state: Any) -> str | None:
        """Return the partition's first walk for this request, or None."""

    @abstractmethod
    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Return the walk after ``finished``, or None when the partition is done."""

    def tasks(self) -> tuple[str, ...]:
        """Return the task names this model accepts; the first is its default task.

        The default is what runs when a request names none (`mstar run` without ``--task``),
        so put the model's main task first.
        """
        return ()

    def task_options(self, task: str) -> type[TaskOptions] | None:
        """Return the options ``task`` takes beyond `GenerationParams`, as a `TaskOptions`
        Struct (names, types, ranges, defaults), or None. The engine parses them where the
        request enters; ``preprocess`` reads them with ``request.options_as(...)``."""
        return None

    def postprocess(self, request_id: str, emission: Emission) -> Output:
        """Turn an emitted value into a client output (default: as is)."""
        return Output(
            request_id,
            emission.modality,
            emission.name,
            emission.value,
            emission.node,
            emission.walk,
        )

    def default_placement(self) -> Placement | None:
        """Return the placement used when none is given (default: None, every node on rank 0).

        A model whose partitions should run side by side even on one device (each rank steps
        on a thread of its own) says so here; a placement file still overrides it.
        """
        return None


# --- capabilities beyond the base contract ---------------------------------------------------
#
# Each protocol carries a class-level ``supports_*`` marker that only classes inheriting the
# protocol get, so a model offers a capability by saying so, not by happening to have an
# attribute of the right name. The protocols are runtime-checkable so that ``supports_*()``
# also verifies the members are there.


@runtime_checkable
class SupportsTextOutput(Protocol):
    """A model whose ``text`` outputs are token ids of its own tokenizer.

    The server uses it to tokenize prompts for the OpenAI text routes, to detokenize text
    outputs incrementally, and to tell an end-of-sequence stop from a length stop.

    Attributes:
        tokenizer: A Hugging Face tokenizer (callable, with ``apply_chat_template``), or None
            when the checkpoint ships none; then clients must send token ids.
        system_prompt: The system message the server puts first in a chat that has none
            (None: the chat template's own default).
        chat_prompts: Whether the model's prompts are chats its tokenizer's template renders
            (an instruct model); a one-off text prompt is then sent as a user message.
    """

    supports_text_output: ClassVar[Literal[True]] = True
    tokenizer: Any
    system_prompt: str | None = None
    chat_prompts: bool = False

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Return the token ids that end a generation."""

    @abstractmethod
    def detokenize(self, token_ids: list[int]) -> str:
        """Return the text of ``token_ids``."""


@runtime_checkable
class SupportsAudioOutput(Protocol):
    """A model whose ``audio`` outputs are mono float samples at one fixed rate.

    Attributes:
        audio_sample_rate: Samples per second of every audio output.
    """

    supports_audio_output: ClassVar[Literal[True]] = True
    audio_sample_rate: int


@runtime_checkable
class SupportsAudioInput(Protocol):
    """A model that hears: its ``generate`` task takes ``messages`` whose user turns carry
    ``{"type": "audio", "audio": samples}`` parts (mono float samples at 16 kHz), as the
    chat and realtime routes send them. A model without it answers text turns only."""

    supports_audio_input: ClassVar[Literal[True]] = True


@runtime_checkable
class SupportsActionPolicy(Protocol):
    """A model that maps an observation to an action chunk (a robot policy).

    Served over openpi's WebSocket policy protocol too (`mstar.server.openpi`): each
    observation dict becomes ``Request(policy_task, observation)``, and the output named
    ``policy_output`` (an array) is the reply's ``actions``.
    """

    supports_action_policy: ClassVar[Literal[True]] = True
    policy_task: ClassVar[str]
    policy_output: ClassVar[str]

    def policy_metadata(self) -> dict[str, Any]:
        """Return what a robot client gets when it connects (openpi's server metadata)."""
        ...


@runtime_checkable
class SupportsSharedEngines(Protocol):
    """A model some of whose nodes run on another node's engine (one KV cache for them all).

    Classifier-free guidance branches are nodes of their own in a walk (a `Parallel` writes
    disjoint slots), yet each reads its context from the same paged cache, forked
    copy-on-write. A node hosted by another runs on the host's engine whenever both are
    placed on one rank: its firings go to the host's submodule (which tells them apart by
    their inputs) and batch with the host's in its steps. On a rank without its host, a node
    gets an engine of its own from `Model.submodule`.
    """

    supports_shared_engines: ClassVar[Literal[True]] = True

    def engine_hosts(self) -> Mapping[str, str]:
        """Return ``node -> host node`` for every node that runs on its host's engine."""
        ...


def supports_shared_engines(model: object) -> TypeGuard[SupportsSharedEngines]:
    """Whether ``model`` declares `SupportsSharedEngines`."""
    return getattr(type(model), "supports_shared_engines", False) is True


def supports_action_policy(model: object) -> TypeGuard[SupportsActionPolicy]:
    """Whether ``model`` declares `SupportsActionPolicy`."""
    return getattr(type(model), "supports_action_policy", False) is True


def supports_text_output(model: object) -> TypeGuard[SupportsTextOutput]:
    """Return whether ``model`` declares `SupportsTextOutput`."""
    return isinstance(model, SupportsTextOutput)


def supports_audio_output(model: object) -> TypeGuard[SupportsAudioOutput]:
    """Return whether ``model`` declares `SupportsAudioOutput`."""
    return isinstance(model, SupportsAudioOutput)


def supports_audio_input(model: object) -> TypeGuard[SupportsAudioInput]:
    """Return whether ``model`` declares `SupportsAudioInput`."""
    return isinstance(model, SupportsAudioInput)
