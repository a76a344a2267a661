"""The wire protocols (the actors' envelopes, the runtime's messages): every type round-trips; the
decoder survives fuzzing."""

from __future__ import annotations

import contextlib
import typing
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.errors import MessageTooLargeError, ProtocolError
from mstar.runtime.messages import RUNTIME_MESSAGES, StatsReport, WalkStepStats
from mstar.transport.codec import LinkCodec, salvage_call_id
from mstar.wire import (
    Ack,
    ArenaAttached,
    ArenaInfo,
    ArenaRelease,
    Ask,
    ErrorReply,
    Goodbye,
    Heartbeat,
    Hello,
    Lookup,
    Ping,
    Pong,
    Reply,
    Tell,
    TensorBundle,
    WireMessage,
    decode_envelope,
    encode_envelope,
    envelope_type,
    message_types,
    register_messages,
)

# Hand-picked samples; every type in the unions is also covered by generated samples below.
MESSAGES = [
    Ping(),
    Ping(7, b"\x00\xffpayload"),
    Pong(-3, b"x"),
    Ack(),
    Lookup("worker-0"),
    TensorBundle({}),
    TensorBundle({"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, key="req-1"),
]

ENVELOPES = [
    Hello("sys", ["ipc:///tmp/a.sock", "peer://sys"], 123, "host/boot"),
    Hello("sys", [], 1, "h", max_message_bytes=1 << 20, arena=ArenaInfo("mstar-1-ab", 4096)),
    ArenaAttached(),
    ArenaRelease([0, 64, 4096]),
    Tell("echo", Ping(1)),
    Ask("echo", 42, Lookup("x")),
    Reply(42),
    Reply(42, Pong(1)),
    ErrorReply(42, "ActorDeadError", "actor 'x' stopped"),
    ErrorReply(43, "ActorHandlerError", "boom", "ValueError"),
    Heartbeat(),
    Goodbye(),
    Goodbye("shutting down"),
    *(Tell("t", m) for m in MESSAGES),
    *(Reply(1, m) for m in MESSAGES),
]


def codec() -> LinkCodec:
    return LinkCodec(max_message_bytes=1 << 26, shm_min_bytes=1 << 20)


def assert_same(a: object, b: object) -> None:
    """Compare messages, tensors by value and dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b)
        for field in a.__struct_fields__:
            assert_same(getattr(a, field), getattr(b, field))
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            assert_same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert a == b


class SampleBuilder:
    """Build a valid sample of any wire type from its msgspec type info (also for new types).

    Unions rotate through their members, so repeated samples cover the alternatives; past a
    small depth, recursive unions pick members that do not recurse.
    """

    def __init__(self) -> None:
        self.turn = 0

    def build(self, t: mi.Type, depth: int = 0) -> Any:
        self.turn += 1
        if isinstance(t, mi.StructType | mi.DataclassType):
            try:
                return t.cls(**{f.name: self.build(f.type, depth + 1) for f in t.fields})
            # a struct that checks what its values mean (SamplingParams): its defaults
            except ValueError:
                return t.cls()
        if isinstance(t, mi.AnyType):
            return ["any", 1]
        if isinstance(t, mi.UnionType):
            members = [m for m in t.types if not isinstance(m, mi.NoneType)] or list(t.types)
            if depth > 3:
                members = [m for m in members if not _recurses(m)] or members
            return self.build(members[self.turn % len(members)], depth)
        if isinstance(t, mi.IntType):
            return max(3, (t.ge or 0), (t.gt or 0) + 1)
        if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType):
            return [self.build(t.item_type, depth + 1)]
        if isinstance(t, mi.VarTupleType):
            return (self.build(t.item_type, depth + 1),)
        if isinstance(t, mi.TupleType):
            return tuple(self.build(item, depth + 1) for item in t.item_types)
        if isinstance(t, mi.DictType):
            return {self.build(t.key_type, depth + 1): self.build(t.value_type, depth + 1)}
        if isinstance(t, mi.CustomType) and t.cls is torch.Tensor:
            return torch.arange(6, dtype=torch.float32).reshape(2, 3) + self.turn
        if isinstance(t, mi.LiteralType):
            return t.values[0]
        simple = {
            mi.StrType: "s",
            mi.BytesType: b"\x00\x01",
            mi.BoolType: True,
            mi.FloatType: 1.5,
            mi.NoneType: None,
        }
        for kind, value in simple.items():
            if isinstance(t, kind):
                return value
        raise TypeError(f"no sample for {t!r}: teach SampleBuilder this type")


def _recurses(t: mi.Type) -> bool:
    return not isinstance(
        t,
        mi.IntType
        | mi.StrType
        | mi.BytesType
        | mi.BoolType
        | mi.FloatType
        | mi.NoneType
        | mi.CustomType,
    )


def by_name(types: frozenset[type]) -> list[type]:
    return sorted(types, key=lambda t: t.__name__)


def test_every_runtime_message_is_registered() -> None:
    assert set(RUNTIME_MESSAGES) <= message_types()
    assert {Ping, Pong, Ack, Lookup, TensorBundle} <= message_types()


def test_a_message_name_is_registered_once() -> None:
    class Ping(WireMessage):  # another struct with an existing tag
        seq: int = 0

    with pytest.raises(TypeError, match="two wire messages"):
        register_messages(Ping)
    with pytest.raises(TypeError, match="not a WireMessage"):
        register_messages(int)  # type: ignore[arg-type]


@pytest.mark.parametrize("message_type", by_name(message_types()), ids=lambda t: t.__name__)
def test_every_message_type_round_trips(message_type: type) -> None:
    builder = SampleBuilder()
    for _ in range(3):  # rotate through union alternatives
        sample = builder.build(mi.type_info(message_type))
        for envelope in (Tell("t", sample), Ask("t", 1, sample), Reply(1, sample)):
            assert_same(envelope, codec().decode(codec().encode(envelope)))


# The envelopes as links decode them (Tell, Ask and Reply over the registered messages).
ENVELOPE_TYPES = typing.get_args(envelope_type())


@pytest.mark.parametrize(
    "envelope_type",
    ENVELOPE_TYPES,
    ids=lambda t: typing.get_origin(t).__name__ if typing.get_origin(t) else t.__name__,
)
def test_every_envelope_type_round_trips(envelope_type: type) -> None:
    builder = SampleBuilder()
    for _ in range(8):
        envelope = builder.build(mi.type_info(envelope_type))
        assert_same(envelope, codec().decode(codec().encode(envelope)))


@pytest.mark.parametrize("envelope", ENVELOPES, ids=lambda e: type(e).__name__)
def test_round_trip_through_the_codec(envelope: object) -> None:
    frames = codec().encode(envelope)  # type: ignore[arg-type]
    assert_same(envelope, codec().decode(frames))


@pytest.mark.parametrize(
    "envelope",
    [
        e
        for e in ENVELOPES
        if not (isinstance(e, Tell | Reply) and isinstance(e.body, TensorBundle))
    ],
    ids=lambda e: type(e).__name__,
)
def test_round_trip_without_tensors(envelope: object) -> None:
    assert_same(envelope, decode_envelope(encode_envelope(envelope)))  # type: ignore[arg-type]


TENSORS = {
    "f32": torch.randn(3, 4),
    "bf16": torch.randn(5, dtype=torch.bfloat16),
    "f16": torch.randn(2, 2, dtype=torch.float16),
    "i64": torch.arange(10),
    "bool": torch.tensor([True, False, True]),
    "u8": torch.arange(7, dtype=torch.uint8),
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 3),
    "transposed": torch.randn(3, 5).t(),
    "sliced": torch.arange(20.0)[3:17:2],
    "grad": torch.ones(2, requires_grad=True),
    "complex": torch.randn(3, dtype=torch.complex64),
}


def test_tensors_travel_as_frames_with_dtype_and_shape() -> None:
    frames = codec().encode(Tell("t", TensorBundle(TENSORS)))
    assert len(frames) == 1 + len(TENSORS)
    decoded = codec().decode(frames)
    assert isinstance(decoded, Tell) and isinstance(decoded.body, TensorBundle)
    for name, tensor in TENSORS.items():
        assert_same(tensor.detach(), decoded.body.tensors[name])
    # Received tensors are ordinary writable tensors.
    decoded.body.tensors["f32"].add_(1)


def test_a_tensor_is_not_encodable_without_a_codec() -> None:
    with pytest.raises(ProtocolError, match="out of band"):
        encode_envelope(Tell("t", TensorBundle({"x": torch.ones(1)})))


def test_values_outside_the_protocol_are_refused() -> None:
    with pytest.raises(ProtocolError):
        encode_envelope(Tell("t", Ping(payload=object())))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="only dense tensors"):
        codec().encode(Tell("t", TensorBundle({"x": torch.ones(2).to_sparse()})))


def header(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty"),
        ([b""], "malformed"),
        ([header(["Tell", "t"])], "malformed"),
        ([header(["Nope", 1])], "malformed"),
        ([header(["Tell", "t", ["Unknown"]])], "malformed"),
        ([header(["Ask", "t", "not-an-int", ["Ack"]])], "malformed"),
        (
            [header(["Tell", "t", ["TensorBundle", {"x": ["float32", [2], ["FrameLoc", 1]]}, ""]])],
            "missing",
        ),
        (
            [
                header(
                    ["Tell", "t", ["TensorBundle", {"x": ["float32", [2], ["FrameLoc", 1]]}, ""]]
                ),
                b"abc",
            ],
            "needs 8",
        ),
        (
            [
                header(
                    ["Tell", "t", ["TensorBundle", {"x": ["float99", [2], ["FrameLoc", 1]]}, ""]]
                ),
                b"x" * 8,
            ],
            "dtype",
        ),
        (
            [
                header(
                    ["Tell", "t", ["TensorBundle", {"x": ["float32", [-1], ["FrameLoc", 1]]}, ""]]
                ),
                b"x" * 8,
            ],
            "malformed",
        ),
        (
            [
                header(
                    ["Tell", "t", ["TensorBundle", {"x": ["float32", [2], ["FrameLoc", 0]]}, ""]]
                ),
                b"x" * 8,
            ],
            "malformed",
        ),
        (
            [header(["Tell", "t", ["TensorBundle", {"x": ["uint8", [1], ["ShmLoc", 0, 1]]}, ""]])],
            "not mapped",
        ),
        ([header(["Tell", "t", ["Ack"]]), b"stray"], "no tensor refers"),
        (
            [
                header(
                    [
                        "Tell",
                        "t",
                        [
                            "TensorBundle",
                            {
                                "a": ["uint8", [1], ["FrameLoc", 1]],
                                "b": ["uint8", [1], ["FrameLoc", 1]],
                            },
                            "",
                        ],
                    ]
                ),
                b"x",
            ],
            "reused",
        ),
    ],
)
def test_malformed_frames_raise_protocol_error(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        codec().decode(frames)


def test_oversize_messages_are_refused_both_ways() -> None:
    small = LinkCodec(max_message_bytes=1024, shm_min_bytes=1 << 20)
    with pytest.raises(MessageTooLargeError):
        small.encode(Tell("t", Ping(payload=b"x" * 2000)))
    frames = codec().encode(Ask("t", 9, Ping(payload=b"x" * 2000)))
    with pytest.raises(MessageTooLargeError):
        small.decode(frames)
    assert salvage_call_id(frames) == 9


def test_salvage_finds_call_ids_only_in_asks() -> None:
    assert salvage_call_id([header(["Ask", "t", 5, ["Unknown"]])]) == 5
    assert (
        salvage_call_id([header(["Ask", "t" * 300, 2**40, ["Ping", 0, b"x" * 100_000]])]) == 2**40
    )
    assert salvage_call_id([header(["Ask", "t", 5, ["Ping"]])[:-3]]) == 5  # truncated later on
    assert salvage_call_id([header(["Ask", "t"])]) is None
    assert salvage_call_id([header(["Ask", "t", "5", []])]) is None
    assert salvage_call_id([header(["Tell", "t", 5])]) is None
    assert salvage_call_id([b"\xc1garbage"]) is None
    assert salvage_call_id([]) is None


def nested_ask(depth: int, call_id: int = 9) -> bytes:
    """Return an `Ask` whose emitted value is a list nested ``depth`` deep, built by hand."""
    value = msgspec.msgpack.encode(1)
    for _ in range(depth):
        value = b"\x92" + msgspec.msgpack.encode("ListValue") + b"\x91" + value
    body = (
        b"\x98"
        + b"".join(
            msgspec.msgpack.encode(x) for x in ("EmittedMsg", "r", "p", "w", "n", "o", "latent")
        )
        + value
    )
    return b"\x94" + b"".join(msgspec.msgpack.encode(x) for x in ("Ask", "a", call_id)) + body


def test_values_nested_too_deep_are_protocol_errors_not_recursion_errors() -> None:
    shallow = nested_ask(5)
    assert isinstance(codec().decode([shallow]), Ask)
    deep = nested_ask(5_000)
    with pytest.raises(ProtocolError, match="nested too deeply"):
        codec().decode([deep])
    with pytest.raises(ProtocolError, match="nested too deeply"):
        decode_envelope(deep)
    assert salvage_call_id([deep]) == 9  # the asker can still be answered


# ---------------------------------------------------------------------------------- fuzzing

VALID_FRAMES = [codec().encode(e) for e in ENVELOPES]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decodes_or_protocol_error(frames: list[bytes]) -> None:
    with contextlib.suppress(ProtocolError, MessageTooLargeError):
        codec().decode(frames)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    decodes_or_protocol_error([data])
    with contextlib.suppress(ProtocolError):
        decode_envelope(data)


@FUZZ
@given(st.binary(max_size=64))
def test_salvage_never_crashes(data: bytes) -> None:
    call_id = salvage_call_id([data])
    assert call_id is None or isinstance(call_id, int)


@FUZZ
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_multipart_messages_never_crash_the_decoder(frames: list[bytes]) -> None:
    decodes_or_protocol_error(frames)


@FUZZ
@given(st.sampled_from(VALID_FRAMES), st.data())
def test_truncated_headers_raise_protocol_error(frames: list[object], data: st.DataObject) -> None:
    head = bytes(frames[0])  # type: ignore[arg-type]
    cut = data.draw(st.integers(0, len(head) - 1))
    with pytest.raises(ProtocolError):
        codec().decode([head[:cut], *(bytes(f) for f in frames[1:])])  # type: ignore[arg-type]


@FUZZ
@given(st.sampled_from(VALID_FRAMES), st.data())
def test_corrupted_headers_never_crash_the_decoder(
    frames: list[object], data: st.DataObject
) -> None:
    head = bytearray(bytes(frames[0]))  # type: ignore[arg-type]
    for _ in range(data.draw(st.integers(1, 4))):
        head[data.draw(st.integers(0, len(head) - 1))] = data.draw(st.integers(0, 255))
    decodes_or_protocol_error([bytes(head), *(bytes(f) for f in frames[1:])])  # type: ignore[arg-type]


def test_huge_declared_lengths_fail_fast() -> None:
    # A 5-byte header claiming a 4-billion-element array must not allocate or hang.
    for data in (b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError):
            codec().decode([data])


def test_a_stats_report_without_walks_or_transport_still_decodes() -> None:
    """What a worker that keeps no step times or tensor bytes sends: the fields read as empty."""
    old = msgspec.msgpack.encode(["Tell", "conductor", ["StatsReport", {"lm": {"steps": 3.0}}]])
    decoded = decode_envelope(old)
    assert isinstance(decoded, Tell) and decoded.body == StatsReport({"lm": {"steps": 3.0}})
    assert decoded.body.walks == {} and decoded.body.transport == {}
    full = StatsReport(
        {},
        {"lm": {"decode": WalkStepStats(2, 5, 0.5, [1, 1])}},
        {"ipc": {"sent": 7, "received": 0}},
    )
    assert decode_envelope(encode_envelope(Tell("c", full))) == Tell("c", full)
