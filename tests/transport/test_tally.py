"""Tensor bytes per transport: counted by the codec for whole messages only, payloads only."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from mstar.errors import MessageTooLargeError, ProtocolError
from mstar.transport.codec import LinkCodec
from mstar.transport.shm import ArenaMapping, SharedArena, is_shm_available
from mstar.transport.tally import TRANSPORT_KINDS, TransportTally
from mstar.wire import Ping, Tell, TensorBundle


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_frames_count_under_the_links_scheme_headers_do_not() -> None:
    sent, received = TransportTally(), TransportTally()
    sender = LinkCodec(
        max_message_bytes=1 << 20, shm_min_bytes=1 << 30, transport="tcp", tally=sent
    )
    receiver = LinkCodec(
        max_message_bytes=1 << 20, shm_min_bytes=1 << 30, transport="tcp", tally=received
    )
    a, b = torch.randn(100, 3), torch.arange(7, dtype=torch.int16)
    receiver.decode(sender.encode(Tell("x", TensorBundle({"a": a, "b": b}))))
    # no tensors: nothing counted
    receiver.decode(sender.encode(Tell("x", Ping(1, b"not a tensor"))))
    assert sent.sent == {"ipc": 0, "tcp": nbytes(a) + nbytes(b), "shm": 0, "cuda_ipc": 0}
    assert received.received == sent.sent
    assert sum(sent.received.values()) == sum(received.sent.values()) == 0
    assert received.snapshot()["tcp"] == {"sent": 0, "received": nbytes(a) + nbytes(b)}


def test_a_message_that_fails_counts_nothing() -> None:
    tally = TransportTally()
    codec = LinkCodec(max_message_bytes=1000, shm_min_bytes=1 << 30, tally=tally)
    with pytest.raises(MessageTooLargeError):
        codec.encode(Tell("x", TensorBundle({"big": torch.zeros(1000)})))
    good = codec.encode(Tell("x", TensorBundle({"t": torch.ones(4)})))
    with pytest.raises(ProtocolError):
        codec.decode([*good, b"stray frame"])  # a frame no tensor refers to
    with pytest.raises(ProtocolError):
        codec.decode([good[0], b"\x00" * 3])  # the frame does not hold the tensor
    assert tally.sent["ipc"] == 16 and tally.received["ipc"] == 0
    codec.decode(good)
    assert tally.received["ipc"] == 16


def test_another_scheme_is_listed_when_its_codec_is_made() -> None:
    tally = TransportTally()
    assert tuple(tally.sent) == TRANSPORT_KINDS
    LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1, transport="vsock", tally=tally)
    assert tally.snapshot()["vsock"] == {"sent": 0, "received": 0}


@pytest.fixture
def arena() -> Iterator[SharedArena]:
    if not is_shm_available():
        pytest.skip("needs /dev/shm")
    arena = SharedArena(1 << 20)
    yield arena
    arena.close()


def test_arena_slots_count_as_shm_small_tensors_as_frames(arena: SharedArena) -> None:
    sent, received = TransportTally(), TransportTally()
    sender = LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1024, transport="ipc", tally=sent)
    receiver = LinkCodec(
        max_message_bytes=1 << 20, shm_min_bytes=1024, transport="ipc", tally=received
    )
    sender.local_arena = arena
    releases: list[int] = []
    receiver.peer_arena = ArenaMapping(arena.name, arena.nbytes, releases.append)
    big, small = torch.randn(512, 8), torch.randn(4)
    decoded = receiver.decode(sender.encode(Tell("t", TensorBundle({"big": big, "small": small}))))
    assert sent.sent == {"ipc": nbytes(small), "tcp": 0, "shm": nbytes(big), "cuda_ipc": 0}
    assert received.received == sent.sent
    del decoded
    gc.collect()
    sender.release(releases)
    receiver.peer_arena.close()
