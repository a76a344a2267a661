"""The actors' wire protocol: link envelopes, tensor refs, actor ids, base messages.

- `Envelope` is what links between actor systems carry: addressing (`Tell`, `Ask`), replies
  (`Reply`, `ErrorReply`), the handshake (`Hello`) and link upkeep (heartbeats, arena slots).
- The bodies of `Tell`, `Ask` and `Reply` are application messages: subclasses of
  `WireMessage`. The actors' own (`Ping`, `Pong`, `Ack`, `Lookup`, `TensorBundle`) are here;
  each layer above declares its messages in a module of its own and registers them with
  `register_messages` (the runtime's are in `mstar.runtime.messages`). A link decodes the
  union of every registered type with one typed decoder.

Every struct encodes as a msgpack array whose first element is its tag (the class name).
Fields typed `torch.Tensor` travel out of band: on the wire a tensor is a `TensorRef` (dtype,
shape, and where its bytes are: a separate frame, a slot in the sender's shared-memory arena,
or a CUDA IPC handle); the transport's codec swaps tensors for refs and back. Nothing here
executes code from the wire: decoding builds only the types registered here.

A message whose in-process form differs from its wire form (node values, say, which are
passed by reference inside a process) overrides `WireMessage.to_wire` and
`WireMessage.from_wire`; the link that carries it applies them, so actors send and receive
the same objects whichever transport is underneath.
"""

from __future__ import annotations

import threading
from typing import Annotated, Any, Final, Generic, Self, TypeAlias, TypeVar, Union

import msgspec
import torch

from mstar.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "SYSTEM_TARGET",
    "Ack",
    "ActorId",
    "ArenaAttached",
    "ArenaInfo",
    "ArenaRelease",
    "Ask",
    "CudaIpcLoc",
    "ENVELOPE_TYPES",
    "Envelope",
    "ErrorReply",
    "FrameLoc",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Lookup",
    "Ping",
    "Pong",
    "Reply",
    "ShmLoc",
    "Tell",
    "TensorBundle",
    "TensorLoc",
    "TensorRef",
    "WireMessage",
    "WireStruct",
    "decode_envelope",
    "encode_envelope",
    "envelope_type",
    "is_wire_message",
    "make_decoder",
    "make_encoder",
    "message_types",
    "register_messages",
    "registry_version",
]

# Bumped on any incompatible change; peers with a different version refuse the handshake.
PROTOCOL_VERSION: Final = 2

# The reserved target name under which an actor system answers requests about itself.
SYSTEM_TARGET: Final = "$system"

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class WireStruct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire struct: compact arrays, defaults left out, not tracked by the GC."""


# ---------------------------------------------------------------- tensors and actor ids


class FrameLoc(WireStruct, tag=True):
    """Tensor bytes in frame `index` of the same multipart message (frame 0 is the header)."""

    index: Annotated[int, msgspec.Meta(ge=1)]


class ShmLoc(WireStruct, tag=True):
    """Tensor bytes at `offset` in the sending system's shared-memory arena."""

    offset: NonNegative
    nbytes: NonNegative


class CudaIpcLoc(WireStruct, tag=True):
    """A CUDA tensor shared by IPC handle: the fields of `UntypedStorage._share_cuda_()`.

    `device` is the sender's index; the receiver opens the handle on its own index of
    `device_uuid` (empty from senders that predate it, whose handles are refused).
    """

    device: NonNegative
    handle: bytes
    storage_size_bytes: NonNegative
    storage_offset_bytes: NonNegative
    ref_counter_handle: bytes
    ref_counter_offset: NonNegative
    event_handle: bytes | None
    event_sync_required: bool
    stride: tuple[int, ...]
    storage_offset: NonNegative
    device_uuid: str = ""


TensorLoc: TypeAlias = FrameLoc | ShmLoc | CudaIpcLoc


class TensorRef(WireStruct):
    """A tensor on the wire: its dtype (torch name, e.g. "bfloat16"), shape and location."""

    dtype: str
    shape: tuple[NonNegative, ...]
    loc: TensorLoc


