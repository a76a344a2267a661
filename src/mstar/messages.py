"""The wire protocol: every message actors exchange, as msgspec Structs in two tagged unions.

- `Message` is what actors handle: application messages. To add one, define a subclass of
  `WireMessage` and add it to the `Message` union below (one line).
- `Envelope` is what links between actor systems carry: addressing (`Tell`, `Ask`), replies
  (`Reply`, `ErrorReply`), the handshake (`Hello`) and link upkeep (heartbeats, arena slots).

Every struct encodes as a msgpack array whose first element is its tag (the class name).
Fields typed `torch.Tensor` travel out of band: on the wire a tensor is a `TensorRef` (dtype,
shape, and where its bytes are: a separate frame, a slot in the sender's shared-memory arena,
or a CUDA IPC handle); the transport's codec swaps tensors for refs and back. Nothing here
executes code from the wire: decoding builds only the types named in these unions.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, TypeAlias

import msgspec
import torch

from mstar.errors import ProtocolError

__all__ = [
    "BytesValue",
    "ChunkValue",
    "DictValue",
    "EmittedMsg",
    "InitWorker",
    "ListValue",
    "NodeValuesMsg",
    "PyValue",
    "ReleaseRequest",
    "SlotValue",
    "StartWalkMsg",
    "StateQuery",
    "StateReport",
    "StatsQuery",
    "StatsReport",
    "StreamItemMsg",
    "TensorValue",
    "UpdatePeer",
    "Value",
    "WalkDoneMsg",
    "WalkFailedMsg",
    "WalkStepStats",
    "WorkerReady",
    "PROTOCOL_VERSION",
    "SYSTEM_TARGET",
    "Ack",
    "ActorId",
    "ArenaAttached",
    "ArenaInfo",
    "ArenaRelease",
    "Ask",
    "CudaIpcLoc",
    "Envelope",
    "ENVELOPE_TYPES",
    "ErrorReply",
    "FrameLoc",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Lookup",
    "Message",
    "MESSAGE_TYPES",
    "Ping",
    "Pong",
    "Reply",
    "ShmLoc",
    "Tell",
    "TensorBundle",
    "TensorLoc",
    "TensorRef",
    "WireMessage",
    "decode_envelope",
    "encode_envelope",
    "make_decoder",
    "make_encoder",
]

# Bumped on any incompatible change; peers with a different version refuse the handshake.
PROTOCOL_VERSION: Final = 1

# The reserved target name under which an actor system answers requests about itself.
SYSTEM_TARGET: Final = "$system"

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire struct: compact arrays, defaults left out, not tracked by the GC."""


# ---------------------------------------------------------------- tensors and actor ids


class FrameLoc(_Wire, tag=True):
    """Tensor bytes in frame `index` of the same multipart message (frame 0 is the header)."""

    index: Annotated[int, msgspec.Meta(ge=1)]


class ShmLoc(_Wire, tag=True):
    """Tensor bytes at `offset` in the sending system's shared-memory arena."""

    offset: NonNegative
    nbytes: NonNegative


class CudaIpcLoc(_Wire, tag=True):
    """A CUDA tensor shared by IPC handle: the fields of `UntypedStorage._share_cuda_()`."""

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


TensorLoc: TypeAlias = FrameLoc | ShmLoc | CudaIpcLoc


class TensorRef(_Wire):
    """A tensor on the wire: its dtype (torch name, e.g. "bfloat16"), shape and location."""

    dtype: str
    shape: tuple[NonNegative, ...]
    loc: TensorLoc


class ActorId(_Wire):
    """An actor's address on the wire: its system's transport address and its name."""

    address: str
    name: str


class ArenaInfo(_Wire):
    """A shared-memory arena a system offers its same-host peers (a file in /dev/shm)."""

    name: str
    nbytes: NonNegative


# ------------------------------------------------------------------ application messages


class WireMessage(_Wire, tag=True):
    """Base of application messages; subclass it and add the subclass to `Message`."""


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


