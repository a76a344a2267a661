"""No request left hanging: duplicate ids, early aborts, walks that wait for a lost worker,
lost messages; and nothing left held once a request returns."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from mstar import (
    EMIT,
    DynamicLoop,
    EngineType,
    GraphEdge,
    GraphNode,
    Model,
    ModelGraph,
    RequestStalledError,
    batched,
)
from mstar.engines.parallel import TensorParallelRankLostError
from mstar.errors import DuplicateRequestError, RequestAbortedError, WorkerUnavailableError
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request
from mstar.runtime.conductor import WorkerLost
from mstar.runtime.conductor_core import ConductorCore, StartWalk
from mstar.runtime.messages import NodeValuesMsg, StartWalkMsg, UpdatePeer, WalkDoneMsg
from mstar.runtime.model import Output, PreparedRequest
from mstar.transport.janitor import SHM_DIR, runtime_dir
from mstar.wire import ActorId
from mstar.zoo.noop import NoopLoopModel
from mstar.zoo.toy import ToyModel
from tests.helpers import wait_until_idle
from tests.server.models import save_tiny_chat_llama

TWO_RANKS = (
    "node_groups:\n  - {node_names: [a, done], ranks: [0]}\n  - {node_names: [b], ranks: [1]}\n"
)
# toy-composite's speech: prefill and decode on rank 0, its vocoder (a later walk) on rank 1.
VOCODER_APART = (
    "node_groups:\n  - {node_names: [encoder, lm, init, image_encoder, cond, uncond, "
    "combine, vae], ranks: [0]}\n"
    "  - {node_names: [vocoder], ranks: [1]}\n"
)


async def start(steps: int, **config: float) -> AsyncEngine:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": steps})
    return await AsyncEngine.start(
        spec, Placement.from_yaml(TWO_RANKS), EngineConfig(offload_steps=False, **config)
    )  # type: ignore[arg-type]


@pytest_asyncio.fixture
async def endless() -> AsyncIterator[AsyncEngine]:
    async with await start(10_000_000) as engine:
        yield engine


async def until(predicate: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def test_a_duplicate_id_is_refused_and_the_first_request_keeps_running(
    endless: AsyncEngine,
) -> None:
    first = asyncio.ensure_future(endless.run(Request("loop", {}, "dup")))

    async def running() -> bool:
        return (await endless.held_state())["conductor"]["requests"] == 1

    await until(running)
    with pytest.raises(DuplicateRequestError, match="'dup' is already running"):
        await endless.run(Request("loop", {}, "dup"))
    assert not first.done()
    # The first one still owns its stream: aborting it ends that stream (it did not lose it).
    await endless.abort("dup")
    with pytest.raises(RequestAbortedError):
        await asyncio.wait_for(first, 5)
    await wait_until_idle(endless)


async def test_a_duplicate_id_does_not_cut_the_first_requests_outputs() -> None:
    async with await start(3_000) as engine:
        first = asyncio.ensure_future(engine.run(Request("loop", {}, "same")))
        await asyncio.sleep(0)  # submitted
        with pytest.raises(DuplicateRequestError):
            await engine.run(Request("loop", {}, "same"))
        outputs = await asyncio.wait_for(first, 10)
        assert [o.data for o in outputs] == [3_000]


async def test_an_abort_before_the_first_iteration_is_not_lost(endless: AsyncEngine) -> None:
    outputs = endless.generate(Request("loop", {}, "early"))
    await endless.abort("early")
    with pytest.raises(RequestAbortedError, match="'early' was aborted"):
        await asyncio.wait_for(anext(outputs), 5)
    await wait_until_idle(endless)


async def start_toy(**config: float) -> AsyncEngine:
    placement = Placement.from_yaml(VOCODER_APART)
    return await AsyncEngine.start(
        ToyModel(), placement, EngineConfig(offload_steps=False, **config)
    )  # type: ignore[arg-type]


def back(engine: AsyncEngine, rank: int) -> None:
    assert engine.conductor is not None
    worker = engine.workers[rank]
    engine.conductor.tell(UpdatePeer(rank, ActorId(worker.address, worker.name)))


async def test_a_new_request_for_a_lost_rank_fails_fast_and_runs_once_it_is_back() -> None:
    async with await start(50) as engine:
        assert engine.conductor is not None
        engine.conductor.tell(WorkerLost(1, restart_estimate_s=30.0))
        # Refused at once (not after restart_wait_s), naming the rank and when to retry.
        with pytest.raises(WorkerUnavailableError, match="rank 1 is down") as refused:
            await asyncio.wait_for(engine.run(Request("loop", {})), 10)
        assert refused.value.rank == 1 and 1 <= refused.value.retry_after_s <= 30
        assert (await engine.held_state())["conductor"] == {
            "requests": 0,
            "client_queues": 0,
            "parked_walks": 0,
        }
        back(engine, 1)
        # The first request after the rank is back runs (no stale failure).
        assert [o.data for o in await asyncio.wait_for(engine.run(Request("loop", {})), 10)] == [50]
        await wait_until_idle(engine)


async def speech_running_at_the_loss(engine: AsyncEngine) -> asyncio.Future[list[Output]]:
    """Start a speech request, then lose rank 1 while its prefill's end is held back (so that
    it runs, and has not used rank 1 yet, when the rank is lost)."""
    assert engine.conductor is not None
    held: list[Callable[[], None]] = []
    prefill_done = asyncio.Event()

    def hook(target: str, message: Any, deliver: Callable[[], None]) -> bool:
        if isinstance(message, WalkDoneMsg) and not held:
            held.append(deliver)
            prefill_done.set()
            return True
        return False

    engine.system.fault_hook = hook
    running = asyncio.ensure_future(engine.run(Request("speech", {"text": "hello there"})))
    await asyncio.wait_for(prefill_done.wait(), 30)
    engine.system.fault_hook = None
    engine.conductor.tell(WorkerLost(1))
    held[0]()  # after the loss, in the conductor's mailbox
    return running


async def test_a_running_requests_walk_for_a_lost_rank_waits_for_its_restart() -> None:
    async with await start_toy() as engine:
        running = await speech_running_at_the_loss(engine)

        async def parked() -> bool:
            return (await engine.held_state())["conductor"]["parked_walks"] >= 1

        await until(parked, 30)  # its vocoder walk waits for rank 1 (the request holds work)
        # A request submitted now does not wait: it fails once it needs rank 1.
        with pytest.raises(WorkerUnavailableError, match="rank 1 is down"):
            await asyncio.wait_for(engine.run(Request("speech", {"text": "hello there"})), 30)
        back(engine, 1)
        outputs = await asyncio.wait_for(running, 30)
        assert any(o.modality == "audio" for o in outputs)
        await wait_until_idle(engine)


async def test_a_rank_that_does_not_come_back_fails_its_waiting_walks() -> None:
    async with await start_toy(restart_wait_s=0.2) as engine:
        running = await speech_running_at_the_loss(engine)
        with pytest.raises(
            WorkerUnavailableError, match=r"did not come back within 0\.2 s"
        ) as gone:
            await asyncio.wait_for(running, 30)
        assert gone.value.rank == 1
        with pytest.raises(WorkerUnavailableError, match="rank 1 died and did not come back"):
            await asyncio.wait_for(engine.run(Request("speech", {"text": "x"})), 30)
        back(engine, 1)
        outputs = await asyncio.wait_for(engine.run(Request("speech", {"text": "hello there"})), 30)
        assert any(o.modality == "audio" for o in outputs)
        await wait_until_idle(engine)


class LosesARankOfItsGroup(NoopLoopModel):
    """``b`` fails as a tensor-parallel collective does when it finds a rank's process gone."""

    lost: int | None = None

    def submodule(self, node: str, device: torch.device) -> Any:
        inner = super().submodule(node, device)
        if node != "b":
            return inner

        def b(batch: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
            if self.lost is not None:
                message = "ShmGroup: rank 1 (pid 4242) is gone"
                raise TensorParallelRankLostError(message, rank=self.lost)
            return inner(batch)  # type: ignore[no-any-return]

        return b


async def test_a_rank_a_collective_finds_gone_fails_the_request_as_its_loss_does() -> None:
    """The group's collective notices the death before the watchdog: the request fails as the
    watchdog's notice fails it (the same error, retryable), not as a node's error."""
    model = LosesARankOfItsGroup(steps=5)
    config = EngineConfig(offload_steps=False)
    async with await AsyncEngine.start(model, Placement.from_yaml(TWO_RANKS), config) as engine:
        assert engine.conductor is not None
        model.lost = 1
        with pytest.raises(WorkerUnavailableError, match="the worker of rank 1 died") as lost:
            await asyncio.wait_for(engine.run(Request("loop", {})), 10)
        assert lost.value.rank == 1 and lost.value.retry_after_s >= 1
        await wait_until_idle(engine)
        # The watchdog's notice that follows finds nothing of it; new requests fail fast.
        engine.conductor.tell(WorkerLost(1, restart_estimate_s=30.0))
        with pytest.raises(WorkerUnavailableError, match="rank 1 is down"):
            await asyncio.wait_for(engine.run(Request("loop", {})), 10)
        model.lost = None
        back(engine, 1)
        assert [o.data for o in await asyncio.wait_for(engine.run(Request("loop", {})), 10)] == [5]
        await wait_until_idle(engine)


class SlowPreprocess(NoopLoopModel):
    """Takes a while to prepare each request (as tokenizing a very long text does)."""

    def preprocess(self, request: Request) -> PreparedRequest:
        time.sleep(float(request.data.get("prep_s", 0.0)))
        return super().preprocess(request)


async def test_preprocessing_runs_off_the_event_loop() -> None:
    async with await AsyncEngine.start(
        SlowPreprocess(steps=5), config=EngineConfig(offload_steps=False)
    ) as engine:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        outputs = await asyncio.wait_for(engine.run(Request("loop", {"prep_s": 1.5})), 10)
        ticker.cancel()
        assert [o.data for o in outputs] == [5]
        assert max(gaps) < 0.75, f"the loop stalled for {max(gaps):.2f} s"  # rather than 1.5 s


async def test_an_engine_start_removes_what_killed_processes_left() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    stale = [
        SHM_DIR / f"mstar-{pid}-0123456789ab",
        runtime_dir() / f"mstar-{pid}-0123456789ab.sock",
    ]
    for path in stale:
        path.write_bytes(b"")
    async with await start(3):
        assert not any(path.exists() for path in stale)


@pytest.mark.timeout(120)
def test_worker_processes_without_a_main_guard_say_how_to_fix_it(tmp_path: Path) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import asyncio\n"
        "from mstar import AsyncEngine, EngineConfig, ModelSpec\n"
        "spec = ModelSpec('mstar.zoo.noop:NoopLoopModel', {'steps': 3})\n"
        "asyncio.run(AsyncEngine.start(spec, config=EngineConfig(worker_processes=True)))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path
    )
    assert done.returncode != 0
    assert "MissingMainGuardError" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "PeerLostError" not in done.stderr