class ActorId(WireStruct):
    """An actor's address on the wire: its system's transport address and its name."""

    address: str
    name: str


class ArenaInfo(WireStruct):
    """A shared-memory arena a system offers its same-host peers (a file in /dev/shm)."""

    name: str
    nbytes: NonNegative


# ------------------------------------------------------------------ application messages


class WireMessage(WireStruct, tag=True):
    """Base of application messages; subclass it and pass the subclass to `register_messages`."""

    def to_wire(self) -> Self:
        """Return this message as a link to another process carries it (itself by default)."""
        return self

    def from_wire(self) -> Self:
        """Return this decoded message as actors handle it (itself by default)."""
        return self


class Ping(WireMessage):
    """Probe a system or an actor; answered by `Pong` with the same `seq` and `payload`."""

    seq: int = 0
    payload: bytes = b""


class Pong(WireMessage):
    """Answer a `Ping`."""

    seq: int = 0
    payload: bytes = b""


class Ack(WireMessage):
    """Acknowledge a request that has nothing else to return."""


class Lookup(WireMessage):
    """Ask a system (target `SYSTEM_TARGET`) whether it runs an actor named `name`."""

    name: str


class TensorBundle(WireMessage):
    """Carry named tensors (the outputs of a node, say) from one actor to another."""

    tensors: dict[str, torch.Tensor]
    key: str = ""


# ------------------------------------------------------------------------------ envelopes

M = TypeVar("M")


class _EnvelopeBase(WireStruct, tag=True):
    """Base of envelopes (link-level structs)."""


class Hello(_EnvelopeBase):
    """Open a link: who the sender is and what it offers; both sides send one, client first.

    `cuda_ipc` says the sender can open CUDA IPC handles, `cuda_device_uuids` names the CUDA
    devices it sees; a peer that predates them decodes with neither (no CUDA IPC).
    """

    system_id: str
    addresses: list[str]
    pid: int
    host_id: str
    protocol: int = PROTOCOL_VERSION
    max_message_bytes: NonNegative = 0
    arena: ArenaInfo | None = None
    cuda_ipc: bool = False
    cuda_device_uuids: list[str] = []


class ArenaAttached(_EnvelopeBase):
    """Tell the peer its arena is mapped here, so it may send tensors through it."""


class ArenaRelease(_EnvelopeBase):
    """Give back slots of the peer's arena whose tensors were freed here."""

    offsets: list[NonNegative]


class Tell(_EnvelopeBase, Generic[M]):
    """Deliver `body` to actor `target`; no reply."""

    target: str
    body: M


class Ask(_EnvelopeBase, Generic[M]):
    """Deliver `body` to actor `target`; the answer comes back as a `Reply` or `ErrorReply`."""

    target: str
    call_id: int
    body: M


class Reply(_EnvelopeBase, Generic[M]):
    """Answer the `Ask` with the same `call_id`; `body` is None when the handler returned None."""

    call_id: int
    body: M | None = None


class ErrorReply(_EnvelopeBase):
    """Fail the `Ask` with the same `call_id`; `kind` names an `mstar.errors` class."""

    call_id: int
    kind: str
    message: str
    error_type: str = ""


class Heartbeat(_EnvelopeBase):
    """Show the link is alive when nothing else was sent for a heartbeat interval."""


class Goodbye(_EnvelopeBase):
    """Close the link on purpose (the sender is shutting down)."""

    reason: str = ""


Envelope: TypeAlias = (
    Hello
    | ArenaAttached
    | ArenaRelease
    | Tell[Any]
    | Ask[Any]
    | Reply[Any]
    | ErrorReply
    | Heartbeat
    | Goodbye
)

ENVELOPE_TYPES: Final[frozenset[type]] = frozenset(
    {Hello, ArenaAttached, ArenaRelease, Tell, Ask, Reply, ErrorReply, Heartbeat, Goodbye}
)


# ---------------------------------------------------------------- the message registry