# ------------------------------------------------------------ runtime: values of nodes
# Node inputs and outputs cross processes as one of these (tensors out of band). Inside one
# process they are passed by reference and never converted.


class _Value(_Wire, tag=True):
    """Base of node values on the wire."""


class TensorValue(_Value):
    """A tensor."""

    tensor: torch.Tensor


class PyValue(_Value):
    """A scalar or a string (or None)."""

    value: bool | int | float | str | None


class BytesValue(_Value):
    """Raw bytes."""

    data: bytes


class ListValue(_Value):
    """A list (or tuple) of values."""

    items: list[Value]


class DictValue(_Value):
    """A mapping from names to values."""

    items: dict[str, Value]


class ChunkValue(_Value):
    """A stream chunk (`mstar.streaming.Chunk`)."""

    items: list[Value]
    start: NonNegative
    context_len: NonNegative
    is_last: bool


Value: TypeAlias = TensorValue | PyValue | BytesValue | ListValue | DictValue | ChunkValue


class SlotValue(_Wire):
    """The value of input ``name`` of ``node``."""

    node: str
    name: str
    value: Value


# ---------------------------------------------------------------- runtime: conductor, workers


class StartWalkMsg(WireMessage):
    """Conductor to worker: run this rank's share of a walk instance for a request."""

    request_id: str
    walk_seq: int
    walk: str
    node_ranks: dict[str, int]
    initial: list[SlotValue]


class ReleaseRequest(WireMessage):
    """Conductor to worker: drop what a request holds, for its walks up to `up_to_seq`."""

    request_id: str
    up_to_seq: int


class NodeValuesMsg(WireMessage):
    """Worker to worker: values of one firing for nodes of the receiver, keyed as in `WalkRunner`."""

    request_id: str
    walk_seq: int
    keys: list[tuple[str, str, str, str]]
    values: list[Value]


class WalkDoneMsg(WireMessage):
    """Worker to conductor: this rank finished its share of a walk instance."""

    request_id: str
    walk_seq: int
    rank: int
    persisted: list[SlotValue]


class WalkFailedMsg(WireMessage):
    """Worker to conductor: a walk instance failed here; `kind` names the error class."""

    request_id: str
    walk_seq: int
    rank: int
    kind: str
    message: str
    node: str = ""
    walk: str = ""


class EmittedMsg(WireMessage):
    """Worker to conductor: a value a node sent to `EMIT`."""

    request_id: str
    partition: str
    walk: str
    node: str
    name: str
    modality: str
    value: Value


class StreamItemMsg(WireMessage):
    """Worker to conductor: one item on a stream into input ``name`` of ``node``."""

    request_id: str
    node: str
    name: str
    value: Value


class InitWorker(WireMessage):
    """Engine to a worker process's host: build the worker of ``rank``.

    The model is rebuilt in the child from its factory path and JSON keyword arguments;
    the placement travels as its YAML text. Nothing is pickled.
    """

    rank: int
    model_factory: str
    model_kwargs_json: str
    placement_yaml: str
    conductor: ActorId
    workers: dict[int, ActorId]
    config_json: str = "{}"


class WorkerReady(WireMessage):
    """A worker process's host: the worker of ``rank`` runs as ``worker``."""

    rank: int
    worker: ActorId


class UpdatePeer(WireMessage):
    """Engine to conductor and workers: the worker of ``rank`` now runs as ``worker``."""

    rank: int
    worker: ActorId


class StatsQuery(WireMessage):
    """Ask a worker for its engines' cumulative counters (answered by `StatsReport`)."""


class WalkStepStats(_Wire):
    """Cumulative step times of one walk on one node (`mstar.engines.StepTimes` on the wire).

    ``bucket_counts[i]`` counts steps in bucket ``i`` of `mstar.engines.STEP_TIME_BUCKETS`, the
    last one those longer than every bound (not cumulative).
    """

    steps: NonNegative
    inputs: NonNegative
    seconds: float
    bucket_counts: list[NonNegative]


