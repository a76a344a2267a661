"""Node values to and from their wire form (`mstar.messages.Value`).

Inside one process values pass by reference and are never converted; only a message to
another actor system carries wire values. Tuples come back as lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mstar.errors import ProtocolError
from mstar.messages import (
    BytesValue,
    ChunkValue,
    DictValue,
    ListValue,
    PyValue,
    SlotValue,
    TensorValue,
    Value,
)
from mstar.streaming import Chunk

__all__ = ["from_slots", "from_wire", "to_slots", "to_wire"]

_WIRE = (TensorValue, PyValue, BytesValue, ListValue, DictValue, ChunkValue)
Slot = tuple[str, str]


def to_wire(value: Any) -> Value:
    """Convert a node value to its wire form.

    Raises:
        ProtocolError: The value has a type that cannot cross processes.
    """
    if isinstance(value, torch.Tensor):
        return TensorValue(value)
    if value is None or isinstance(value, bool | int | float | str):
        return PyValue(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return BytesValue(bytes(value))
    if isinstance(value, Chunk):
        return ChunkValue([to_wire(v) for v in value.items], value.start, value.context_len, value.is_last)
    if isinstance(value, list | tuple):
        return ListValue([to_wire(v) for v in value])
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return DictValue({k: to_wire(v) for k, v in value.items()})
    if isinstance(value, np.ndarray | np.generic):
        return TensorValue(torch.from_numpy(np.ascontiguousarray(value)))
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
    if isinstance(value, PyValue):
        return value.value
    if isinstance(value, BytesValue):
        return value.data
    if isinstance(value, ListValue):
        return [from_wire(v) for v in value.items]
    if isinstance(value, DictValue):
        return {k: from_wire(v) for k, v in value.items.items()}
    return Chunk(tuple(from_wire(v) for v in value.items), value.start, value.context_len, value.is_last)


def to_slots(values: Mapping[Slot, Any], *, wire: bool) -> list[SlotValue]:
    """Pack slot values for a message (converted only when ``wire``)."""
    return [SlotValue(node, name, to_wire(v) if wire else v) for (node, name), v in values.items()]


def from_slots(slots: list[SlotValue]) -> dict[Slot, Any]:
    """Unpack slot values from a message."""
    return {(s.node, s.name): from_wire(s.value) for s in slots}