class _Registry:
    """The application message types links decode (one set per process)."""

    def __init__(self) -> None:
        self.types: dict[str, type[WireMessage]] = {}
        self.version = 0
        self._envelope: Any = None
        self._lock = threading.Lock()

    def add(self, types: tuple[type[WireMessage], ...]) -> None:
        with self._lock:
            for cls in types:
                if (
                    not (isinstance(cls, type) and issubclass(cls, WireMessage))
                    or cls is WireMessage
                ):
                    raise TypeError(f"{cls!r} is not a WireMessage subclass")
                known = self.types.get(cls.__name__)
                if known is cls:
                    continue
                if known is not None:
                    raise TypeError(
                        f"two wire messages are named {cls.__name__!r} ({known.__module__}, "
                        f"{cls.__module__})"
                    )
                self.types[cls.__name__] = cls
            self.version += 1
            self._envelope = None

    def envelope(self) -> Any:
        with self._lock:
            if self._envelope is None:
                # Built at run time from what is registered: typing's forms, not annotations.
                body: Any = Union.__getitem__(
                    tuple(self.types[name] for name in sorted(self.types))
                )
                members = (
                    Hello,
                    ArenaAttached,
                    ArenaRelease,
                    Tell[body],
                    Ask[body],
                    Reply[body],
                    ErrorReply,
                    Heartbeat,
                    Goodbye,
                )
                self._envelope = Union.__getitem__(members)
            return self._envelope


_REGISTRY = _Registry()


def register_messages(*types: type[WireMessage]) -> None:
    """Let links carry these message types (call once, at import of the module defining them).

    Raises:
        TypeError: A type is not a `WireMessage`, or another one has its name (its tag).
    """
    _REGISTRY.add(types)


register_messages(Ping, Pong, Ack, Lookup, TensorBundle)


def message_types() -> frozenset[type[WireMessage]]:
    """Return every registered application message type."""
    return frozenset(_REGISTRY.types.values())


def is_wire_message(message: object) -> bool:
    """Return whether ``message`` is of a registered type (may cross to another process)."""
    return _REGISTRY.types.get(type(message).__name__) is type(message)


def registry_version() -> int:
    """Return a number that changes whenever message types are registered."""
    return _REGISTRY.version


def envelope_type() -> Any:
    """Return the type links decode: the envelope union over the registered messages."""
    return _REGISTRY.envelope()


def _enc_hook_without_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        raise TypeError("tensors travel out of band: encode with a transport codec")
    raise TypeError(f"{type(obj).__name__} is not part of the wire protocol")


def make_encoder(enc_hook: Any = None) -> msgspec.msgpack.Encoder:
    """Return the envelope encoder; `enc_hook` turns tensors into `TensorRef`s."""
    return msgspec.msgpack.Encoder(enc_hook=enc_hook or _enc_hook_without_tensors)


def make_decoder(dec_hook: Any = None) -> msgspec.msgpack.Decoder[Any]:
    """Return the one typed decoder of envelopes; `dec_hook` turns `TensorRef`s into tensors."""
    return msgspec.msgpack.Decoder(envelope_type(), dec_hook=dec_hook)


_ENCODER = make_encoder()
_DECODER: list[Any] = [-1, None]  # [registry version, decoder]


def encode_envelope(envelope: Envelope) -> bytes:
    """Encode an envelope that holds no tensors to msgpack bytes.

    Raises:
        ProtocolError: the envelope holds a tensor or a value the protocol does not know.
    """
    try:
        return _ENCODER.encode(envelope)
    except (TypeError, ValueError, msgspec.EncodeError, RecursionError) as exc:
        raise ProtocolError(f"cannot encode {type(envelope).__name__}: {exc}") from exc


def decode_envelope(data: bytes | bytearray | memoryview) -> Envelope:
    """Decode msgpack bytes that hold no tensors into an envelope.

    Raises:
        ProtocolError: the bytes are not exactly one valid envelope.
    """
    if _DECODER[0] != _REGISTRY.version:
        _DECODER[:] = [_REGISTRY.version, make_decoder()]
    try:
        envelope: Envelope = _DECODER[1].decode(data)
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed envelope: {exc}") from exc
    except RecursionError:
        raise ProtocolError("malformed envelope: values are nested too deeply") from None
    return envelope
