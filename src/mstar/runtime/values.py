"""Node values and their wire form (`Value`: tagged msgspec Structs and plain scalars).

Inside one process values pass by reference and are never converted; a link to another
process converts the values in the messages it carries (`mstar.runtime.messages`), so no
role ever does. Tuples come back as lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Protocol, TypeAlias, TypeGuard

import msgspec
import numpy as np
import torch

from mstar.engines.sampling_params import SamplingParams
from mstar.errors import ProtocolError
from mstar.streaming import Chunk
from mstar.wire import WireStruct

__all__ = [
    "BytesValue",
    "ChunkValue",
    "DictValue",
    "ListValue",
    "SlotValue",
    "TensorValue",
    "Value",
    "WireForm",
    "from_slots",
    "from_wire",
    "slots_from_wire",
    "slots_to_wire",
    "supports_wire_form",
    "to_slots",
    "to_wire",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _Value(WireStruct, tag=True):
    """Base of node values on the wire."""


class TensorValue(_Value):
    """A tensor."""

    tensor: torch.Tensor


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


# Scalars, strings and None travel as themselves (msgpack tells them apart); a request's
# `SamplingParams` too (a tagged Struct of the engines', validated again as it is decoded).
Value: TypeAlias = (
    TensorValue
    | BytesValue
    | ListValue
    | DictValue
    | ChunkValue
    | SamplingParams
    | bool
    | int
    | float
    | str
    | None
)


class SlotValue(WireStruct):
    """The value of input ``name`` of ``node`` (in-process: the value itself)."""

    node: str
    name: str
    value: Value


_WIRE = (TensorValue, BytesValue, ListValue, DictValue, ChunkValue)
_SCALARS = frozenset({bool, int, float, str, type(None)})
Slot = tuple[str, str]


class WireForm(Protocol):
    """A node value of a model's own type that can cross processes as plain data.

    The other side gets what `wire_form` returns (tensors, numbers, strings, bytes, lists and
    str-keyed dicts of them), never the type: nothing on the wire names code to import.
    """

    has_wire_form: ClassVar[Literal[True]]

    def wire_form(self) -> Any:
        """Return the value as plain data."""
        ...


def supports_wire_form(value: object) -> TypeGuard[WireForm]:
    """Whether a value declares `WireForm`."""
    return getattr(value, "has_wire_form", False) is True


def to_wire(value: Any) -> Value:
    """Convert a node value to its wire form.

    Raises:
        ProtocolError: The value has a type that cannot cross processes.
    """
    if type(value) in _SCALARS or type(value) is SamplingParams:
        return value
    if isinstance(value, torch.Tensor):
        return TensorValue(value)
    if isinstance(value, bool | int | float | str):  # a subclass (an enum, say): its plain value
        for kind in (bool, int, float, str):
            if isinstance(value, kind):
                return kind(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return BytesValue(bytes(value))
    if isinstance(value, Chunk):
        return ChunkValue(
            [to_wire(v) for v in value.items], value.start, value.context_len, value.is_last
        )
    if isinstance(value, list | tuple):
        return ListValue([to_wire(v) for v in value])
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return DictValue({k: to_wire(v) for k, v in value.items()})
    if isinstance(value, np.ndarray | np.generic):
        return TensorValue(torch.from_numpy(np.ascontiguousarray(value)))
    if supports_wire_form(value):
        return to_wire(value.wire_form())
    raise ProtocolError(
        f"a node value of type {type(value).__name__} cannot cross processes: use tensors, "
        "numbers, strings, bytes, lists and str-keyed dicts of them"
    )


def from_wire(value: Any) -> Any:
    """Convert a wire value back; anything else (a value passed in-process) is returned as is."""
    if not isinstance(value, _WIRE):
        return value
    if isinstance(value, TensorValue):
        return value.tensor
    if isinstance(value, BytesValue):
        return value.data
    if isinstance(value, ListValue):
        return [from_wire(v) for v in value.items]
    if isinstance(value, DictValue):
        return {k: from_wire(v) for k, v in value.items.items()}
    return Chunk(
        tuple(from_wire(v) for v in value.items), value.start, value.context_len, value.is_last
    )


def to_slots(values: Mapping[Slot, Any]) -> list[SlotValue]:
    """Pack slot values for a message (the values as they are: a link converts them)."""
    return [SlotValue(node, name, v) for (node, name), v in values.items()]


def from_slots(slots: list[SlotValue]) -> dict[Slot, Any]:
    """Unpack slot values from a message."""
    return {(s.node, s.name): s.value for s in slots}


def slots_to_wire(slots: list[SlotValue]) -> list[SlotValue]:
    """Return ``slots`` with their values in wire form."""
    return [SlotValue(s.node, s.name, to_wire(s.value)) for s in slots]


def slots_from_wire(slots: list[SlotValue]) -> list[SlotValue]:
    """Return ``slots`` with their values converted back from wire form."""
    return [SlotValue(s.node, s.name, from_wire(s.value)) for s in slots]
