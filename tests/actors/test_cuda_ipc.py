"""CUDA IPC handoff: handles, not bytes, between processes on one machine (GPU tests skip here).

The CPU tests fake torch's view of the devices (`fake_devices`) and record the references
given back (`releases`); the GPU tests check the same against a real allocator.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
import torch.multiprocessing.reductions

from mstar.actors import Actor, ActorSystem
from mstar.actors.link import PeerLink, shared_cuda_devices
from mstar.actors.process import SystemProcess
from mstar.errors import MessageTooLargeError, PeerLostError, ProtocolError
from mstar.transport.codec import LinkCodec
from mstar.transport.cuda_ipc import (
    export_cuda_tensor,
    import_cuda_tensor,
    local_cuda_device_uuids,
    release_cuda_handle,
)
from mstar.wire import CudaIpcLoc, Hello, Tell, TensorBundle, decode_envelope
from tests.actors.conftest import TEST_CONFIG
from tests.actors.peer_actors import Echo

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CONFIG = replace(TEST_CONFIG, heartbeat_interval_s=0.2, heartbeat_timeout_s=20.0)


def fake_loc(**changes: object) -> CudaIpcLoc:
    fields = dict(
        device=0,
        handle=b"h" * 64,
        storage_size_bytes=64,
        storage_offset_bytes=0,
        ref_counter_handle=b"r",
        ref_counter_offset=0,
        event_handle=None,
        event_sync_required=False,
        stride=(1,),
        storage_offset=0,
        device_uuid="",
    )
    fields.update(changes)
    return CudaIpcLoc(**fields)  # type: ignore[arg-type]


def tell_header(*refs: list[Any]) -> bytes:
    """The header of a Tell carrying a TensorBundle of these raw tensor refs, as a peer sends it."""
    tensors = {f"t{i}": ref for i, ref in enumerate(refs)}
    return msgspec.msgpack.encode(["Tell", "t", ["TensorBundle", tensors, ""]])


def cuda_ref(loc: CudaIpcLoc, dtype: str = "float32", shape: tuple[int, ...] = (4,)) -> list[Any]:
    return [dtype, list(shape), ["CudaIpcLoc", *msgspec.structs.astuple(loc)]]


# ----------------------------------------------------------------------- CPU: fakes


@pytest.fixture
def fake_devices(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Return a function that makes torch see CUDA devices with these UUIDs (none: no CUDA)."""

    def install(*uuids: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(uuids))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i])
        )
        local_cuda_device_uuids.cache_clear()

    yield install
    local_cuda_device_uuids.cache_clear()


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, int]]:
    """Record every reference given back through torch, instead of giving it back."""
    calls: list[tuple[bytes, int]] = []
    monkeypatch.setattr(
        torch.UntypedStorage,
        "_release_ipc_counter_cuda",
        staticmethod(lambda h, o: calls.append((h, o))),
    )
    return calls


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record the arguments of every handle opened, instead of opening it (a CPU tensor stands
    in)."""
    calls: list[tuple[Any, ...]] = []

    def rebuild(*args: Any) -> torch.Tensor:
        calls.append(args)
        return torch.zeros(args[1])

    monkeypatch.setattr(torch.multiprocessing.reductions, "rebuild_cuda_tensor", rebuild)
    return calls


class FakeChannel:
    def __init__(self) -> None:
        self.codec = LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1)
        self.sent: list[Any] = []

    def send(self, envelope: Any) -> None:
        self.sent.append(envelope)

    async def aclose(self) -> None:
        pass


class FakeSystem:
    """What a `PeerLink` asks of its system, and no more."""

    def __init__(self) -> None:
        self._host_id = "host"
        self._arena = None
        self.config = SimpleNamespace(shm_arena_bytes=0)

    def _hello(self) -> Hello:
        return Hello("me", ["ipc://me"], os.getpid(), self._host_id)

    def _register_link(self, link: PeerLink, hello: Hello) -> None:
        pass

    def _forget_link(self, link: PeerLink, error: Exception | None = None) -> None:
        pass

    def _spawn_task(self, coro: Any, name: str | None = None) -> None:
        coro.close()


def peer_hello(*uuids: str, can: bool = True, pid: int | None = None, host: str = "host") -> Hello:
    return Hello(
        "peer",
        ["ipc://peer"],
        os.getppid() if pid is None else pid,
        host,
        cuda_ipc=can,
        cuda_device_uuids=list(uuids),
    )


def accept(hello: Hello) -> tuple[PeerLink, FakeChannel]:
    """Run the server side of a handshake with a peer that says `hello`."""
    channel = FakeChannel()
    link = PeerLink(FakeSystem(), channel, None)  # type: ignore[arg-type]
    link.on_envelope(hello)
    return link, channel


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ------------------------------------------------------------------ CPU: the handshake


@pytest.mark.parametrize(
    ("local", "peer", "shared"),
    [
        (("A", "B"), peer_hello("B", "C"), {"B"}),  # both can, one device in common
        (("A", "B"), peer_hello("A", "B", can=False), set()),  # the peer cannot open handles
        ((), peer_hello("A"), set()),  # this side has no CUDA
        (("A",), peer_hello("B"), set()),  # disjoint devices
        (("A",), peer_hello("A", pid=os.getpid()), set()),  # the same process
        (("A",), peer_hello("A", host="elsewhere"), set()),  # another machine
    ],
    ids=["shared", "peer-without-cuda", "no-local-cuda", "disjoint", "same-pid", "other-host"],
)
async def test_the_hellos_decide_cuda_ipc(
    fake_devices: Any, local: tuple[str, ...], peer: Hello, shared: set[str]
) -> None:
    fake_devices(*local)
    link, channel = accept(peer)
    assert link.codec is not None
    assert link.codec.cuda_ipc == bool(shared)
    assert link.codec.cuda_ipc_device_uuids == shared
    # The answer says what this side offers.
    (answer,) = channel.sent
    assert answer.cuda_ipc == bool(local) and answer.cuda_device_uuids == list(local)


def test_a_hello_from_before_cuda_fields_means_no_ipc(fake_devices: Any) -> None:
    fake_devices("A")
    old = msgspec.msgpack.encode(
        ["Hello", "peer", ["ipc://peer"], os.getppid(), "host", 2, 0, None]
    )
    hello = decode_envelope(old)
    assert isinstance(hello, Hello) and not hello.cuda_ipc and hello.cuda_device_uuids == []
    assert shared_cuda_devices(hello, same_host=True) == frozenset()
    # ... and an old peer reads a new hello, ignoring what it does not know.
    old_hello = msgspec.defstruct(
        "Hello",
        [("system_id", str), ("addresses", list[str]), ("pid", int), ("host_id", str)],
        array_like=True,
        tag=True,
    )
    new = msgspec.msgpack.encode(peer_hello("A"))
    assert msgspec.structs.astuple(msgspec.msgpack.decode(new, type=old_hello))[2] == os.getppid()


# ------------------------------------------------------------- CPU: opening and refusing


def test_the_receiver_opens_a_handle_on_its_own_index_of_the_uuid(
    fake_devices: Any, opened: list[Any], releases: list[Any]
) -> None:
    fake_devices("A", "B", "C")
    # The sender knew the device as its cuda:0 (say, CUDA_VISIBLE_DEVICES=2 there).
    import_cuda_tensor(fake_loc(device=0, device_uuid="C"), torch.float32, (4,))
    ((*_, device, _handle, _size, _offset, _grad, counter, counter_offset, _ev, _sync),) = opened
    assert device == 2
    assert (counter, counter_offset) == (b"r", 0)
    assert releases == []  # an opened handle is given back by its storage when it dies


@pytest.mark.parametrize(
    ("local", "loc", "error"),
    [
        ((), fake_loc(device_uuid="A"), "CUDA is not available"),
        (("A",), fake_loc(), "names no device UUID"),
        (("A",), fake_loc(device_uuid="GPU-gone"), "GPU-gone, which does not exist here"),
        (("A",), fake_loc(device_uuid="A", stride=(1, 1)), "does not match shape"),
        (("A",), fake_loc(device_uuid="A", stride=(8,)), "outside its storage"),
        (("A",), fake_loc(device_uuid="A", stride=(-1,), storage_offset=3), "outside its storage"),
    ],
    ids=["no-cuda", "no-uuid", "unknown-uuid", "stride-rank", "out-of-bounds", "negative-stride"],
)
def test_every_refused_handle_is_released(
    fake_devices: Any,
    releases: list[Any],
    opened: list[Any],
    local: tuple[str, ...],
    loc: CudaIpcLoc,
    error: str,
) -> None:
    fake_devices(*local)
    loc = msgspec.structs.replace(loc, ref_counter_handle=b"/torch_1_2_3", ref_counter_offset=7)
    with pytest.raises(ProtocolError, match=error):
        import_cuda_tensor(loc, torch.float32, (4,))
    assert releases == [(b"/torch_1_2_3", 7)]
    assert opened == []


def test_a_handle_cuda_fails_to_open_is_released(
    fake_devices: Any, releases: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_devices("A")

    def fail(*args: Any) -> torch.Tensor:
        raise RuntimeError("CUDA error: invalid resource handle")

    monkeypatch.setattr(torch.multiprocessing.reductions, "rebuild_cuda_tensor", fail)
    with pytest.raises(ProtocolError, match="cannot open a CUDA IPC handle on cuda:0"):
        import_cuda_tensor(fake_loc(device_uuid="A", ref_counter_offset=5), torch.float32, (4,))
    assert releases == [(b"r", 5)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_a_cuda_handle_on_a_host_without_cuda_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="CUDA is not available"):
        import_cuda_tensor(fake_loc(), torch.float32, (4,))
    with pytest.raises(ProtocolError, match="CUDA"):
        LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1).decode(
            [tell_header(cuda_ref(fake_loc()))]
        )


def test_cpu_tensors_have_no_ipc_handle() -> None:
    with pytest.raises(ProtocolError, match="CUDA"):
        export_cuda_tensor(torch.ones(3))


# -------------------------------------------------------------- CPU: the codec's paths


def agreed_codec(max_message_bytes: int = 1 << 20) -> LinkCodec:
    codec = LinkCodec(max_message_bytes=max_message_bytes, shm_min_bytes=1)
    codec.cuda_ipc, codec.cuda_ipc_device_uuids = True, frozenset({"A"})
    return codec


def test_a_handle_on_a_link_without_ipc_is_released(
    fake_devices: Any, releases: list[Any], opened: list[Any]
) -> None:
    fake_devices("A")
    codec = LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1)
    with pytest.raises(ProtocolError, match="did not agree to CUDA IPC"):
        codec.decode([tell_header(cuda_ref(fake_loc(device_uuid="A", ref_counter_offset=3)))])
    assert releases == [(b"r", 3)] and opened == []


def test_handles_after_a_refused_tensor_are_released(
    fake_devices: Any, releases: list[Any], opened: list[Any]
) -> None:
    fake_devices("A")
    first = fake_loc(device_uuid="A", ref_counter_offset=1)
    last = fake_loc(device_uuid="A", ref_counter_offset=2)
    missing_frame = ["float32", [4], ["FrameLoc", 5]]
    header = tell_header(cuda_ref(first), missing_frame, cuda_ref(last))
    with pytest.raises(ProtocolError, match="missing or reused frame"):
        agreed_codec().decode([header])
    # The first was opened (its tensor gives the reference back as it dies); the last never was.
    assert len(opened) == 1
    assert releases == [(b"r", 2)]


def test_handles_of_an_oversize_or_malformed_message_are_released(
    fake_devices: Any, releases: list[Any], opened: list[Any]
) -> None:
    fake_devices("A")
    header = tell_header(cuda_ref(fake_loc(device_uuid="A", ref_counter_offset=4)))
    with pytest.raises(MessageTooLargeError):
        agreed_codec(max_message_bytes=16).decode([header])
    assert releases == [(b"r", 4)]
    releases.clear()
    bad_dtype = tell_header(
        cuda_ref(fake_loc(device_uuid="A", ref_counter_offset=6), dtype="float13")
    )
    with pytest.raises(ProtocolError, match="unknown dtype"):
        agreed_codec().decode([bad_dtype])
    assert releases == [(b"r", 6)] and opened == []


def test_a_reference_named_twice_is_refused(
    fake_devices: Any, releases: list[Any], opened: list[Any]
) -> None:
    fake_devices("A")
    loc = fake_loc(device_uuid="A", ref_counter_offset=8)
    with pytest.raises(ProtocolError, match="twice"):
        agreed_codec().decode([tell_header(cuda_ref(loc), cuda_ref(loc))])
    assert len(opened) == 1 and releases == []  # released once, when the opened tensor dies


async def test_handles_sent_to_a_peer_that_exited_are_released(
    fake_devices: Any, releases: list[Any]
) -> None:
    fake_devices("A")
    link, _ = accept(peer_hello("A"))
    assert link.codec is not None and link.codec.cuda_ipc and link.watched_pid == os.getppid()
    link.codec.sent_cuda_handles.extend([(b"r", 1), (b"r", 2)])
    link.watched_pid = dead_pid()
    link.lose(PeerLostError("gone"))
    assert releases == [(b"r", 1), (b"r", 2)]
    assert not link.codec.sent_cuda_handles


async def test_handles_sent_to_a_live_peer_are_not_released_with_its_link(
    fake_devices: Any, releases: list[Any]
) -> None:
    fake_devices("A")
    link, _ = accept(peer_hello("A"))
    assert link.codec is not None
    link.codec.sent_cuda_handles.append((b"r", 1))
    link.lose(PeerLostError("said goodbye"), graceful=True)  # it may still hold them open
    assert releases == []


# ----------------------------------------------------------------------------- GPU


class Holder(Actor):
    """Keep the tensors of a TensorBundle with key "keep"; any other bundle returns them on the
    CPU."""

    def __init__(self) -> None:
        self.kept: dict[str, torch.Tensor] = {}

    async def handle(self, message: Any) -> Any:
        if message.key == "keep":
            self.kept.update(message.tensors)
            return None
        kept, self.kept = self.kept, {}
        return TensorBundle({name: tensor.cpu() for name, tensor in kept.items()})


async def setup_peer(system: ActorSystem) -> None:
    """The peer process of the two-process tests: an echo and a holder."""
    await system.spawn(Echo, name="echo")
    await system.spawn(Holder, name="holder")


def allocated_after_collect() -> int:
    gc.collect()  # a traceback may still hold a frame that held a tensor
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return torch.cuda.memory_allocated()


@needs_cuda
@pytest.mark.gpu
def test_out_of_bounds_strides_are_refused() -> None:
    uuid = local_cuda_device_uuids()[0]
    with pytest.raises(ProtocolError, match="outside its storage"):
        import_cuda_tensor(fake_loc(stride=(8,), device_uuid=uuid), torch.float32, (4,))
    with pytest.raises(ProtocolError, match="does not exist"):
        import_cuda_tensor(fake_loc(device_uuid="GPU-not-here"), torch.float32, (4,))


@needs_cuda
@pytest.mark.gpu
def test_a_refused_or_undelivered_handle_pins_nothing() -> None:
    base = allocated_after_collect()
    # Control: an export nobody gives back keeps its block after the tensor died.
    x = torch.ones(1 << 20, device="cuda")
    loc = export_cuda_tensor(x)
    del x
    assert allocated_after_collect() > base
    release_cuda_handle(loc.ref_counter_handle, loc.ref_counter_offset)
    assert allocated_after_collect() <= base
    # A handle the receiver refuses (here before opening) is given back by the refusal.
    y = torch.ones(1 << 20, device="cuda")
    with pytest.raises(ProtocolError, match="outside its storage"):
        import_cuda_tensor(
            msgspec.structs.replace(export_cuda_tensor(y), stride=(4,)), torch.float32, (1 << 20,)
        )
    del y
    assert allocated_after_collect() <= base
    # A message that fails to encode gives back the handles it took.
    codec = LinkCodec(max_message_bytes=100, shm_min_bytes=1)
    codec.cuda_ipc, codec.cuda_ipc_device_uuids = True, frozenset(local_cuda_device_uuids())
    z = torch.ones(1 << 20, device="cuda")
    with pytest.raises(MessageTooLargeError):
        codec.encode(Tell("t", TensorBundle({"z": z})))
    del z
    assert allocated_after_collect() <= base


@needs_cuda
@pytest.mark.gpu
def test_cuda_tensors_are_encoded_as_handles() -> None:
    codec = LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1)
    codec.cuda_ipc, codec.cuda_ipc_device_uuids = True, frozenset(local_cuda_device_uuids())
    x = torch.randn(256, 256, device="cuda")
    frames = codec.encode(Tell("t", TensorBundle({"x": x, "t": x.t()})))
    assert len(frames) == 1  # no tensor bytes in the message
    assert b"CudaIpcLoc" in bytes(frames[0]) and len(frames[0]) < 2048
    codec.release_cuda_sent()  # never delivered
    # A device the peer does not see goes by bytes, as without the link's consent.
    codec.cuda_ipc_device_uuids = frozenset({"GPU-elsewhere"})
    assert len(codec.encode(Tell("t", TensorBundle({"x": x})))) == 2
    codec.cuda_ipc = False
    assert len(codec.encode(Tell("t", TensorBundle({"x": x})))) == 2


@needs_cuda
@pytest.mark.gpu
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_cuda_tensors_cross_processes_by_handle() -> None:
    process = SystemProcess(
        "tests.actors.test_cuda_ipc:setup_peer", serve=["ipc://"], config=CONFIG
    )
    (address,) = await asyncio.to_thread(process.start)
    try:
        async with ActorSystem(CONFIG) as client:
            await client.connect(address)
            link = client._routes[address]
            assert link.codec is not None and link.codec.cuda_ipc
            x = torch.randn(1024, 512, device="cuda")
            strided = torch.randn(64, 128, device="cuda").t()
            # The echo actor doubles them on its GPU and answers with handles of its own.
            reply = await client.ref("echo", address).ask(TensorBundle({"x": x, "s": strided}))
            assert reply.tensors["x"].is_cuda and reply.tensors["s"].is_cuda
            torch.testing.assert_close(reply.tensors["x"], x * 2)
            torch.testing.assert_close(reply.tensors["s"], strided * 2)
            del reply
            torch.cuda.synchronize()
            # counted as the tensors' bytes, under cuda_ipc, both ways; nothing as frames or slots
            moved = (1024 * 512 + 64 * 128) * 4
            tally = client.transport_tally
            assert tally.sent["cuda_ipc"] == tally.received["cuda_ipc"] == moved
            assert (
                tally.sent["ipc"]
                == tally.sent["shm"]
                == tally.received["ipc"]
                == tally.received["shm"]
                == 0
            )
    finally:
        await asyncio.to_thread(process.stop)


async def settles_at(baseline: int, timeout_s: float = 10.0) -> bool:
    """Wait until this process's allocated CUDA memory is back at `baseline`.

    The peer gives its references back as its copies die, which no message reports: this
    polls torch's collection until then, or until `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while allocated_after_collect() > baseline:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@needs_cuda
