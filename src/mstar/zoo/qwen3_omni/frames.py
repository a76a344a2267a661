"""The talker's frames, drawn inside its engine step (on the step thread, not the event loop).

Each talker step ends, for every request whose firing returns a frame, with codebook 0 drawn
from the last row's logits and the code predictor's 15 residual codebooks. That is most of a
frame's time, so it runs where the step runs: `TalkerStepModel` wraps the talker's decoder
(the `PagedModel` its engine steps) and, after the decoder's forward, draws the frames of
every `FrameInput` chunk of the step as one batch. The draws land in the request's
`SpeechState`, which the node reads when the firing completes::

    event loop   TalkerNode.forward: FrameInput(rows, state) ─┐            ┌─▶ forward_outputs:
    state.frame
    step thread                       decoder(step) ─▶ draw_frames(last rows) ─▶ state.frame,
    state.pending

A request has one firing in flight at a time, so its state is never touched by both threads
at once; the step's hand-over to the event loop orders the writes before the reads.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from mstar.engines.interfaces import PagedKVContext
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.layers import OwnProducts, make_linears_deterministic
from mstar.engines.parallel import TensorShard, mirrored, tensor_payload
from mstar.zoo.qwen3_omni.modules.sampling import DrawParams, draw, talker_suppress_mask
from mstar.zoo.qwen3_omni.modules.text import EmbedsInput, MoEDecoder
from mstar.zoo.qwen3_omni.modules.weights import Qwen3OmniWeights

__all__ = ["FrameInput", "SpeechState", "TalkerStepModel", "draw_frames"]


@dataclass
class SpeechState:
    """What the talker keeps for one request between firings."""

    sampling: DrawParams
    code_sampling: DrawParams
    generator: torch.Generator
    max_frames: int
    speaker: int
    texts: deque[torch.Tensor] = field(default_factory=deque)  # projected text rows not yet spoken
    # codebook-0 draws (the repetition penalty's history)
    drawn: list[int] = field(default_factory=list)
    pending: torch.Tensor | None = None  # summed embeddings of the last frame
    frame: torch.Tensor | None = None  # the last frame's 16 codes, until its firing completes
    is_started: bool = False  # the assistant prefill is in the cache
    is_done: bool = False
    eos_used: bool = False
    expects_frame: bool = False  # the firing in flight draws a frame
    num_seen: int = 0  # stream items taken (a looped firing sees its chunk again)


@tensor_payload(local=("state",))  # a tensor-parallel talker's leader draws the frames
@dataclass(frozen=True, eq=False)
class FrameInput(EmbedsInput):
    """A talker payload whose last row draws the request's next frame (into ``state``)."""

    state: Any = None


@torch.no_grad()
def draw_frames(
    weights: Qwen3OmniWeights, last: torch.Tensor, states: list[SpeechState], suppress: torch.Tensor
) -> None:
    """Draw one frame per state from the talker's last hidden rows ``[n, hidden]`` (batched).

    Codebook 0 comes from the talker's head (its repetition penalty over the request's
    earlier draws, the codec specials suppressed); codec EOS or the frame cap ends the
    request's speech (``is_done``, no frame). Otherwise the code predictor draws codebooks
    1..15 and the frame's summed embedding becomes the next step's input (``pending``).
    """
    talker = weights.talker_text
    eos = weights.config.codec_id("codec_eos_token_id")
    logits = talker.compute_logits(last)
    code0 = torch.empty(len(states), dtype=torch.long, device=last.device)
    for params, members in _groups(states, lambda s: s.sampling).items():
        code0[members] = draw(
            logits[members], params, [states[k].generator for k in members],
            history=[states[k].drawn for k in members], suppress=suppress,
        )  # fmt: skip
    speaking: list[int] = []
    for k, (state, token) in enumerate(zip(states, code0.tolist(), strict=True)):
        state.drawn.append(int(token))
        state.frame = None
        if token == eos or len(state.drawn) >= state.max_frames:
            state.is_done = True
        else:
            speaking.append(k)
    by_code = _groups([states[k] for k in speaking], lambda s: s.code_sampling)
    for params, members in by_code.items():
        rows = [speaking[j] for j in members]
        embeds0 = talker.embedding(code0[rows])
        residual, embeds = weights.code_predictor.generate(
            last[rows], embeds0, params, [states[k].generator for k in rows]
        )
        summed = embeds0 + torch.stack(embeds).sum(0)
        frames = torch.cat((code0[rows, None], residual), dim=1).cpu()
        for j, k in enumerate(rows):
            states[k].pending = summed[j]
            states[k].frame = frames[j]


def _groups(states: list[SpeechState], key: Any) -> dict[DrawParams, list[int]]:
    groups: dict[DrawParams, list[int]] = {}
    for k, state in enumerate(states):
        groups.setdefault(key(state), []).append(k)
    return groups


class TalkerStepModel(OwnProducts):
    """The talker's `PagedModel` for its engine: the decoder, then the step's frames drawn.

    Made deterministic (`OwnProducts`): the decoder's and the code predictor's products.
    Sharded (`SupportsTensorParallel`: the decoder's heads and experts, its head whole), every
    rank runs the decoder and the leader alone draws the frames (its hidden states are every
    rank's).

    Args:
        weights: The model's weights (the decoder is ``weights.talker_text``).
    """

    def __init__(self, weights: Qwen3OmniWeights) -> None:
        self.weights = weights
        self.decoder: MoEDecoder = weights.talker_text
        self.suppress = talker_suppress_mask(weights.config, self.decoder.embedding.weight.device)

    supports_tensor_parallel: ClassVar[Literal[True]] = True

    @property
    def tensor_shard(self) -> TensorShard | None:
        """The decoder's tensor-parallel shard (None: all of it)."""
        return self.decoder.shard

    def make_products_deterministic(self) -> None:
        """Route the decoder's and the code predictor's products deterministically."""
        make_linears_deterministic(self.decoder)
        make_linears_deterministic(self.weights.code_predictor)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Return the decoder's cache geometry."""
        return self.decoder.kv_cache_spec

    @property
    def max_position(self) -> int:
        """Return the decoder's longest sequence."""
        return self.decoder.max_position

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Run the decoder over the step; draw the frame of every `FrameInput` chunk in it."""
        hidden = self.decoder(input_ids, positions, ctx)
        shard = self.decoder.shard
        frames = [c for c in ctx.step.chunks if isinstance(c.payload, FrameInput)]
        if frames and (shard is None or shard.rank == 0):  # the leader draws, alone
            rows = torch.tensor([c.row_end - 1 for c in frames], device=hidden.device)
            states = [c.payload.state for c in frames]
            draw_frames(self.weights, hidden.index_select(0, rows), states, self.suppress)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return the decoder's codebook-0 logits."""
        return self.decoder.compute_logits(hidden)

    @mirrored
    def forget(self, seq_key: str) -> None:
        """Drop what the decoder keeps for a sequence (its MRoPE offset)."""
        self.decoder.forget(seq_key)
