"""CUDA IPC handoff: handles, not bytes, between processes on one machine (GPU tests skip here)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import msgspec
import pytest
import torch

from mstar.actors import ActorSystem
from mstar.actors.process import SystemProcess
from mstar.actors.wire import CudaIpcLoc, Tell, TensorBundle
from mstar.errors import ProtocolError
from mstar.transport.codec import LinkCodec
from mstar.transport.cuda_ipc import export_cuda_tensor, import_cuda_tensor
from tests.actors.conftest import TEST_CONFIG

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CONFIG = replace(TEST_CONFIG, heartbeat_interval_s=0.2, heartbeat_timeout_s=20.0)


def fake_loc(**changes: object) -> CudaIpcLoc:
    fields = dict(
        device=0, handle=b"h" * 64, storage_size_bytes=64, storage_offset_bytes=0,
        ref_counter_handle=b"r", ref_counter_offset=0, event_handle=None,
        event_sync_required=False, stride=(1,), storage_offset=0,
    )
    fields.update(changes)
    return CudaIpcLoc(**fields)  # type: ignore[arg-type]


def test_cpu_tensors_have_no_ipc_handle() -> None:
    with pytest.raises(ProtocolError, match="CUDA"):
        export_cuda_tensor(torch.ones(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_a_cuda_handle_on_a_host_without_cuda_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="CUDA is not available"):
        import_cuda_tensor(fake_loc(), torch.float32, (4,))
    header = msgspec.msgpack.encode(
        ["Tell", "t", ["TensorBundle", {"x": ["float32", [4], ["CudaIpcLoc", *msgspec.structs.astuple(fake_loc())]]}, ""]]
    )
    with pytest.raises(ProtocolError, match="CUDA"):
        LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1).decode([header])


@needs_cuda
@pytest.mark.gpu
def test_out_of_bounds_strides_are_refused() -> None:
    with pytest.raises(ProtocolError, match="outside its storage"):
        import_cuda_tensor(fake_loc(stride=(4,)), torch.float32, (4,))
    with pytest.raises(ProtocolError, match="does not exist"):
        import_cuda_tensor(fake_loc(device=torch.cuda.device_count()), torch.float32, (4,))


@needs_cuda
@pytest.mark.gpu
def test_cuda_tensors_are_encoded_as_handles() -> None:
    codec = LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1)
    codec.cuda_ipc = True
    x = torch.randn(256, 256, device="cuda")
    frames = codec.encode(Tell("t", TensorBundle({"x": x, "t": x.t()})))
    assert len(frames) == 1  # no tensor bytes in the message
    assert b"CudaIpcLoc" in bytes(frames[0]) and len(frames[0]) < 2048
    # Without the link's consent the bytes are copied to the host and sent as frames.
    codec.cuda_ipc = False
    assert len(codec.encode(Tell("t", TensorBundle({"x": x})))) == 2


@needs_cuda
@pytest.mark.gpu
async def test_cuda_tensors_cross_processes_by_handle() -> None:
    process = SystemProcess("tests.actors.peer_actors:setup", serve=["ipc://"], config=CONFIG)
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
            assert tally.sent["ipc"] == tally.sent["shm"] == tally.received["ipc"] == tally.received["shm"] == 0
    finally:
        await asyncio.to_thread(process.stop)