class StatsReport(WireMessage):
    """A worker's counters.

    ``stats``, per node: steps, inputs batched, seconds in steps, KV blocks used/total where
    cached. ``walks``, per node and walk: step times (a step serving several walks counts under
    each). ``transport``, per transport kind: tensor bytes ``sent`` and ``received`` by the
    worker's actor system (`mstar.transport.TransportTally`). The last two are left out by
    older workers and then read as empty.
    """

    stats: dict[str, dict[str, float]]
    walks: dict[str, dict[str, WalkStepStats]] = msgspec.field(default_factory=dict)
    transport: dict[str, dict[str, NonNegative]] = msgspec.field(default_factory=dict)


class StateQuery(WireMessage):
    """Ask a conductor or worker how much request state it holds (answered by `StateReport`)."""


class StateReport(WireMessage):
    """Counts of what an actor holds for requests (all zero when idle)."""

    counts: dict[str, int]


# Adding a message type: define it above, then add it here.
Message: TypeAlias = (
    Ping
    | Pong
    | Ack
    | Lookup
    | TensorBundle
    | StartWalkMsg
    | ReleaseRequest
    | NodeValuesMsg
    | WalkDoneMsg
    | WalkFailedMsg
    | EmittedMsg
    | StreamItemMsg
    | InitWorker
    | WorkerReady
    | StateQuery
    | StateReport
    | StatsQuery
    | StatsReport
    | UpdatePeer
)


# ------------------------------------------------------------------------------ envelopes


class _EnvelopeBase(_Wire, tag=True):
    """Base of envelopes (link-level structs)."""


class Hello(_EnvelopeBase):
    """Open a link: who the sender is and what it offers; both sides send one, client first."""

    system_id: str
    addresses: list[str]
    pid: int
    host_id: str
    protocol: int = PROTOCOL_VERSION
    max_message_bytes: NonNegative = 0
    arena: ArenaInfo | None = None


class ArenaAttached(_EnvelopeBase):
    """Tell the peer its arena is mapped here, so it may send tensors through it."""


class ArenaRelease(_EnvelopeBase):
    """Give back slots of the peer's arena whose tensors were freed here."""

    offsets: list[NonNegative]


class Tell(_EnvelopeBase):
    """Deliver `body` to actor `target`; no reply."""

    target: str
    body: Message


class Ask(_EnvelopeBase):
    """Deliver `body` to actor `target`; the answer comes back as a `Reply` or `ErrorReply`."""

    target: str
    call_id: int
    body: Message


class Reply(_EnvelopeBase):
    """Answer the `Ask` with the same `call_id`; `body` is None when the handler returned None."""

    call_id: int
    body: Message | None = None


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
    Hello | ArenaAttached | ArenaRelease | Tell | Ask | Reply | ErrorReply | Heartbeat | Goodbye
)

MESSAGE_TYPES: Final[frozenset[type]] = frozenset(Message.__args__)
ENVELOPE_TYPES: Final[frozenset[type]] = frozenset(Envelope.__args__)


def _enc_hook_without_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        raise TypeError("tensors travel out of band: encode with a transport codec")
    raise TypeError(f"{type(obj).__name__} is not part of the wire protocol")


def make_encoder(enc_hook: Any = None) -> msgspec.msgpack.Encoder:
    """Return the envelope encoder; `enc_hook` turns tensors into `TensorRef`s."""
    return msgspec.msgpack.Encoder(enc_hook=enc_hook or _enc_hook_without_tensors)


def make_decoder(dec_hook: Any = None) -> msgspec.msgpack.Decoder[Envelope]:
    """Return the one typed decoder of envelopes; `dec_hook` turns `TensorRef`s into tensors."""
    return msgspec.msgpack.Decoder(Envelope, dec_hook=dec_hook)


_ENCODER = make_encoder()
_DECODER = make_decoder()


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
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed envelope: {exc}") from exc
    except RecursionError:
        raise ProtocolError("malformed envelope: values are nested too deeply") from None