@pytest.mark.gpu
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_sent_blocks_outlive_the_sender_and_are_freed_after_use() -> None:
    process = SystemProcess(
        "tests.actors.test_cuda_ipc:setup_peer", serve=["ipc://"], config=CONFIG
    )
    (address,) = await asyncio.to_thread(process.start)
    try:
        async with ActorSystem(CONFIG) as client:
            await client.connect(address)
            assert client._routes[address].codec.cuda_ipc  # type: ignore[union-attr]
            baseline = allocated_after_collect()
            n = 1 << 20
            sent = torch.arange(n, device="cuda", dtype=torch.float32)
            expected = sent.cpu()
            client.ref("holder", address).tell(TensorBundle({"x": sent}, key="keep"))
            # The sender drops its tensor at once and allocates blocks of the same size: were
            # the sent block back in the cache, these would take it and overwrite it.
            del sent
            junk = [torch.full((n,), -1.0, device="cuda") for _ in range(4)]
            torch.cuda.synchronize()
            del junk
            kept = await client.ref("holder", address).ask(TensorBundle({}, key="give"))
            assert torch.equal(kept.tensors["x"], expected)
            assert await settles_at(baseline)
            # Round trips: every block sent is freed once the peer dropped its view.
            echo = client.ref("echo", address)
            for i in range(20):
                x = torch.full((256, 1024), float(i), device="cuda")
                reply = await echo.ask(TensorBundle({"x": x}))
                assert reply.tensors["x"].is_cuda and reply.tensors["x"][0, 0].item() == 2 * i
                del x, reply
            assert await settles_at(baseline)
    finally:
        await asyncio.to_thread(process.stop)
