"""Every attention pattern of `KVCacheEngine`, alone and mixed in one step, against dense attention.

A tiny paged transformer defined here (GQA, learned positions, two expert weight sets
chosen per row, payload rows as embeddings) runs in the engine; its dense reference
recomputes a sequence from scratch with an explicit boolean mask built from the segments'
patterns (query `t` of a segment sees keys `[0, limit(t))`: causal `t + 1`, full the
segment's end, block-causal the end of `t`'s block). Read-only query tokens see the whole
context plus each other by their mask, and are not part of the context afterwards. The
engine's returned rows ("hidden" walks) and logits (sampling walks) must equal the
reference's in float32.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.engines import (
    AttentionMask,
    FinishReason,
    KVCacheEngine,
    KVCacheEngineConfig,
    KVCacheSpec,
    PagedKVContext,
    SamplingParams,
    StepOutput,
)
from mstar.engines.sequence import OutputMode

VOCAB = 32
HIDDEN = 32
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN // NUM_HEADS
MAX_POSITION = 128
SCALE = HEAD_DIM**-0.5
ATOL = 1e-5

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`attend(layer, q, k, v) -> out`: the paged engine's, or the dense reference's."""


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _project(x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
    """Multiply each row by its expert's weight (`weight` is `[2, in, out]`)."""
    y = x @ weight[0]
    if experts is None:
        return y
    return torch.where((experts == 1)[:, None], x @ weight[1], y)


class TinyPagedModel(torch.nn.Module):
    """A 2-layer GQA decoder with two expert weight sets, implementing `PagedModel`.

    A payload is a float tensor `[rows, HIDDEN]` used as those rows' embeddings; token
    rows use the embedding table. `ctx.step.expert_ids` picks each row's weights.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def param(*shape: int, std: float) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) * std, requires_grad=False)

        qkv_out = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        self.embed = param(VOCAB, HIDDEN, std=1.0)
        self.pos = param(MAX_POSITION, HIDDEN, std=0.5)
        self.qkv = torch.nn.ParameterList(
            [param(2, HIDDEN, qkv_out, std=0.25) for _ in range(NUM_LAYERS)]
        )
        self.o = torch.nn.ParameterList(
            [param(2, HIDDEN, HIDDEN, std=0.2) for _ in range(NUM_LAYERS)]
        )
        self.up = torch.nn.ParameterList(
            [param(2, HIDDEN, 2 * HIDDEN, std=0.2) for _ in range(NUM_LAYERS)]
        )
        self.down = torch.nn.ParameterList(
            [param(2, 2 * HIDDEN, HIDDEN, std=0.2) for _ in range(NUM_LAYERS)]
        )
        self.lm_head = param(HIDDEN, VOCAB, std=0.5)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, torch.float32)

    @property
    def max_position(self) -> int:
        return MAX_POSITION

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        x = self.embed[input_ids]
        for chunk in ctx.step.payload_chunks:
            assert chunk.payload.shape == (chunk.num_rows, HIDDEN), (chunk, chunk.payload.shape)
            x[chunk.row_start : chunk.row_end] = chunk.payload
        return self.body(
            x + self.pos[positions],
            ctx.step.expert_ids,
            lambda i, q, k, v: ctx.attend(i, q, k, v, SCALE),
        )

    def body(self, x: torch.Tensor, experts: torch.Tensor | None, attend: Attend) -> torch.Tensor:
        """Run the layers over embedded rows; `attend(layer, q, k, v)` is the attention."""
        n = x.shape[0]
        for i in range(NUM_LAYERS):
            qkv = _project(_rms(x), self.qkv[i], experts)
            q, k, v = qkv.split(
                [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1
            )
            a = attend(
                i,
                q.reshape(n, NUM_HEADS, HEAD_DIM),
                k.reshape(n, NUM_KV_HEADS, HEAD_DIM),
                v.reshape(n, NUM_KV_HEADS, HEAD_DIM),
            )
            x = x + _project(a.reshape(n, HIDDEN), self.o[i], experts)
            x = x + _project(F.gelu(_project(_rms(x), self.up[i], experts)), self.down[i], experts)
        return _rms(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head


MODEL = TinyPagedModel()


# -- the dense reference -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One position of a reference sequence: its input, its expert, its keys' end."""

    token: int | None  # None: `vector` is the embedding (a payload row)
    vector: torch.Tensor | None
    expert: int
    limit: int


def limits_of(start: int, n: int, mask: AttentionMask) -> list[int]:
    """Return the key limit of each position of a segment `[start, start + n)`."""
    end = start + n
    if mask.kind == "full":
        return [end] * n
    if mask.kind == "block_causal":
        size = mask.block_size
        return [min(start + ((t - start) // size + 1) * size, end) for t in range(start, end)]
    return [t + 1 for t in range(start, end)]


@torch.inference_mode()
def dense(rows: list[Row]) -> torch.Tensor:
    """Recompute `rows` from scratch with an explicit mask; return their hidden states."""
    n = len(rows)
    x = torch.stack([MODEL.embed[r.token] if r.vector is None else r.vector for r in rows])
    x = x + MODEL.pos[torch.arange(n)]
    experts = torch.tensor([r.expert for r in rows])
    mask = torch.arange(n)[None, :] < torch.tensor([r.limit for r in rows])[:, None]
    rep = NUM_HEADS // NUM_KV_HEADS

    def attend(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=SCALE
        )
        return o.transpose(0, 1)

    return MODEL.body(x, experts, attend)


# -- walks and a harness that checks each output against the reference -------------------------


@dataclass(frozen=True, slots=True)
class Walk:
    """New inputs of one walk: tokens or a payload, their mask, expert and output mode."""

    n: int
    is_payload: bool = False
    mask: AttentionMask = field(default_factory=AttentionMask.causal)
    expert: int = 0
    mode: OutputMode = "hidden"
    max_tokens: int = 1  # sampling walks
    seed: int = 0  # what the tokens or payload rows are
    token_ids: tuple[int, ...] | None = None  # these tokens instead of seeded ones

    def inputs(self) -> tuple[list[int] | None, torch.Tensor | None]:
        if self.token_ids is not None:
            return list(self.token_ids), None
        gen = torch.Generator().manual_seed(self.seed * 131 + self.n)
        if self.is_payload:
            return None, torch.randn(self.n, HIDDEN, generator=gen)
        return torch.randint(0, VOCAB, (self.n,), generator=gen).tolist(), None

    def rows(self, start: int) -> list[Row]:
        tokens, payload = self.inputs()
        limits = limits_of(start, self.n, self.mask)
        if payload is not None:
            return [Row(None, payload[i], self.expert, limits[i]) for i in range(self.n)]
        assert tokens is not None
        return [Row(tokens[i], None, self.expert, limits[i]) for i in range(self.n)]


@dataclass(slots=True)
class Track:
    """What the harness knows of one engine sequence."""

    rows: list[Row]
    marks: list[int]  # segment ends a fork or truncation may go back to
    has_pending_token: bool = False  # the last sampled token is not in the cache yet
    walk: Walk | None = None  # the walk in flight
    walk_start: int = 0


class Harness:
    """Submit walks, forks, truncations and queries; check every step's outputs."""

    def __init__(
        self,
        *,
        block_size: int = 4,
        num_blocks: int = 256,
        budget: int = 64,
        prefix_caching: bool = True,
    ) -> None:
        config = KVCacheEngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=32,
            enable_prefix_caching=prefix_caching,
            attention_backend="torch",
        )
        self.engine = KVCacheEngine(MODEL, config)
        self.engine.return_logits = True
        self.tracks: dict[str, Track] = {}
        self.queries: dict[str, tuple[list[Row], int]] = {}  # id -> (rows, first query row)
        self.sampled: dict[str, list[int]] = {}
        self.num_checked = 0

    def computed(self, request_id: str) -> int:
        track = self.tracks[request_id]
        return len(track.rows) - int(track.has_pending_token)

    def is_idle(self, request_id: str) -> bool:
        track = self.tracks.get(request_id)
        return track is None or track.walk is None

    def submit(self, request_id: str, walk: Walk) -> None:
        """Start `walk` on a new or paused request (kept alive afterwards)."""
        tokens, payload = walk.inputs()
        num_tokens = walk.n if payload is not None else None
        params = SamplingParams.greedy(walk.max_tokens)
        track = self.tracks.get(request_id)
        if track is None:
            track = self.tracks[request_id] = Track([], [])
            self.engine.add_request(
                request_id,
                tokens or [],
                params,
                keep_alive=True,
                mask=walk.mask,
                payload=payload,
                num_tokens=num_tokens,
                expert=walk.expert,
                output_mode=walk.mode,
            )
        else:
            assert track.walk is None
            self.engine.resume(
                request_id,
                tokens,
                params,
                keep_alive=True,
                mask=walk.mask,
                payload=payload,
                num_tokens=num_tokens,
                expert=walk.expert,
                output_mode=walk.mode,
            )
        track.has_pending_token = False  # the pending token is computed with the new inputs
        track.walk_start = len(track.rows)
        track.rows.extend(walk.rows(track.walk_start))
        track.walk = walk

    def fork(self, parent_id: str, child_id: str, mark: int | None = None) -> None:
        """Fork at `mark` (None: all of the parent, pending token included)."""
        parent = self.tracks[parent_id]
        assert parent.walk is None
        self.engine.fork(parent_id, child_id, num_tokens=mark, keep_alive=True)
        if mark is None:
            self.tracks[child_id] = Track(
                list(parent.rows), list(parent.marks), parent.has_pending_token
            )
        else:
            self.tracks[child_id] = Track(
                parent.rows[:mark], [m for m in parent.marks if m <= mark]
            )

    def truncate(self, request_id: str, mark: int) -> None:
        track = self.tracks[request_id]
        assert track.walk is None
        self.engine.truncate(request_id, mark)
        del track.rows[mark:]
        track.marks = [m for m in track.marks if m <= mark]
        track.has_pending_token = False

    def query(self, parent_id: str, query_id: str, walk: Walk) -> None:
        """Run `walk`'s inputs read-only over the parent's cache (one step, rows returned)."""
        parent = self.tracks[parent_id]
        assert parent.walk is None
        tokens, payload = walk.inputs()
        self.engine.query(
            parent_id,
            query_id,
            token_ids=tokens,
            payload=payload,
            num_tokens=walk.n if payload is not None else None,
            mask=walk.mask,
            expert=walk.expert,
        )
        context = parent.rows[: self.computed(parent_id)]
        self.queries[query_id] = (context + walk.rows(len(context)), len(context))

    def step(self) -> list[StepOutput]:
        """Run one engine step and check each of its outputs against the reference."""
        outputs = self.engine.step()
        for out in outputs:
            if out.error is not None:
                raise out.error
            if out.request_id in self.queries:
                rows, first = self.queries.pop(out.request_id)
                assert (
                    out.finished
                    and out.finish_reason is FinishReason.COMPUTED
                    and not out.new_token_ids
                )
                self._check_rows(out, dense(rows)[first:])
                continue
            track = self.tracks[out.request_id]
            walk = track.walk
            assert walk is not None, out
            if walk.mode == "sample":
                self._check_sample(out, track)
            else:
                assert (
                    out.finished
                    and out.finish_reason is FinishReason.COMPUTED
                    and not out.new_token_ids
                )
                if walk.mode == "hidden":
                    self._check_rows(out, dense(track.rows)[track.walk_start :])
                else:
                    assert out.hidden is None
            if out.finished:
                track.walk = None
                track.marks.append(self.computed(out.request_id))
                seq = self.engine.get_sequence(out.request_id)
                assert seq.num_computed_tokens == self.computed(out.request_id), (
                    seq,
                    len(track.rows),
                )
        live = [self.engine.get_sequence(r) for r in self.tracks]
        live += [self.engine.get_sequence(q) for q in self.queries]
        self.engine.block_manager.check_invariants(live)
        return outputs

    def _check_rows(self, out: StepOutput, expected: torch.Tensor) -> None:
        assert out.hidden is not None, out
        assert out.hidden.shape == expected.shape, (
            out.request_id,
            out.hidden.shape,
            expected.shape,
        )
        torch.testing.assert_close(out.hidden, expected, atol=ATOL, rtol=1e-5)
        self.num_checked += 1

    def _check_sample(self, out: StepOutput, track: Track) -> None:
        assert len(out.new_token_ids) == 1 and out.logits is not None and out.hidden is None
        reference = MODEL.compute_logits(dense(track.rows)[-1:])[0]
        torch.testing.assert_close(out.logits, reference, atol=1e-4, rtol=1e-5)
        token = out.new_token_ids[0]
        # Greedy picks the reference's argmax.
        assert token == int(reference.argmax()), (token, reference)
        self.sampled.setdefault(out.request_id, []).append(token)
        track.rows.append(Row(token, None, 0, len(track.rows) + 1))
        track.has_pending_token = True
        self.num_checked += 1

    def run(self) -> None:
        """Step until nothing waits or runs."""
        for _ in range(500):
            if not self.engine.has_unfinished():
                return
            self.step()
        raise AssertionError("the engine did not finish")

    def close(self) -> None:
        """Release every request; all blocks must be free again."""
        assert not self.engine.has_unfinished()
        for request_id in self.tracks:
            self.engine.release(request_id)
        bm = self.engine.block_manager
        bm.check_invariants([])
        assert bm.num_free_blocks == self.engine.num_blocks and self.engine.num_requests == 0


FULL = AttentionMask.full()
CAUSAL = AttentionMask.causal()


# -- each pattern alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [3, 64], ids=["chunked", "one-step"])
def test_causal_tokens_match_dense(budget: int) -> None:
    """Causal token walks (chunked over steps or not) return the dense rows, walk after walk."""
    h = Harness(budget=budget)
    h.submit("r", Walk(9, mode="none", seed=1))
    h.run()
    h.submit("r", Walk(5, seed=2))
    h.run()
    h.submit("r", Walk(1, seed=3))  # a one-token walk that returns its row
    h.run()
    assert h.num_checked == 2
    h.close()


def test_full_payload_prefix_then_tokens() -> None:
    """A bidirectional payload prefix (its rows see each other) and causal tokens after it."""
    h = Harness(budget=4)
    h.submit("r", Walk(7, is_payload=True, mask=FULL, seed=1))
    h.run()
    h.submit("r", Walk(6, seed=2))
    h.run()
    h.submit("r", Walk(3, is_payload=True, mask=FULL, mode="none", seed=3))
    h.submit("s", Walk(5, is_payload=True, seed=4))  # a causal payload next to it
    h.run()
    h.submit("r", Walk(2, seed=5))
    h.run()
    assert h.num_checked == 4
    h.close()


@pytest.mark.parametrize("budget", [4, 64], ids=["chunked", "one-step"])
def test_block_causal_frames_appended_step_by_step(budget: int) -> None:
    """Frames of a block-causal pattern, one per walk and several per walk (cut at frames)."""
    frame = 3
    h = Harness(budget=budget)
    h.submit("v", Walk(4, seed=1))  # a text prompt before the frames
    h.run()
    for i in range(3):
        h.submit(
            "v", Walk(frame, is_payload=True, mask=AttentionMask.block_causal(frame), seed=10 + i)
        )
        h.run()
    h.submit("v", Walk(3 * frame, mask=AttentionMask.block_causal(frame), mode="none", seed=20))
    h.run()
    h.submit("v", Walk(2 * frame, mask=AttentionMask.block_causal(frame), seed=21))
    h.run()
    assert h.num_checked == 5
    h.close()


def test_read_only_queries_over_a_context_leave_it_unchanged() -> None:
    """Queries see the whole context and each other by their mask, and are not kept."""
    h = Harness()
    h.submit("ctx", Walk(6, seed=1))
    h.run()
    free_before = h.engine.block_manager.num_free_blocks
    h.query("ctx", "q_full", Walk(4, is_payload=True, mask=FULL, seed=2))
    h.query("ctx", "q_causal", Walk(3, seed=3))
    h.query(
        "ctx",
        "q_block",
        Walk(4, is_payload=True, mask=AttentionMask.block_causal(2), expert=1, seed=4),
    )
    h.query("ctx", "q_one", Walk(1, seed=5))
    outs = h.step()
    assert {o.request_id for o in outs} == {"q_full", "q_causal", "q_block", "q_one"}  # one step
    assert h.engine.block_manager.num_free_blocks == free_before  # nothing written
    h.submit("ctx", Walk(3, seed=6))  # the context goes on without the queries' tokens
    h.run()
    assert h.num_checked == 6
    h.close()


def test_expert_segments_run_their_own_weights() -> None:
    """Expert-1 segments (payload and tokens) next to expert-0 ones, in one sequence and across."""
    h = Harness(budget=5)
    h.submit("a", Walk(4, seed=1))
    h.submit("b", Walk(6, is_payload=True, mask=FULL, expert=1, seed=2))
    h.run()
    h.submit("a", Walk(5, expert=1, seed=3))
    h.submit("b", Walk(3, seed=4))
    h.run()
    h.submit("a", Walk(4, expert=1, mask=AttentionMask.block_causal(2), mode="none", seed=5))
    h.run()
    h.submit("a", Walk(2, seed=6))
    h.run()
    assert h.num_checked == 5
    # Expert 1 changes the result: the two weight sets are not the same.
    same = Walk(4, seed=7).rows(0)
    other = [Row(r.token, r.vector, 1, r.limit) for r in same]
    assert not torch.allclose(dense(same), dense(other), atol=1e-3)
    h.close()


def test_fork_at_a_mark_then_different_continuations() -> None:
    """Forks taken at earlier marks (mid-block too), or of everything (the pending sampled
    token too), share the cache and diverge copy-on-write."""
    h = Harness(block_size=4)
    h.submit("ctx", Walk(6, seed=1))  # ends mid-block: the partial block is shared
    h.run()
    h.submit("ctx", Walk(5, is_payload=True, mask=FULL, seed=2))
    h.run()
    h.submit("ctx", Walk(3, mode="sample", max_tokens=2, seed=3))  # the last token is pending
    h.run()
    h.fork("ctx", "before_payload", 6)
    h.fork("ctx", "after_payload", 11)
    h.fork("ctx", "whole")
    h.submit("before_payload", Walk(4, seed=4))
    h.submit("after_payload", Walk(2, is_payload=True, mask=FULL, seed=5))
    h.submit("whole", Walk(3, mask=AttentionMask.block_causal(2), seed=6))
    h.submit("ctx", Walk(2, seed=7))
    h.run()
    assert h.num_checked == 8
    h.close()


def test_truncate_then_continue() -> None:
    """Rolling back to a mark and going on equals a sequence that never had the rolled-back part."""
    h = Harness(block_size=4)
    h.submit("r", Walk(5, seed=1))
    h.run()
    h.submit("r", Walk(4, is_payload=True, mask=FULL, seed=2))
    h.run()
    h.submit("r", Walk(3, mode="sample", max_tokens=3, seed=3))
    h.run()
    h.truncate("r", 9)  # back to after the payload
    h.submit("r", Walk(4, seed=4))
    h.run()
    h.truncate("r", 5)  # back to the text prompt (mid-block)
    h.submit("r", Walk(3, is_payload=True, mask=AttentionMask.block_causal(2), seed=5))
    h.run()
    assert h.num_checked == 7
    h.close()


@pytest.mark.parametrize("budget", [4, 64], ids=["chunked", "one-step"])
def test_sampled_tokens_after_payload_prefixes_match_greedy_reference(budget: int) -> None:
    """Sampling right after a payload prefix, and decoding on, picks the reference's argmax."""
    h = Harness(budget=budget)
    h.submit("img", Walk(6, is_payload=True, mask=FULL, mode="sample", max_tokens=4, seed=1))
    h.submit("txt", Walk(3, seed=2))
    h.run()
    h.submit("txt", Walk(5, is_payload=True, expert=1, mode="sample", max_tokens=3, seed=3))
    h.submit("img", Walk(2, seed=4, mode="sample", max_tokens=2))
    h.run()
    assert len(h.sampled["img"]) == 6 and len(h.sampled["txt"]) == 3
    h.close()


def test_hidden_walk_after_a_sampled_token_returns_only_its_inputs() -> None:
    """A walk that returns rows right after a sampling walk: its inputs' rows, embedded right.

    The last sampled token is computed with the next walk's inputs; it is not one of them.
    """
    h = Harness()
    h.submit("r", Walk(4, seed=1, mode="sample", max_tokens=2))
    h.run()
    h.submit("r", Walk(3, is_payload=True, mask=FULL, seed=2))
    h.run()
    h.submit("r", Walk(1, mode="sample", seed=3))
    h.run()
    h.submit("r", Walk(2, seed=4))
    h.run()
    assert h.num_checked == 5
    h.close()


@pytest.mark.parametrize("cut", ["payload", "expert_tokens"])
def test_a_cache_cut_inside_a_segment_is_never_shared_by_token_hash(cut: str) -> None:
    """A fork or truncation at a mark inside a payload (or expert-1) segment keeps those K/V
    out of the prefix cache: a plain prompt with the same ids computes its own."""
    h = Harness(block_size=4)
    first = Walk(6, is_payload=True, seed=1) if cut == "payload" else Walk(6, expert=1, seed=1)
    h.submit("src", first)
    h.run()
    h.fork("src", "forked", 2)
    h.submit("forked", Walk(7, seed=2))  # fills blocks 0 and 1 after the cut
    h.submit("src", Walk(1, seed=3))
    h.run()
    h.truncate("src", 3)
    h.submit("src", Walk(6, seed=4))
    h.run()
    for name in ("forked", "src"):
        seq = h.engine.get_sequence(name)
        h.submit(f"plain_{name}", Walk(9, mode="sample", token_ids=tuple(seq.token_ids[:9])))
        h.run()
    assert h.num_checked == 6
    h.close()


def test_a_walk_returning_rows_computes_them_even_when_its_prefix_is_cached() -> None:
    """A "hidden" walk whose tokens are in the prefix cache still returns (and computes) all its
    rows."""
    h = Harness(block_size=2)
    h.submit("a", Walk(9, seed=1, mode="none"))
    h.run()
    h.submit("b", Walk(9, seed=1))
    h.run()
    h.submit("a", Walk(1, seed=2, mode="sample"))  # and a sampling walk after it
    h.run()
    assert h.num_checked == 2
    h.close()


# -- random mixes in one step --------------------------------------------------------------------


masks = st.sampled_from(
    [CAUSAL, FULL, AttentionMask.block_causal(2), AttentionMask.block_causal(3)]
)
walks = st.builds(
    Walk,
    n=st.integers(1, 6),
    is_payload=st.booleans(),
    mask=masks,
    expert=st.sampled_from([0, 0, 1]),
    mode=st.sampled_from(["hidden", "hidden", "none", "sample"]),
    max_tokens=st.integers(1, 3),
    seed=st.integers(0, 2),  # few seeds: equal token prefixes hit the prefix cache
)
query_walks = st.builds(
    Walk,
    n=st.integers(1, 5),
    is_payload=st.booleans(),
    mask=masks,
    expert=st.sampled_from([0, 1]),
    seed=st.integers(0, 9),
)

Op = tuple[Literal["walk", "query", "truncate", "fork"], Any]
"""("walk", Walk), ("query", Walk), ("truncate", mark index), ("fork", (mark index, [Walk]))."""
ops = st.one_of(
    walks.map(lambda w: ("walk", w)),
    query_walks.map(lambda w: ("query", w)),
    st.integers(0, 9).map(lambda i: ("truncate", i)),
    st.tuples(st.integers(0, 9), st.lists(walks, min_size=1, max_size=2)).map(
        lambda f: ("fork", f)
    ),
)
programs = st.lists(st.tuples(walks, st.lists(ops, max_size=4)), min_size=1, max_size=4)


def _run_programs(h: Harness, programs: list[tuple[Walk, list[Op]]]) -> None:
    """Run every sequence's program at once: whoever is idle starts its next operation."""
    names = itertools.count()
    queues: dict[str, list[Op]] = {}
    for first, rest in programs:
        queues[f"r{next(names)}"] = [("walk", first), *rest]
    waiting_on: dict[str, str] = {}  # query id -> its parent (which waits for it)
    for _ in range(500):
        for request_id in list(queues):
            queue = queues[request_id]
            while queue and h.is_idle(request_id) and request_id not in waiting_on.values():
                kind, arg = queue.pop(0)
                marks = h.tracks[request_id].marks if request_id in h.tracks else []
                if kind == "walk":
                    h.submit(request_id, arg)
                elif kind == "query":
                    query_id = f"q{next(names)}"
                    h.query(request_id, query_id, arg)
                    waiting_on[query_id] = request_id
                elif kind == "truncate":
                    h.truncate(request_id, marks[arg % len(marks)])
                else:
                    index, child_walks = arg
                    child_id = f"f{next(names)}"
                    h.fork(request_id, child_id, marks[index % len(marks)])
                    queues[child_id] = [("walk", w) for w in child_walks]
        if not h.engine.has_unfinished():
            if not any(queues.values()):
                return
            continue
        for out in h.step():
            waiting_on.pop(out.request_id, None)
    raise AssertionError("the programs did not finish")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    programs=programs,
    block_size=st.integers(2, 4),
    budget=st.sampled_from([3, 8, 64]),
    prefix_caching=st.booleans(),
)
def test_random_pattern_mixes_match_dense(
    programs: list[tuple[Walk, list[Op]]], block_size: int, budget: int, prefix_caching: bool
) -> None:
    """Several sequences of random segments stepped together (one step mixes patterns) match
    dense."""
    h = Harness(block_size=block_size, budget=budget, prefix_caching=prefix_caching)
    _run_programs(h, programs)
    h.close()


token_walks = walks.filter(lambda w: not w.is_payload)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    programs=st.lists(
        st.tuples(token_walks, st.lists(token_walks.map(lambda w: ("walk", w)), max_size=3)),
        min_size=2,
        max_size=4,
    )
)
def test_preempted_and_evicted_walks_recompute_the_same_rows(
    programs: list[tuple[Walk, list[Op]]],
) -> None:
    """In a cache too small for all, token walks (any mask, expert, output mode) are
    preempted or evicted and recomputed, and still return the dense rows and logits."""
    h = Harness(block_size=2, num_blocks=20, budget=8)
    _run_programs(h, programs)
    h.close()


def test_a_tight_cache_preempts_and_recomputes() -> None:
    """The tight cache above does preempt: a fixed mix of hidden, full-mask and sampling walks."""
    h = Harness(block_size=2, num_blocks=20, budget=8)
    programs: list[tuple[Walk, list[Op]]] = [
        (
            Walk(6, seed=i, mode="none"),
            [
                ("walk", Walk(5, mask=FULL, expert=i % 2, seed=i)),
                ("walk", Walk(4, mode="sample", max_tokens=3, seed=i)),
            ],
        )
        for i in range(4)
    ]
    _run_programs(h, programs)
    assert h.engine.scheduler.num_preemptions > 0
    assert h.num_checked == 4 * 4
    h.close()


context_walks = st.lists(walks.filter(lambda w: w.mode != "sample"), min_size=2, max_size=3)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(context=context_walks, other=context_walks, query=query_walks, block_size=st.integers(2, 4))
def test_cfg_like_queries_in_one_step(
    context: list[Walk], other: list[Walk], query: Walk, block_size: int
) -> None:
    """Three read-only queries over one context, one over its fork taken before its last
    segment (the unconditional branch) and one over a separate context, all in one step."""
    h = Harness(block_size=block_size)
    for walk in context:
        h.submit("ctx", walk)
        h.run()
    for walk in other:
        h.submit("other", walk)
        h.run()
    h.fork("ctx", "uncond", h.tracks["ctx"].marks[-2])
    for i in range(3):
        h.query(
            "ctx",
            f"cond{i}",
            Walk(query.n, query.is_payload, query.mask, query.expert, seed=query.seed + i),
        )
    h.query("uncond", "q_uncond", query)
    h.query("other", "q_other", query)
    outs = h.step()
    assert {o.request_id for o in outs} == {"cond0", "cond1", "cond2", "q_uncond", "q_other"}
    assert not h.engine.has_unfinished()
    h.close()