# --- lost messages --------------------------------------------------------------------------


def drop_first(kind: type, taken: list[Any]) -> Callable[[str, Any, Callable[[], None]], bool]:
    """A fault hook that drops the first message of ``kind`` (and keeps it in ``taken``)."""

    def hook(target: str, message: Any, deliver: Callable[[], None]) -> bool:
        if isinstance(message, kind) and not taken:
            taken.append(message)
            return True
        return False

    return hook


@pytest.mark.parametrize("kind", [StartWalkMsg, NodeValuesMsg, WalkDoneMsg])
async def test_a_request_whose_message_is_lost_fails_as_stalled_and_frees_what_it_held(
    kind: type,
) -> None:
    async with await start(30, request_stall_timeout_s=0.4) as engine:
        taken: list[Any] = []
        engine.system.fault_hook = drop_first(kind, taken)
        with pytest.raises(RequestStalledError, match=r"made no progress for 0\.4 s"):
            await asyncio.wait_for(engine.run(Request("loop", {}, "dropped")), 10)
        assert len(taken) == 1 and taken[0].request_id == "dropped"
        await wait_until_idle(engine)
        # The others run on (a request that makes progress never stalls, however long it runs).
        engine.system.fault_hook = None
        outputs = await asyncio.wait_for(engine.run(Request("loop", {})), 10)
        assert [o.data for o in outputs] == [30]


