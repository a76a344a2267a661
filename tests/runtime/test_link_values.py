"""Node values cross every link as they are: the link converts them, not the roles."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from mstar.actors import Actor, ActorSystem
from mstar.engines import SamplingParams
from mstar.runtime.messages import EmittedMsg, NodeValuesMsg, StartWalkMsg
from mstar.runtime.values import (
    BytesValue,
    ChunkValue,
    DictValue,
    ListValue,
    SlotValue,
    TensorValue,
)
from mstar.streaming import Chunk
from tests.actors.conftest import TEST_CONFIG, bind_address


class Recorder(Actor):
    """Keep what arrives; answer asks with what arrived."""

    def __init__(self) -> None:
        self.seen: asyncio.Queue[Any] = asyncio.Queue()

    async def handle(self, message: Any) -> Any:
        self.seen.put_nowait(message)
        return message


def _no_wire_values(value: Any) -> None:
    assert not isinstance(value, TensorValue | BytesValue | ListValue | DictValue | ChunkValue), (
        value
    )
    if isinstance(value, list | tuple):
        for item in value:
            _no_wire_values(item)


@pytest.mark.parametrize("transport", ["inproc", "ipc", "tcp"])
async def test_values_arrive_as_values_on_every_transport(transport: str) -> None:
    tensor = torch.arange(6.0).reshape(2, 3)
    sampling = SamplingParams(temperature=0.7, top_k=5, stop_token_ids=(2, 9), seed=11, logprobs=3)
    values = [
        tensor,
        3,
        "s",
        None,
        [1, torch.ones(2)],
        Chunk((torch.zeros(1),), 4, 1, True),
        {"params": sampling},
    ]
    async with ActorSystem(TEST_CONFIG) as server, ActorSystem(TEST_CONFIG) as client:
        address = await server.serve(bind_address(transport))
        holder: list[Recorder] = []

        def make() -> Recorder:
            holder.append(Recorder())
            return holder[-1]

        await server.spawn(make, name="rec")
        ref = client.ref("rec", address)
        keys = [("a", "x", "", "")] * len(values)
        ref.tell(NodeValuesMsg("r", 0, keys, values))  # type: ignore[arg-type]
        got = await asyncio.wait_for(holder[0].seen.get(), 10)
        assert isinstance(got, NodeValuesMsg)
        _no_wire_values(got.values)
        assert torch.equal(got.values[0], tensor) and got.values[1:4] == [3, "s", None]
        assert (
            isinstance(got.values[5], Chunk) and got.values[5].start == 4 and got.values[5].is_last
        )
        assert got.values[6] == {"params": sampling}  # typed on the other side too, not a dict
        assert type(got.values[6]["params"]) is SamplingParams and got.values[6][
            "params"
        ].stop_token_ids == (2, 9)
        if transport == "inproc":
            assert got.values[0] is tensor  # by reference, never converted
        # Asks and their replies too.
        reply = await ref.ask(StartWalkMsg("r", 1, "w", {"a": 0}, [SlotValue("a", "x", tensor)]))  # type: ignore[arg-type]
        assert isinstance(reply, StartWalkMsg)
        assert torch.equal(reply.initial[0].value, tensor)
        reply = await ref.ask(EmittedMsg("r", "P", "w", "n", "out", "latent", [tensor]))  # type: ignore[arg-type]
        assert isinstance(reply, EmittedMsg) and not isinstance(reply.value, TensorValue)
        assert torch.equal(reply.value[0], tensor)
