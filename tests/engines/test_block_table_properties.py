"""BlockManager under random forks, appends, truncations, releases, preemptions, reservations.

A simulated cache holds one token value per slot: appends write their tokens into the
slots the block tables name (after performing the copies `append` asks for), so every
block's content is known. After every operation each live sequence must read exactly its
computed tokens through its block table (shared blocks, copy-on-write and prefix hits
included), `check_invariants` must hold, and a reservation must keep its blocks. New
sequences take prompts from earlier sequences' tokens, and every check probes each recent
token list as a prompt: a block found by hash must hold the tokens its hash names. At the
end every block is free again: nothing leaked or freed twice.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mstar.engines import BlockManager, Sequence
from tests.helpers import make_sequence

ALPHABET = 3  # few token values: identical prefixes (hash hits) are common
MAX_LEN = 24
tokens_strategy = st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=6)


class BlockTableMachine(RuleBasedStateMachine):
    """Drive a `BlockManager` like a scheduler would and check it against a cache model."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager
        self.cache: list[int | None] = []
        self.live: dict[str, Sequence] = {}
        self.waiting: dict[str, Sequence] = {}  # preempted, no blocks, to be recomputed
        self.reserved_to: dict[str, int] = {}  # sequence -> token count its reservation covers
        self.history: list[tuple[int, ...]] = []  # token lists seen, for prompts that hit
        self.ids = itertools.count()

    @initialize(
        num_blocks=st.integers(4, 14),
        block_size=st.integers(2, 4),
        prefix_caching=st.sampled_from([True, True, False]),
    )
    def make_manager(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.cache = [None] * (num_blocks * block_size)

    # -- helpers ---------------------------------------------------------------------------

    def _new(self, tokens: list[int]) -> Sequence:
        return make_sequence(tokens, arrival=next(self.ids))

    def _write(self, seq: Sequence, num_new: int) -> None:
        """Append `num_new` tokens of `seq` (already in `token_ids`) like the runner would."""
        size = self.bm.block_size
        for src, dst in self.bm.append(seq, num_new):
            self.cache[dst * size : (dst + 1) * size] = self.cache[src * size : (src + 1) * size]
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            block = seq.block_table[pos // size]
            self.cache[block * size + pos % size] = seq.token_ids[pos]
        seq.num_computed_tokens += num_new
        self.history.append(tuple(seq.token_ids))

    def _admit(self, seq: Sequence) -> bool:
        """Admit a sequence with no blocks: cached prefix first, then compute the rest."""
        found = self.bm.allocate_cached_prefix(seq)
        assert found % self.bm.block_size == 0 and found < seq.num_tokens
        rest = seq.num_tokens - found
        if not self.bm.can_append(seq, rest):
            self.bm.free(seq)
            return False
        self._write(seq, rest)
        return True

    def _pick(self, data: st.DataObject, *, computed: bool = False) -> Sequence:
        names = sorted(n for n, s in self.live.items() if s.num_computed_tokens > 0 or not computed)
        return self.live[data.draw(st.sampled_from(names))]

    def _has_computed(self) -> bool:
        return any(s.num_computed_tokens > 0 for s in self.live.values())

    # -- operations ------------------------------------------------------------------------

    @precondition(lambda self: len(self.live) < 8)
    @rule(data=st.data(), suffix=tokens_strategy, from_history=st.booleans())
    def add(self, data: st.DataObject, suffix: list[int], from_history: bool) -> None:
        """A new sequence: its prompt often repeats an earlier sequence's tokens."""
        prompt: list[int] = []
        if from_history and self.history:
            base = data.draw(st.sampled_from(self.history))
            prompt = list(base[: data.draw(st.integers(1, len(base)))])
        prompt = (prompt + suffix)[:MAX_LEN]
        seq = self._new(prompt)
        if self._admit(seq):
            self.live[seq.request_id] = seq

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), tokens=tokens_strategy)
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        seq = self._pick(data)
        if seq.num_tokens + len(tokens) > MAX_LEN:
            return
        if not self.bm.can_append(seq, len(tokens)):
            assert self.bm.blocks_needed(seq, len(tokens)) > 0
            return
        seq.token_ids.extend(tokens)
        self._write(seq, len(tokens))

    @precondition(lambda self: self._has_computed() and len(self.live) < 8)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """A child sharing the parent's first `mark` tokens (any mark, mid-block too)."""
        parent = self._pick(data, computed=True)
        mark = data.draw(st.integers(1, parent.num_computed_tokens))
        child = self._new(parent.token_ids[:mark])
        self.bm.fork(parent, child, mark)
        self.live[child.request_id] = child
        # The parent's partial block is shared now: its next write copies it first (one
        # block its reservation did not count).
        self.reserved_to.pop(parent.request_id, None)

    @precondition(lambda self: self._has_computed())
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq = self._pick(data, computed=True)
        mark = data.draw(st.integers(1, seq.num_computed_tokens))
        seq.truncate(mark)
        self.bm.truncate(seq, mark)
        self.reserved_to.pop(seq.request_id, None)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = self._pick(data)
        self.bm.free(seq)
        del self.live[seq.request_id]
        self.reserved_to.pop(seq.request_id, None)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Free a sequence's blocks; it waits to be recomputed from its tokens."""
        seq = self._pick(data)
        self.bm.free(seq)
        del self.live[seq.request_id]
        self.reserved_to.pop(seq.request_id, None)
        self.waiting[seq.request_id] = seq

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def recompute(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.waiting)))
        seq = self.waiting[name]
        if self._admit(seq):
            del self.waiting[name]
            self.live[name] = seq

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), extra=st.integers(0, 8))
    def reserve(self, data: st.DataObject, extra: int) -> None:
        """Hold back blocks for `extra` more tokens; they must stay available to this sequence."""
        seq = self._pick(data)
        target = seq.num_computed_tokens + extra
        if self.bm.can_reserve(seq, target):
            self.bm.reserve(seq, target)
            self.reserved_to[seq.request_id] = target

    # -- checks ----------------------------------------------------------------------------

    @invariant()
    def sequences_read_their_tokens(self) -> None:
        bm = getattr(self, "bm", None)
        if bm is None:
            return
        size = bm.block_size
        for seq in self.live.values():
            assert len(seq.block_table) == -(-seq.num_computed_tokens // size), seq
            read = [
                self.cache[seq.block_table[p // size] * size + p % size]
                for p in range(seq.num_computed_tokens)
            ]
            assert read == seq.token_ids[: seq.num_computed_tokens], (seq, read, seq.token_ids)
        bm.check_invariants(list(self.live.values()))
        for seq in self.waiting.values():
            assert not seq.block_table and seq.num_computed_tokens == 0 and not seq.reserved_blocks
        for tokens in dict.fromkeys(reversed(self.history[-40:])):
            # Any prefix a new sequence could hit now must hold the tokens it is found by.
            probe = self._new([*tokens, 0])
            found = bm.allocate_cached_prefix(probe)
            read = [
                self.cache[probe.block_table[p // size] * size + p % size] for p in range(found)
            ]
            bm.free(probe)
            assert read == list(tokens[:found]), (tokens, read, probe)
        for name, target in self.reserved_to.items():
            seq = self.live[name]
            if target > seq.num_computed_tokens:
                assert bm.can_append(seq, target - seq.num_computed_tokens), (seq, target)

    def teardown(self) -> None:
        bm = getattr(self, "bm", None)
        if bm is None:
            return
        for seq in self.live.values():
            bm.free(seq)
        bm.check_invariants([])
        assert bm.num_free_blocks == bm.num_blocks
        assert bm.num_reserved_blocks == 0


BlockTableMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockTableProperties = BlockTableMachine.TestCase
