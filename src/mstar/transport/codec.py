"""`LinkCodec`: envelopes to multipart frames and back, with tensors out of band.

    frame 0: msgpack envelope; each tensor in it is a TensorRef(dtype, shape, loc)
    frame 1..n: raw bytes of the tensors whose loc is FrameLoc(i)

A tensor's bytes go, by preference: as CUDA IPC handles (CUDA tensor on a device the peer
sees too, peer another process on this machine, both able to open handles); into a slot of
this system's shared arena (CPU tensor of at least `shm_min_bytes`, peer on this machine,
arena not full); else as a separate frame, sent without a copy. A frame is read by the transport
later, so a tensor must not be modified
after it was sent. Decoding accepts only what `messages` declares, checks every tensor
against its frame or slot, and raises `ProtocolError` for anything else.

A CUDA IPC handle holds a reference on the sender's block until the receiver's tensor dies
(see `mstar.transport.cuda_ipc`). So that no block stays pinned by a message that went
nowhere, the codec gives the reference back itself for every handle that is not opened: the
sender for a message it failed to encode, the receiver for a handle it refuses and for the
handles of a message it rejects, and the sender for everything it sent once the peer's
process exited (`release_cuda_sent`).

Each message that is sent or received whole adds its tensors' bytes to the link's
`TransportTally`, under the link's scheme (frames), `shm` or `cuda_ipc`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from mstar.errors import MessageTooLargeError, ProtocolError
from mstar.transport.cuda_ipc import (
    export_cuda_tensor,
    import_cuda_tensor,
    local_cuda_device_uuids,
    release_cuda_handle,
)
from mstar.transport.shm import ArenaMapping, SharedArena
from mstar.transport.tally import CUDA_IPC, SHM, TransportTally
from mstar.wire import (
    CudaIpcLoc,
    Envelope,
    FrameLoc,
    ShmLoc,
    TensorRef,
    make_decoder,
    make_encoder,
    registry_version,
)

__all__ = ["DTYPES", "LinkCodec", "frame_nbytes", "salvage_call_id"]

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}

# How many CUDA IPC handles a link remembers having sent, to release them if its peer's
# process exits; a receiver that dies holding an older one leaves that block pinned.
MAX_TRACKED_CUDA_HANDLES = 1 << 16


def frame_nbytes(frame: Any) -> int:
    """Return the size in bytes of one frame (bytes, buffer, numpy array or zmq.Frame)."""
    if type(frame) is bytes:
        return len(frame)
    nbytes = getattr(frame, "nbytes", None)
    return int(nbytes) if nbytes is not None else len(frame)


def _as_buffer(frame: Any) -> Any:
    # zmq.Frame exposes its bytes through `.buffer` without copying.
    buffer = getattr(frame, "buffer", None)
    return frame if buffer is None else buffer


def _read_uint(data: memoryview, pos: int, size: int) -> tuple[int, int]:
    return int.from_bytes(data[pos : pos + size], "big"), pos + size


def _read_header(data: memoryview, pos: int) -> tuple[str, int, int]:
    """Read one msgpack array, str or int header at `pos`: (kind, value or length, next pos)."""
    byte = data[pos]
    pos += 1
    if byte <= 0x7F:
        return "int", byte, pos
    if byte >= 0xE0:
        return "int", byte - 0x100, pos
    if 0x90 <= byte <= 0x9F:
        return "array", byte & 0x0F, pos
    if 0xA0 <= byte <= 0xBF:
        return "str", byte & 0x1F, pos
    sizes = {
        0xCC: ("int", 1),
        0xCD: ("int", 2),
        0xCE: ("int", 4),
        0xCF: ("int", 8),
        0xD9: ("str", 1),
        0xDA: ("str", 2),
        0xDB: ("str", 4),
        0xDC: ("array", 2),
        0xDD: ("array", 4),
    }
    if byte not in sizes:
        raise ValueError("not a header")
    kind, size = sizes[byte]
    value, pos = _read_uint(data, pos, size)
    return kind, value, pos


def salvage_call_id(frames: Sequence[Any]) -> int | None:
    """Return the call id of a rejected `Ask`, reading only the start of its header.

    The header of an ask starts `["Ask", target, call_id, ...`; nothing after that is read,
    so this works on oversize and half-valid messages alike.
    """
    if not frames:
        return None
    try:
        data = memoryview(_as_buffer(frames[0])).cast("B")
        kind, length, pos = _read_header(data, 0)
        if kind != "array" or length < 3:
            return None
        kind, length, pos = _read_header(data, pos)
        if kind != "str" or bytes(data[pos : pos + length]) != b"Ask":
            return None
        kind, length, pos = _read_header(data, pos + length)
        if kind != "str":
            return None
        kind, call_id, _ = _read_header(data, pos + length)
    except (ValueError, IndexError, TypeError):
        return None
    return call_id if kind == "int" else None


class LinkCodec:
    """Encode and decode the envelopes of one link.

    Args:
        max_message_bytes: largest message (all frames together) sent or accepted.
        shm_min_bytes: smallest CPU tensor sent through the shared arena.
        transport: the link's scheme (`ipc`, `tcp`): the kind its frames are counted under.
        tally: where tensor bytes are counted (the actor system's); a private one if None.

    The actor system fills in what the handshake tells it: `local_arena` once the peer has
    mapped this system's arena, `peer_arena` once this side mapped the peer's, `cuda_ipc`
    when the peer is another process on this machine and both sides can open CUDA IPC
    handles, with `cuda_ipc_device_uuids` the CUDA devices both see (tensors on others go
    by bytes).
    """

    def __init__(
        self,
        *,
        max_message_bytes: int,
        shm_min_bytes: int,
        transport: str = "ipc",
        tally: TransportTally | None = None,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.shm_min_bytes = shm_min_bytes
        self.transport = transport
        self.tally = tally if tally is not None else TransportTally()
        self.tally.add_kind(transport)
        self.local_arena: SharedArena | None = None
        self.peer_arena: ArenaMapping | None = None
        self.cuda_ipc = False
        self.cuda_ipc_device_uuids: frozenset[str] = frozenset()
        # (ref counter handle, offset) of the CUDA IPC handles sent, newest last.
        self.sent_cuda_handles: collections.deque[tuple[bytes, int]] = collections.deque(
            maxlen=MAX_TRACKED_CUDA_HANDLES
        )
        # Slots of `local_arena` the peer holds; freed on its ArenaRelease or when the link dies.
        self.sent_slots: set[int] = set()
        self._encoder = make_encoder(self._enc_hook)
        self._decoder = make_decoder(self._dec_hook)
        self._decoder_version = registry_version()
        self._out: list[Any] | None = None
        self._new_slots: list[int] = []
        self._new_cuda_locs: list[CudaIpcLoc] = []
        # The CUDA IPC handles of the message being decoded that were opened or refused.
        self._cuda_handled: set[tuple[bytes, int]] = set()
        self._in: Sequence[Any] | None = None
        self._in_used: list[bool] = []
        # Whether the message being encoded or decoded holds tensors, and the bytes of those
        # that went by arena slot or CUDA IPC (zeroed by its first tensor); added to the tally
        # only once the whole message went through. A message without tensors costs one store.
        self._has_tensors = False
        self._shm_bytes = 0
        self._cuda_bytes = 0

    # ------------------------------------------------------------------------- encoding

    def encode(self, envelope: Envelope) -> list[Any]:
        """Return the frames of `envelope`.

        Raises:
            ProtocolError: the envelope holds a value the protocol does not know.
            MessageTooLargeError: the frames exceed `max_message_bytes`.
        """
        frames: list[Any] = [b""]
        self._out = frames
        self._new_slots = []
        self._has_tensors = False
        try:
            frames[0] = self._encoder.encode(envelope)
        except (TypeError, ValueError, msgspec.EncodeError, RecursionError) as exc:
            self._drop_new()
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"cannot encode {type(envelope).__name__}: {exc}") from exc
        finally:
            self._out = None
        nbytes = len(frames[0]) if len(frames) == 1 else sum(frame_nbytes(f) for f in frames)
        if nbytes > self.max_message_bytes:
            self._drop_new()
            raise MessageTooLargeError(
                f"{type(envelope).__name__} is {nbytes} bytes, over the link's limit of "
                f"{self.max_message_bytes} (raise max_message_bytes or send less)"
            )
        if self._has_tensors:
            if self._new_cuda_locs:
                self.sent_cuda_handles.extend(
                    (loc.ref_counter_handle, loc.ref_counter_offset) for loc in self._new_cuda_locs
                )
            self._count(self.tally.sent, frames, nbytes)
        return frames

    def _count(self, counts: dict[str, int], frames: Sequence[Any], nbytes: int) -> None:
        """Add a whole message's tensor bytes (``nbytes``: all its frames) to ``counts``."""
        if len(frames) > 1:
            counts[self.transport] += nbytes - frame_nbytes(frames[0])
        if self._shm_bytes:
            counts[SHM] += self._shm_bytes
        if self._cuda_bytes:
            counts[CUDA_IPC] += self._cuda_bytes

    def _drop_new(self) -> None:
        """Undo what the message that failed to encode took: its arena slots and CUDA handles."""
        for offset in self._new_slots:
            self.sent_slots.discard(offset)
            if self.local_arena is not None:
                self.local_arena.free(offset)
        self._new_slots = []
        if self._has_tensors:
            for loc in self._new_cuda_locs:
                release_cuda_handle(loc.ref_counter_handle, loc.ref_counter_offset)
            self._new_cuda_locs = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor_ref(obj)
        raise TypeError(f"{type(obj).__name__} is not part of the wire protocol")

    def _tensor_ref(self, tensor: torch.Tensor) -> TensorRef:
        if not self._has_tensors:
            self._has_tensors = True
            self._shm_bytes = self._cuda_bytes = 0
            self._new_cuda_locs = []
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            raise ProtocolError(f"dtype {tensor.dtype} cannot travel on the wire")
        if tensor.layout != torch.strided:
            raise ProtocolError(f"only dense tensors travel on the wire, not {tensor.layout}")
        tensor = tensor.detach()
        shape = tuple(tensor.shape)
        if tensor.device.type == "cuda":
            if self.cuda_ipc and tensor.numel() > 0 and self._peer_sees(tensor.device):
                loc = export_cuda_tensor(tensor)
                self._new_cuda_locs.append(loc)
                self._cuda_bytes += tensor.numel() * tensor.element_size()
                return TensorRef(name, shape, loc)
            tensor = tensor.cpu()
        elif tensor.device.type != "cpu":
            tensor = tensor.cpu()
        nbytes = tensor.numel() * tensor.element_size()
        arena = self.local_arena
        if arena is not None and nbytes >= self.shm_min_bytes:
            offset = arena.write(tensor)
            if offset is not None:
                self.sent_slots.add(offset)
                self._new_slots.append(offset)
                self._shm_bytes += nbytes
                return TensorRef(name, shape, ShmLoc(offset, nbytes))
        assert self._out is not None
        flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
        self._out.append(flat.view(torch.uint8).numpy())
        return TensorRef(name, shape, FrameLoc(len(self._out) - 1))

    def _peer_sees(self, device: torch.device) -> bool:
        uuids = local_cuda_device_uuids()
        index = device.index
        return (
            index is not None and index < len(uuids) and uuids[index] in self.cuda_ipc_device_uuids
        )

    def release_cuda_sent(self) -> None:
        """Release every CUDA IPC handle this link sent: its peer's process exited.

        A dead peer holds none of them open any more, and torch never gave back the
        references of those it held at its death, or never received: without this, each
        pins its block in this process until it exits. (A handle the peer already released
        is released twice, which torch treats as released.)
        """
        while self.sent_cuda_handles:
            release_cuda_handle(*self.sent_cuda_handles.popleft())

    def release(self, offsets: Sequence[int]) -> None:
        """Free arena slots the peer gave back.

        Raises:
            ProtocolError: an offset is not a slot this link sent (nothing is freed then).
        """
        arena = self.local_arena
        foreign = [offset for offset in offsets if offset not in self.sent_slots]
        if foreign or arena is None or len(set(offsets)) != len(offsets):
            raise ProtocolError(
                f"the peer released arena slots it was not sent: {sorted(foreign or offsets)[:8]}"
            )
        for offset in offsets:
            self.sent_slots.remove(offset)
            arena.free(offset)

    def release_all(self) -> None:
        """Free every slot the peer still holds (the link is gone)."""
        arena = self.local_arena
        if arena is not None and not arena.is_closed:
            for offset in self.sent_slots:
                arena.free(offset)
        self.sent_slots.clear()

    # ------------------------------------------------------------------------- decoding

    def decode(self, frames: Sequence[Any]) -> Envelope:
        """Return the envelope held by `frames`, with its tensors rebuilt.

        Raises:
            MessageTooLargeError: the frames exceed `max_message_bytes`.
            ProtocolError: the frames are not exactly one valid envelope and its tensors.
        """
        if not frames:
            raise ProtocolError("empty message")
        head = _as_buffer(frames[0])
        nbytes = frame_nbytes(head) if len(frames) == 1 else sum(frame_nbytes(f) for f in frames)
        self._has_tensors = False
        if nbytes > self.max_message_bytes:
            self._release_refused(head)
            raise MessageTooLargeError(
                f"received a {nbytes}-byte message, over the limit of {self.max_message_bytes}"
            )
        if self._decoder_version != registry_version():
            # Message types were registered since: decode them too.
            self._decoder = make_decoder(self._dec_hook)
            self._decoder_version = registry_version()
        self._in = frames
        self._in_used = [False] * len(frames)
        try:
            envelope: Envelope = self._decoder.decode(head)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            self._release_refused(head)
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"malformed message: {exc}") from exc
        except RecursionError:
            # Values nested deeper than the interpreter's stack: a peer's bug or an attack.
            self._release_refused(head)
            raise ProtocolError("malformed message: values are nested too deeply") from None
        finally:
            self._in = None
        if not all(self._in_used[1:]):
            # Its tensors are built: the handles among them are released as they die.
            raise ProtocolError("message carries frames that no tensor refers to")
        if self._has_tensors:
            self._count(self.tally.received, frames, nbytes)
        return envelope

    def _dec_hook(self, type_: type, obj: Any) -> Any:
        if type_ is not torch.Tensor:
            raise TypeError(f"unexpected type {type_!r}")
        try:
            ref = msgspec.convert(obj, TensorRef)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"malformed tensor ref: {exc}") from exc
        return self._tensor(ref)

    def _tensor(self, ref: TensorRef) -> torch.Tensor:
        if not self._has_tensors:
            self._has_tensors = True
            self._shm_bytes = self._cuda_bytes = 0
            self._cuda_handled.clear()
        loc = ref.loc
        if isinstance(loc, CudaIpcLoc):
            # Handled from here on: opened, or released by the refusal (a tensor that is
            # opened gives its reference back when it dies). Every export has a slot of its
            # own, so a slot named twice is a forgery that would release one reference twice.
            key = (loc.ref_counter_handle, loc.ref_counter_offset)
            if key in self._cuda_handled:
                raise ProtocolError("message names one CUDA IPC reference twice")
            self._cuda_handled.add(key)
        dtype = DTYPES.get(ref.dtype)
        if dtype is None:
            if isinstance(loc, CudaIpcLoc):
                release_cuda_handle(loc.ref_counter_handle, loc.ref_counter_offset)
            raise ProtocolError(f"unknown dtype {ref.dtype!r}")
        nbytes = math.prod(ref.shape) * _ITEMSIZE[ref.dtype]
        if isinstance(loc, CudaIpcLoc):
            if not self.cuda_ipc:
                release_cuda_handle(loc.ref_counter_handle, loc.ref_counter_offset)
                raise ProtocolError(
                    "received a CUDA IPC tensor on a link that did not agree to CUDA IPC"
                )
            tensor = import_cuda_tensor(loc, dtype, ref.shape)
            self._cuda_bytes += nbytes
            return tensor
        if isinstance(loc, ShmLoc):
            if self.peer_arena is None:
                raise ProtocolError("tensor in a shared arena this side has not mapped")
            if loc.nbytes != nbytes:
                raise ProtocolError(
                    f"arena slot holds {loc.nbytes} bytes, the tensor needs {nbytes}"
                )
            view = self.peer_arena.tensor(loc.offset, nbytes, dtype, ref.shape)
            self._shm_bytes += nbytes
            return view
        assert self._in is not None
        index = loc.index
        if index >= len(self._in) or self._in_used[index]:
            raise ProtocolError(f"tensor refers to missing or reused frame {index}")
        self._in_used[index] = True
        buffer = _as_buffer(self._in[index])
        if frame_nbytes(buffer) != nbytes:
            raise ProtocolError(
                f"frame {index} holds {frame_nbytes(buffer)} bytes, the tensor needs {nbytes}"
            )
        if nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        if isinstance(buffer, bytes):
            # Tensors must be writable; immutable bytes only come from tests and tools.
            buffer = bytearray(buffer)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(ref.shape)

    def _release_refused(self, head: Any) -> None:
        """Release the CUDA IPC handles of a refused message that were not opened or refused yet.

        The message is read again without its schema to find them; one too malformed for
        that leaves its handles pinned (only a broken or hostile peer sends such).
        """
        try:
            if b"CudaIpcLoc" not in bytes(memoryview(head)):
                return
            values = [msgspec.msgpack.decode(head)]
        except (msgspec.DecodeError, TypeError, ValueError, RecursionError):
            return
        handled = self._cuda_handled if self._has_tensors else set()
        while values:
            value = values.pop()
            if isinstance(value, dict):
                values.extend(value.values())
            elif isinstance(value, list):
                if value and value[0] == "CudaIpcLoc":
                    try:
                        loc = msgspec.convert(value, CudaIpcLoc)
                    except msgspec.ValidationError:
                        continue
                    key = (loc.ref_counter_handle, loc.ref_counter_offset)
                    if key not in handled:
                        handled.add(key)
                        release_cuda_handle(*key)
                else:
                    values.extend(value)