class Ticker(Model):
    """One node in a loop that emits every step, each step taking ``delay_s``."""

    name = "ticker"

    def __init__(self, steps: int, delay_s: float) -> None:
        self.steps, self.delay_s = steps, delay_s
        tick = GraphNode(
            "tick",
            {"i"},
            [GraphEdge("tick", "i"), GraphEdge(EMIT, "i", modality="latent")],
            signals={"stop"},
        )
        loop = DynamicLoop(tick, max_iters=steps, stop="stop")
        self._graph = ModelGraph(
            name="ticker", walks={"loop": loop}, partitions={"P": ["loop"]}, inputs={"tick": {"i"}}
        )

    def graph(self) -> ModelGraph:
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        return {"tick": EngineType.STATELESS}

    def submodule(self, node: str, device: torch.device) -> Any:
        def tick(x: Mapping[str, Any]) -> dict[str, Any]:
            time.sleep(self.delay_s)
            return {"i": x["i"] + 1, "stop": x["i"] + 1 >= self.steps}

        return batched(tick)

    def tasks(self) -> tuple[str, ...]:
        return ("loop",)

    def preprocess(self, request: Request) -> PreparedRequest:
        return PreparedRequest({"tick": {"i": 0}})

    def first_walk(self, partition: str, state: Any) -> str | None:
        return "loop"

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        return None


