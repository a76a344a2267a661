"""Shared arena handoff, slot release, and removal of files left by dead processes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mstar.errors import ProtocolError
from mstar.transport.codec import LinkCodec
from mstar.transport.janitor import SHM_DIR, is_pid_alive, runtime_dir, sweep_stale
from mstar.transport.shm import ArenaMapping, SharedArena, is_shm_available
from mstar.wire import Tell, TensorBundle

pytestmark = pytest.mark.skipif(not is_shm_available(), reason="needs /dev/shm")


@pytest.fixture
def arena() -> Iterator[SharedArena]:
    arena = SharedArena(1 << 20)
    yield arena
    arena.close()


def test_a_peer_views_what_the_owner_wrote(arena: SharedArena) -> None:
    released: list[int] = []
    mapping = ArenaMapping(arena.name, arena.nbytes, released.append)
    source = torch.randn(64, 33)
    offset = arena.write(source)
    assert offset is not None
    view = mapping.tensor(offset, source.numel() * 4, torch.float32, source.shape)
    assert torch.equal(view, source)
    # Zero copy: the owner's later writes to the slot show through the view.
    arena._bytes[offset : offset + 4].view(torch.float32).fill_(7.0)  # type: ignore[index]
    assert view[0, 0].item() == 7.0
    mapping.close()


def test_the_slot_is_released_when_the_last_view_dies(arena: SharedArena) -> None:
    released: list[int] = []
    mapping = ArenaMapping(arena.name, arena.nbytes, released.append)
    offset = arena.write(torch.ones(1000))
    assert offset is not None
    view = mapping.tensor(offset, 4000, torch.float32, (1000,))
    part = view[10:20]
    del view
    gc.collect()
    assert released == []  # a slice still holds the slot
    assert part.sum().item() == 10
    del part
    gc.collect()
    assert released == [offset]


def test_the_arena_refuses_what_does_not_fit(arena: SharedArena) -> None:
    assert arena.write(torch.empty(2 << 20, dtype=torch.uint8)) is None
    first = arena.write(torch.empty(600 << 10, dtype=torch.uint8))
    assert first is not None
    assert arena.write(torch.empty(600 << 10, dtype=torch.uint8)) is None
    arena.free(first)
    assert arena.write(torch.empty(600 << 10, dtype=torch.uint8)) == first


def test_views_outside_the_arena_are_protocol_errors(arena: SharedArena) -> None:
    mapping = ArenaMapping(arena.name, arena.nbytes, lambda _: None)
    with pytest.raises(ProtocolError):
        mapping.tensor(arena.nbytes - 64, 128, torch.uint8, (128,))
    with pytest.raises(ProtocolError):
        mapping.tensor(3, 1, torch.uint8, (1,))
    with pytest.raises(ProtocolError):
        ArenaMapping(arena.name, arena.nbytes + 1, lambda _: None)
    with pytest.raises(ProtocolError):
        ArenaMapping("../etc/passwd", 10, lambda _: None)
    mapping.close()


def test_close_unlinks_the_segment(arena: SharedArena) -> None:
    path = arena.path
    assert path.exists()
    arena.close()
    assert not path.exists()
    assert arena.write(torch.ones(1)) is None


def test_codecs_hand_tensors_over_through_the_arena(arena: SharedArena) -> None:
    sender = LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1024)
    receiver = LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1024)
    sender.local_arena = arena
    releases: list[int] = []
    receiver.peer_arena = ArenaMapping(arena.name, arena.nbytes, releases.append)
    big, small = torch.randn(512, 8), torch.randn(4)
    frames = sender.encode(Tell("t", TensorBundle({"big": big, "small": small})))
    assert len(frames) == 2  # the big tensor went through the arena, the small one as a frame
    decoded = receiver.decode(frames)
    assert isinstance(decoded, Tell) and isinstance(decoded.body, TensorBundle)
    assert torch.equal(decoded.body.tensors["big"], big)
    assert torch.equal(decoded.body.tensors["small"], small)
    assert len(sender.sent_slots) == 1
    del decoded
    gc.collect()
    sender.release(releases)
    assert not sender.sent_slots and arena.allocator.num_allocated == 0
    with pytest.raises(ProtocolError):
        sender.release([0])  # not a slot this link holds


def test_a_full_arena_falls_back_to_frames(arena: SharedArena) -> None:
    sender = LinkCodec(max_message_bytes=8 << 20, shm_min_bytes=1024)
    sender.local_arena = arena
    frames = sender.encode(Tell("t", TensorBundle({"x": torch.zeros(2 << 20, dtype=torch.uint8)})))
    assert len(frames) == 2 and not sender.sent_slots
    assert torch.equal(
        LinkCodec(max_message_bytes=8 << 20, shm_min_bytes=1).decode(frames).body.tensors["x"],
        torch.zeros(2 << 20, dtype=torch.uint8),
    )  # type: ignore[union-attr]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_sweep_removes_files_of_dead_owners_only() -> None:
    dead = dead_pid()
    assert not is_pid_alive(dead)
    stale = [
        SHM_DIR / f"mstar-{dead}-00aa11",
        SHM_DIR / f"mstar-{dead}-00ee55.1",  # a tensor-parallel group's channel of node 1
        runtime_dir() / f"mstar-{dead}-00bb22.sock",
    ]
    live = [SHM_DIR / f"mstar-{os.getpid()}-00cc33"]
    unrelated = SHM_DIR / f"not-mstar-{dead}-00dd44"
    for path in [*stale, *live, unrelated]:
        path.write_bytes(b"")
    try:
        removed = sweep_stale(dead)
        assert sorted(removed) == sorted(stale)
        assert all(p.exists() for p in [*live, unrelated])
    finally:
        for path in [*stale, *live, unrelated]:
            path.unlink(missing_ok=True)


def test_a_zombie_counts_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Not reaped yet: wait for the exit without reaping (waitid with WNOWAIT).
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    try:
        assert Path(f"/proc/{child.pid}").exists()
        assert not is_pid_alive(child.pid)
    finally:
        child.wait()
    assert is_pid_alive(os.getpid())
