"""The contract a model author implements to run on mstar's KV-cache engine, in one place.

A `Model`'s ``submodule`` returns, for a KV-cache node, a `KVNode` (token walks: `turn` and
`outputs`), a `ForwardKVNode` (forward firings: `forward` and `forward_outputs`), or both;
either holds a `PagedModel`, the network the engine steps. Capabilities beyond the base
contract are declared, never probed, each with its check:

| protocol | what it offers | check | where |
|---|---|---|---|
| `KVNode` | token walks: `KVTurn` in, sampled tokens out | `supports_token_walks` | here |
| `ForwardKVNode` | forward firings: `KVForward` in, `FiringRows` out | `supports_forward_walks` | here |
| `PagedModel` | the network: `forward(input_ids, positions, ctx)` over a paged cache | (required) | here |
| `SupportsStepChunks` | payload chunks and experts in one batch (`StepInputs`) | `supports_step_chunks` | here |
| `SupportsNarrowLogits` | logits of chosen vocabulary ranges only | `supports_narrow_logits` | here |
| `SupportsGreedyTokens` | a greedy step's token ids in one call (no full logits) | `supports_greedy_tokens` | here |
| `SupportsConcurrentCalls` | a stateless node callable from several threads at once | `supports_concurrent_calls` | `mstar.engines.stateless` |
| `SupportsTextOutput` | a tokenizer: text routes, detokenized output | `supports_text_output` | `mstar.runtime.model` |
| `SupportsAudioOutput` | audio at a sample rate: the speech routes | `supports_audio_output` | `mstar.runtime.model` |
| `SupportsActionPolicy` | a robot policy: the openpi protocol | `supports_action_policy` | `mstar.runtime.model` |
| `SupportsSharedEngines` | nodes that run on another node's engine | `supports_shared_engines` | `mstar.runtime.model` |
| `WireForm` | a node value of the model's own type crossing processes | `supports_wire_form` | `mstar.runtime.values` |

A step is one flat batch of chunks, one per scheduled sequence. The model gets the batch's
token ids and positions as tensors, and in `PagedKVContext.step` what else each chunk is:

```
 rows      | c0: 5 text tokens | c1: 64 image latents (payload, expert 1) | c2: 1 token |
 input_ids | ids ...           | 0 0 0 ... (placeholders)                 | id          |
 chunks    | StepChunk(rows 0:5, payload None) | StepChunk(5:69, payload=..., expert 1) | ...
```

A model that accepts payloads embeds each payload chunk itself (`StepInputs.payload_chunks`)
and routes rows through its experts by `StepInputs.expert_ids`; attention is joint over
the whole batch, whichever weights produced a row's keys and values.
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Literal,
    Protocol,
    TypeGuard,
    runtime_checkable,
)

import torch

from mstar.engines.attention.base import AttentionBackend
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.masks import AttentionMask
from mstar.engines.sampling_params import SamplingParams
from mstar.engines.sequence import LogitsProcessor

if TYPE_CHECKING:
    from mstar.engines.kv_engine import KVCacheEngineConfig

__all__ = [
    "FiringRows",
    "ForwardKVNode",
    "KVChunk",
    "KVForward",
    "KVNode",
    "KVTurn",
    "PagedKVContext",
    "PagedModel",
    "StepChunk",
    "StepInputs",
    "SupportsGreedyTokens",
    "SupportsNarrowLogits",
    "SupportsStepChunks",
    "supports_forward_walks",
    "supports_greedy_tokens",
    "supports_narrow_logits",
    "supports_step_chunks",
    "supports_token_walks",
]

# -- the network a KV-cache engine steps -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepChunk:
    """One scheduled chunk of a step: rows `[row_start, row_end)` of the flat batch.

    Attributes:
        seq_key: The engine's id of the sequence (a request, or a fork or query of one).
        row_start: First row in the flat batch.
        row_end: Row after the last.
        position: Position of the chunk's first token in its sequence.
        payload: The model-specific input of these rows, or None for token ids.
        expert: Which weight set runs these rows (0: the default one).
        is_read_only: The chunk queries its sequence's cache and writes nothing.
    """

    seq_key: str
    row_start: int
    row_end: int
    position: int
    payload: Any = None
    expert: int = 0
    is_read_only: bool = False

    @property
    def num_rows(self) -> int:
        """Count the chunk's rows."""
        return self.row_end - self.row_start


@dataclass(slots=True)
class StepInputs:
    """Per-chunk inputs of one step (see the module docstring).

    Attributes:
        chunks: Every chunk of the step, in batch order.
        expert_ids: `[num_tokens]` int64 expert of each row (device), or None when every
            row runs expert 0.
    """

    chunks: list[StepChunk] = field(default_factory=list)
    expert_ids: torch.Tensor | None = None

    @property
    def payload_chunks(self) -> list[StepChunk]:
        """Return the chunks whose rows come from a payload."""
        return [c for c in self.chunks if c.payload is not None]