async def test_a_request_that_keeps_making_progress_is_never_stalled() -> None:
    # 20 steps of 50 ms: a second in all, four stall timeouts, with an output every step.
    config = EngineConfig(offload_steps=False, request_stall_timeout_s=0.25)
    async with await AsyncEngine.start(Ticker(20, 0.05), config=config) as engine:
        outputs = await asyncio.wait_for(engine.run(Request("loop", {})), 10)
        assert [o.data for o in outputs] == list(range(1, 21))


def test_the_stall_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="request_stall_timeout_s"):
        EngineConfig(request_stall_timeout_s=0)


# --- held state -----------------------------------------------------------------------------


async def test_held_state_shows_nothing_of_a_request_once_it_returned(tmp_path: Path) -> None:
    spec = ModelSpec("mstar.zoo.llm:TextLLM", {"checkpoint": str(save_tiny_chat_llama(tmp_path))})
    async with await AsyncEngine.start(spec) as engine:
        for i in range(5):
            # Sampled (temperature 1): without ignore_eos, an end token could end one early.
            data = {"prompt_token_ids": [1, 5, 9], "max_tokens": 3, "ignore_eos": True}
            outputs = await engine.run(Request("generate", data, f"r{i}"))
            assert len(outputs) == 3
            held = await engine.held_state()  # at once: no waiting for the next engine step
            assert all(v == 0 for counts in held.values() for v in counts.values()), held
        # A client that leaves early: once its generator is closed, the request holds nothing.
        request = Request(
            "generate",
            {"prompt_token_ids": [1, 5, 9], "max_tokens": 50, "ignore_eos": True},
            "left",
        )
        async with contextlib.aclosing(engine.generate(request)) as outputs:
            async for _ in outputs:
                break
        held = await engine.held_state()
        assert all(v == 0 for counts in held.values() for v in counts.values()), held


# --- replicas -------------------------------------------------------------------------------


def test_while_a_rank_is_down_new_walks_pick_a_live_replica_and_requests_keep_theirs() -> None:
    model = ToyModel()
    graph = model.graph()
    core = ConductorCore(
        model, graph, {(n.name, w): (0, 1, 2) for w in graph.walks for n in graph.walk_nodes(w)}
    )

    def started(commands: list[Any]) -> list[StartWalk]:
        return [c for c in commands if isinstance(c, StartWalk)]

    prefills = [started(core.submit(Request("speech", {"text": "hi"}, f"r{i}"))) for i in range(3)]
    assert [[c.rank for c in walks] for walks in prefills] == [[0], [1], [2]]  # spread by index
    core.ranks_down.add(0)
    # A running request stays where its state is: r2's decode walk runs on rank 2 again (its
    # pick among the live ranks 1 and 2 would be rank 1).
    decode = started(core.walk_done("r2", prefills[2][0].walk_seq, 2, {}))
    assert [(c.walk, c.rank) for c in decode] == [("decode", 2)]
    # New requests spread over the live replicas only.
    news = [started(core.submit(Request("speech", {"text": "hi"}, f"n{i}"))) for i in range(4)]
    assert [c.rank for walks in news for c in walks] == [2, 1, 2, 1]
    core.ranks_down.discard(0)
    # index 7 of 0, 1, 2
    assert [c.rank for c in started(core.submit(Request("speech", {"text": "hi"}, "back")))] == [1]
