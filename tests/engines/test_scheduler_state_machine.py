"""Random arrivals, aborts, stops, forks and block budgets against the real engine.

Invariants after every rule: ref counts equal the block tables held, the free list is
exact, and every request is in exactly one state. At the end every request finishes (or
was aborted), no block leaks, and every walk's tokens equal running that request alone.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams, SequenceStatus
from mstar.errors import RequestNotFoundError

from .conftest import make_tiny_llama

VOCAB = 32
MODEL = make_tiny_llama(dtype=torch.float64, vocab_size=VOCAB, hidden_size=16, num_layers=2)
MAX_PROMPT = 12
MAX_TOKENS = 8
_ALONE_CACHE: dict[tuple, list[list[int]]] = {}

Walk = tuple[tuple[int, ...], SamplingParams]  # (new input tokens, params)


def run_alone(prompt: tuple[int, ...], walks: tuple[Walk, ...]) -> list[list[int]]:
    """Run one request's walks alone in a roomy engine; return each walk's tokens."""
    key = (prompt, walks)
    if key not in _ALONE_CACHE:
        engine = KVCacheEngine(MODEL, KVCacheEngineConfig(block_size=4, num_blocks=64))
        results: list[list[int]] = []
        for index, (tokens, params) in enumerate(walks):
            if index == 0:
                engine.add_request("r", list(prompt), params, keep_alive=True)
            else:
                engine.resume("r", list(tokens), params)
            got: list[int] = []
            while engine.has_unfinished():
                for out in engine.step():
                    got.extend(out.new_token_ids)
            results.append(got)
        engine.release("r")
        _ALONE_CACHE[key] = results
    return _ALONE_CACHE[key]


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.0, 1.0]),
    top_k=st.sampled_from([0, 5]),
    max_tokens=st.integers(1, MAX_TOKENS),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2).map(tuple),
    seed=st.integers(0, 2**16),
)


class EngineMachine(RuleBasedStateMachine):
    """Drive a `KVCacheEngine` with random operations and check it throughout."""

    paused = Bundle("paused")

    def __init__(self) -> None:
        super().__init__()
        self.engine: KVCacheEngine
        self.counter = 0
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.walks: dict[str, list[Walk]] = {}
        self.outputs: dict[str, list[list[int]]] = {}
        self.live: set[str] = set()
        self.done: set[str] = set()
        self.aborted: set[str] = set()
        self.prefixes: list[tuple[int, ...]] = []

    @initialize(
        block_size=st.sampled_from([2, 4]),
        spare_blocks=st.integers(0, 24),
        max_num_batched_tokens=st.integers(4, 24),
        max_num_seqs=st.integers(1, 6),
        prefix_caching=st.booleans(),
    )
    def make_engine(
        self,
        block_size: int,
        spare_blocks: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefix_caching: bool,
    ) -> None:
        # At least one longest walk fits alone (prompt, outputs and two resumes).
        longest = MAX_PROMPT + 3 * MAX_TOKENS + 4
        num_blocks = -(-longest // block_size) + spare_blocks
        self.engine = KVCacheEngine(
            MODEL,
            KVCacheEngineConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=prefix_caching,
            ),
        )

    def _new_id(self) -> str:
        self.counter += 1
        return f"req{self.counter}"

    def _add(self, prompt: tuple[int, ...], params: SamplingParams, keep_alive: bool) -> None:
        request_id = self._new_id()
        self.engine.add_request(request_id, list(prompt), params, keep_alive=keep_alive)
        self.prompts[request_id] = prompt
        self.walks[request_id] = [((), params)]
        self.outputs[request_id] = [[]]
        self.live.add(request_id)
        self.prefixes.append(prompt)

    @rule(
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_PROMPT),
        params=params_strategy,
        keep_alive=st.booleans(),
    )
    def add_request(self, prompt: list[int], params: SamplingParams, keep_alive: bool) -> None:
        self._add(tuple(prompt), params, keep_alive)

    @precondition(lambda self: bool(self.prefixes))
    @rule(
        data=st.data(),
        suffix=st.lists(st.integers(0, VOCAB - 1), max_size=4),
        params=params_strategy,
    )
    def add_shared_prefix(
        self, data: st.DataObject, suffix: list[int], params: SamplingParams
    ) -> None:
        base = data.draw(st.sampled_from(self.prefixes))
        prompt = (base + tuple(suffix))[:MAX_PROMPT]
        self._add(prompt, params, keep_alive=False)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        assert self.engine.abort(request_id)
        self.live.discard(request_id)
        self.aborted.add(request_id)

    @rule(num_steps=st.integers(1, 6))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self._one_step()

    def _one_step(self) -> None:
        for out in self.engine.step():
            self.outputs[out.request_id][-1].extend(out.new_token_ids)
            if out.finished:
                seq_done = out.request_id not in {s for s in self.engine.scheduler.paused}
                if seq_done:
                    self.live.discard(out.request_id)
                    self.done.add(out.request_id)

    def _paused_ids(self) -> list[str]:
        return sorted(self.engine.scheduler.paused)

    @precondition(lambda self: bool(self.engine.scheduler.paused))
    @rule(
        data=st.data(),
        params=params_strategy,
        new_tokens=st.lists(st.integers(0, VOCAB - 1), max_size=3),
    )
    def resume(self, data: st.DataObject, params: SamplingParams, new_tokens: list[int]) -> None:
        request_id = data.draw(st.sampled_from(self._paused_ids()))
        if len(self.walks[request_id]) >= 3:
            self.engine.release(request_id)
            self.live.discard(request_id)
            self.done.add(request_id)
            return
        self.engine.resume(request_id, new_tokens, params, keep_alive=True)
        self.walks[request_id].append((tuple(new_tokens), params))
        self.outputs[request_id].append([])

    @precondition(lambda self: bool(self.engine.scheduler.paused))
    @rule(data=st.data(), params=params_strategy)
    def fork_and_resume(self, data: st.DataObject, params: SamplingParams) -> None:
        parent_id = data.draw(st.sampled_from(self._paused_ids()))
        parent = self.engine.get_sequence(parent_id)
        if parent.num_tokens + params.max_tokens > self.engine.max_model_len:
            return
        child_id = self._new_id()
        if not parent.block_table:  # evicted while paused: nothing to share until it runs again
            with pytest.raises(RequestNotFoundError, match="holds no cache"):
                self.engine.fork(parent_id, child_id, keep_alive=False)
            return
        self.engine.fork(parent_id, child_id, keep_alive=False)
        self.engine.resume(child_id, [], params)
        # A fork continues from all of the parent's tokens as if they were its prompt.
        self.prompts[child_id] = tuple(parent.token_ids)
        self.walks[child_id] = [((), params)]
        self.outputs[child_id] = [[]]
        self.live.add(child_id)

    @precondition(lambda self: bool(self.engine.scheduler.paused))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self._paused_ids()))
        self.engine.release(request_id)
        self.live.discard(request_id)
        self.done.add(request_id)

    @invariant()
    def blocks_are_consistent(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        sched = engine.scheduler
        held = [engine.get_sequence(r) for r in self.live]
        engine.block_manager.check_invariants(held)
        states = {
            "waiting": {s.request_id for s in sched.waiting},
            "running": {s.request_id for s in sched.running},
            "paused": set(sched.paused),
        }
        members = [r for group in states.values() for r in group]
        assert sorted(members) == sorted(self.live), (states, self.live)
        for seq in sched.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table

    def teardown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            self._one_step()
        assert not engine.has_unfinished(), "requests never finished"
        for request_id in self._paused_ids():
            engine.release(request_id)
            self.live.discard(request_id)
            self.done.add(request_id)
        assert not self.live
        assert engine.num_requests == 0
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        engine.block_manager.check_invariants([])
        for request_id in self.done:
            expected = run_alone(self.prompts[request_id], tuple(self.walks[request_id]))
            assert self.outputs[request_id] == expected, request_id


EngineMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineStateMachine = EngineMachine.TestCase