@dataclass(slots=True)
class PagedKVContext:
    """Handed to the model each step: the planned backend, every layer's cache, the step's
    inputs."""

    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    step: StepInputs = field(default_factory=StepInputs)

    @torch.compiler.disable
    def attend(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V of layer `layer_index` and attend (see `AttentionBackend`).

        Never traced by `torch.compile`: backends keep per-step Python state (plans,
        staging) that compiled graphs must not freeze.
        """
        return self.backend.forward(q, k, v, self.kv_caches[layer_index], scale)

    def native_decode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Return `(slots, block tables, lengths)` for native decoder layers, or None (see
        `TorchPagedAttention.native_decode`): only a CPU backend with the native kernels offers
        them."""
        if not self.kv_caches or torch.compiler.is_compiling():
            return None
        return self.backend.native_decode(self.kv_caches[0][0])


class PagedModel(Protocol):
    """A decoder over a flat token batch whose attention layers call `ctx.attend`."""

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Return the per-token cache geometry (layers, KV heads, head size, dtype)."""
        ...

    @property
    def max_position(self) -> int:
        """Return the longest sequence the model supports."""
        ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Return hidden states `[num_tokens, hidden]` for the flat batch."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return `[rows, vocab]` logits for selected hidden states (sampling walks only).

        A model may also offer narrowed logits (`SupportsNarrowLogits`).
        """
        ...


@runtime_checkable
class SupportsNarrowLogits(Protocol):
    """A `PagedModel` that computes logits inside id ranges only.

    The runner uses it when every sampled row's logits processor names its ranges
    (constrained decoding over a large vocabulary: Orpheus' audio codes).
    """

    supports_narrow_logits: ClassVar[Literal[True]]

    def compute_logits_in(
        self, hidden: torch.Tensor, ranges: list[list[tuple[int, int]]]
    ) -> torch.Tensor:
        """Return `[rows, vocab]` logits computed inside each row's `[(start, end), ...]`, `-inf`
        elsewhere."""
        ...


def supports_narrow_logits(model: object) -> TypeGuard[SupportsNarrowLogits]:
    """Whether `model` declares `SupportsNarrowLogits`."""
    return getattr(model, "supports_narrow_logits", False) is True  # compiled wrappers forward it


@runtime_checkable
class SupportsGreedyTokens(Protocol):
    """A `PagedModel` that finds greedy tokens without computing every logit.

    The runner asks it when every sampled row is plain greedy (temperature 0, no penalties,
    processors or log-probabilities) and the step returns no logits.
    """

    supports_greedy_tokens: ClassVar[Literal[True]]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Return `[rows]` int64 argmax ids of `compute_logits(hidden)` (the first on ties), or
        None.

        None: not decided this way (the runner computes the logits and samples as usual).
        """
        ...


def supports_greedy_tokens(model: object) -> TypeGuard[SupportsGreedyTokens]:
    """Whether `model` declares `SupportsGreedyTokens`."""
    return getattr(model, "supports_greedy_tokens", False) is True  # compiled wrappers forward it


@runtime_checkable
class SupportsStepChunks(Protocol):
    """A `PagedModel` that reads `StepInputs.chunks` on every step, plain decode steps included.

    Plain one-token decode steps otherwise take a fast path that hands the model no chunks.
    A model whose positions are its own (BAGEL: an image of n cache positions takes one RoPE
    position, so a sampled token's RoPE position depends on its sequence) needs each row's
    sequence there too.
    """

    supports_step_chunks: ClassVar[Literal[True]]


def supports_step_chunks(model: object) -> bool:
    """Whether `model` declares `SupportsStepChunks`."""
    return getattr(model, "supports_step_chunks", False) is True  # compiled wrappers forward it


# -- the node around it: token walks and forward firings --------------------------------------


@dataclass(frozen=True)
class KVTurn:
    """What one walk asks of a KV-cache node for one request.

    Attributes:
        new_token_ids: Tokens to append before sampling (the prompt on the first walk, or
            the whole history on a rank that holds no cache for the request; none to continue
            from the last sampled token).
        sampling_params: How to sample; ``max_tokens`` is capped by the walk's step count.
        mask: Attention among the new tokens (default causal).
        logits_processor: Per-step hook on this request's logits (constrained decoding).
        is_done: Nothing more to generate (the history already ends with a stop token, or
            ``max_tokens`` were generated): the walk ends at once, sampling nothing.
        prefix_group: Requests of one group with the same prompt (parallel samples of one
            prompt, OpenAI's ``n``) share its cache: the prompt but its last token is
            computed once, and each request forks those blocks copy-on-write and samples
            on its own. A request arriving after the shared prompt was computed and handed
            out computes its own.
        prefix_group_size: How many requests the group has: an idle engine waits for them
            all (20 ms at most) before computing the prompt.
        return_rows: Also hand the model's rows of ``new_token_ids`` to `KVNode.outputs`,
            with the walk's first token (what a downstream node reads of the prompt: the
            thinker's hidden states a talker speaks from). They are computed in one chunk.
    """

    new_token_ids: list[int]
    sampling_params: SamplingParams
    mask: AttentionMask | None = None
    logits_processor: LogitsProcessor | None = None
    is_done: bool = False
    prefix_group: str | None = None
    prefix_group_size: int = 0
    return_rows: bool = False


class KVNode(Protocol):
    """The model side of a KV-cache node with token walks (what `Model.submodule` returns)."""

    model: PagedModel
    engine_config: KVCacheEngineConfig

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        """Turn the node's inputs for one walk into tokens to append and sampling settings.

        ``is_first`` is True when this engine holds no cache for the request: its first
        walk, or a later walk placed on another rank (the cache is then rebuilt from the
        history the node persists, e.g. decode after prefill on another rank).
        """
        ...

    def outputs(
        self, request_id: str, token_id: int, history: list[int] | None
    ) -> Mapping[str, Any]:
        """Return the node's outputs (and signals) for one sampled token.

        ``history`` (every token of the sequence, prompt first) is given on the walk's last
        token only, and None before; a node looped by a `DynamicLoop` must raise the loop's
        stop signal exactly then, and persists the history for the request's next walk.

        When the turn's sampling params ask for ``logprobs``, the call also gets
        ``logprobs=`` the token's `TokenLogprobs` (and only then); when the turn asked for
        its rows (`KVTurn.return_rows`), the walk's first call gets ``rows=`` them.
        """
        ...


@dataclass(frozen=True)
class KVChunk:
    """One sequence's share of a forward firing.

    Attributes:
        seq: Which of the request's sequences ("" is the request's own; any other name is a
            branch, a fork or a rollout row of it).
        token_ids: Input tokens (or use `payload`).
        payload: Model input of `num_tokens` positions (embedded by the model).
        num_tokens: Positions of the payload.
        mask: Attention among the new inputs (default causal).
        expert: The model's weight set for these inputs.
        read_only: Query `seq`'s cache with these inputs and write nothing.
        output: "hidden": the firing gets the inputs' rows; "none": nothing (a prefill).
        reset: Drop what `seq` holds first (a new rollout, a per-frame cache).
        fork_from: Create `seq` first as a fork of this sequence of the request...
        fork_tokens: ...sharing its first this many tokens (default: all).
        reserve_tokens: Admit a new `seq` only once blocks for this many tokens are held
            for it (a rollout that must never stall half way).
        release: Drop `seq` once this chunk ran (its last use).
        truncate: Roll `seq` back to its first this many tokens first (a mark taken
            earlier: tokens decoded past it are dropped, to be computed again as inputs).
    """

    seq: str = ""
    token_ids: list[int] | None = None
    payload: Any = None
    num_tokens: int | None = None
    mask: AttentionMask | None = None
    expert: int = 0
    read_only: bool = False
    output: Literal["hidden", "none"] = "hidden"
    reset: bool = False
    fork_from: str | None = None
    fork_tokens: int | None = None
    reserve_tokens: int = 0
    release: bool = False
    truncate: int | None = None


@dataclass(frozen=True)
class FiringRows:
    """A completed forward firing: its request, inputs, and each chunk's rows (None: "none")."""

    request_id: str
    inputs: Mapping[str, Any]
    rows: list[torch.Tensor | None]


@dataclass(frozen=True)
class KVForward:
    """A forward firing: a chunk per sequence it touches, run in one step.

    Several chunks of one sequence (none but the first resetting, forking or truncating it)
    append their inputs in order, in as many steps as their masks and payloads need; the
    sequence's rows (its last chunk's inputs) come under its last chunk.
    """

    chunks: list[KVChunk] = field(default_factory=list)


class ForwardKVNode(Protocol):
    """The model side of a KV-cache node fired by forward passes (`KVForward`).

    Declares ``forward_walks = True``; a node that also offers token walks (the `KVNode`
    methods) declares ``token_walks = True`` too.
    """

    forward_walks: ClassVar[Literal[True]]
    model: PagedModel
    engine_config: KVCacheEngineConfig

    def forward(self, request_id: str, inputs: Mapping[str, Any]) -> KVForward:
        """Turn one firing's inputs into chunks (raise ValueError for bad inputs)."""
        ...

    def forward_outputs(self, firings: list[FiringRows]) -> list[Mapping[str, Any] | BaseException]:
        """Return each firing's outputs (or its own error) from its chunks' rows.

        Called once per step with every firing the step completed, so post-processing is
        batched across requests (as a stateless node batches its inputs). An exception
        raised instead fails all of them.
        """
        ...

    def release(self, request_id: str) -> None:
        """Forget what the node keeps for a request (its partition is done, or it was aborted)."""
        ...


def supports_forward_walks(node: object) -> TypeGuard[ForwardKVNode]:
    """Whether a KV-cache node declares forward firings (`ForwardKVNode`)."""
    return getattr(node, "forward_walks", False) is True


def supports_token_walks(node: object) -> bool:
    """Whether a KV-cache node runs token walks: every `KVNode`, and forward nodes that say so."""
    return not supports_forward_walks(node) or getattr(node, "token_walks", False) is True
