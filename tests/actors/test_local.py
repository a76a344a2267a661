"""Actors within one system: lifecycle, failures, supervision, stopping, mailboxes, names."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, ClassVar

import pytest

from mstar.actors import Actor, ActorSystem, RestartPolicy, SystemConfig
from mstar.errors import (
    ActorDeadError,
    ActorHandlerError,
    ActorNameTakenError,
    ActorNotFoundError,
    AskTimeoutError,
    MailboxFullError,
    TransportClosedError,
)
from mstar.wire import Ping, Pong
from tests.actors.conftest import TEST_CONFIG
from tests.actors.peer_actors import Counter, Echo, Failing


@pytest.fixture
async def system() -> AsyncIterator[ActorSystem]:
    async with ActorSystem(TEST_CONFIG) as system:
        yield system


async def enqueued(coro: Any) -> asyncio.Task[Any]:
    """Start `coro` in a task and give it one loop turn, in which an ask reaches the mailbox."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    return task


class Recorder(Actor):
    """Record lifecycle calls in a shared log."""

    log: ClassVar[list[str]] = []

    async def on_start(self) -> None:
        self.log.append(f"start {self.name}")

    async def on_stop(self) -> None:
        self.log.append(f"stop {self.name}")

    async def on_failure(self, error: Exception, message: Any) -> None:
        self.log.append(f"failure {type(error).__name__} {message!r}")

    async def handle(self, message: Any) -> Any:
        self.log.append(f"handle {message!r}")
        if message == "raise":
            raise KeyError("raise")
        return message


class Gate(Actor):
    """Handle each message only once the test opens the gate."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def handle(self, message: Any) -> Any:
        self.entered.set()
        if message == "stop-self":
            await self.system.stop(self.ref)
            return "stopping"
        await self.gate.wait()
        return message


async def test_ask_and_ordered_tells(system: ActorSystem) -> None:
    echo = await system.spawn(Echo, name="echo")
    assert await echo.ask(Ping(3, b"x")) == Pong(3, b"x")
    counter = await system.spawn(Counter)
    for i in range(100):
        counter.tell(Ping(i))
    assert await counter.ask(Pong()) == Pong(100)


async def test_local_messages_may_be_any_object(system: ActorSystem) -> None:
    Recorder.log = []
    ref = await system.spawn(Recorder, name="rec")
    payload = {"a": [1, 2]}
    assert await ref.ask(payload) is payload


async def test_lifecycle_hooks_run_in_order(system: ActorSystem) -> None:
    Recorder.log = []
    ref = await system.spawn(Recorder, name="rec")
    ref.tell("a")
    assert await ref.ask("b") == "b"
    await system.stop(ref)
    assert Recorder.log == ["start rec", "handle 'a'", "handle 'b'", "stop rec"]
    with pytest.raises(ActorDeadError):
        ref.tell("c")
    with pytest.raises(ActorDeadError):
        await ref.ask("c")


async def test_a_failing_ask_fails_only_that_ask(system: ActorSystem) -> None:
    failing = await system.spawn(Failing)
    with pytest.raises(ActorHandlerError, match="cannot handle Ping") as info:
        await failing.ask(Ping())
    assert info.value.error_type == "ValueError"
    assert isinstance(info.value.__cause__, ValueError)
    # The actor and the system keep serving.
    with pytest.raises(ActorHandlerError):
        await failing.ask(Ping())
    echo = await system.spawn(Echo)
    assert await echo.ask(Ping(1)) == Pong(1)


async def test_a_failing_tell_goes_to_on_failure(system: ActorSystem) -> None:
    Recorder.log = []
    ref = await system.spawn(Recorder, name="rec")
    ref.tell("raise")
    assert await ref.ask("after") == "after"
    assert Recorder.log == [
        "start rec",
        "handle 'raise'",
        "failure KeyError 'raise'",
        "handle 'after'",
    ]


class Immediate(Actor):
    """Take told strings at once when idle (``handle_now``); log which path each one took."""

    immediate_types = frozenset({str})

    def __init__(self) -> None:
        self.log: list[str] = []
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    def handle_now(self, message: str) -> None:
        if message in ("raise", "crash"):
            raise KeyError(message)
        self.log.append(f"now {message}")

    async def on_failure(self, error: Exception, message: Any) -> None:
        self.log.append(f"failure {type(error).__name__} {message}")
        if message == "crash":
            raise error

    async def handle(self, message: Any) -> Any:
        if message == "wait":
            self.entered.set()
            await self.gate.wait()
        if message in ("raise", "crash"):
            raise KeyError(message)
        self.log.append(f"handle {message}")
        return message


async def test_an_idle_actor_takes_immediate_tells_in_the_senders_call(system: ActorSystem) -> None:
    actor = Immediate()
    ref = await system.spawn(lambda: actor)
    ref.tell("a")
    assert actor.log == ["now a"]  # handled before tell returned
    assert await ref.ask("b") == "b"  # asks go through the mailbox
    ref.tell(Ping(1))  # not an immediate type: queued
    ref.tell("c")  # queued behind it, to keep the order
    assert await ref.ask("d") == "d"
    assert actor.log == [
        "now a",
        "handle b",
        "handle Ping(seq=1, payload=b'')",
        "handle c",
        "handle d",
    ]


async def test_a_busy_actor_queues_immediate_tells_in_order(system: ActorSystem) -> None:
    actor = Immediate()
    ref = await system.spawn(lambda: actor)
    busy = asyncio.ensure_future(ref.ask("wait"))
    await actor.entered.wait()
    ref.tell("x")
    ref.tell("y")
    assert actor.log == []
    actor.gate.set()
    assert await busy == "wait"
    assert await ref.ask("z") == "z"
    assert actor.log == ["handle wait", "handle x", "handle y", "handle z"]


async def test_an_immediate_tell_that_raises_goes_to_on_failure(system: ActorSystem) -> None:
    actor = Immediate()
    ref = await system.spawn(lambda: actor)
    ref.tell("raise")
    ref.tell("after")  # queued behind the failure
    assert await ref.ask("ask") == "ask"
    assert actor.log == ["failure KeyError raise", "handle after", "handle ask"]


async def test_an_immediate_tell_whose_on_failure_raises_crashes_the_actor(
    system: ActorSystem,
) -> None:
    instances: list[Immediate] = []

    def make() -> Immediate:
        instances.append(Immediate())
        return instances[-1]

    ref = await system.spawn(make, restart=RestartPolicy(max_restarts=1, window_s=60))
    ref.tell("crash")  # raises in handle_now, then in on_failure
    assert await ref.ask("next") == "next"
    assert len(instances) == 2
    assert instances[0].log == ["failure KeyError crash"]
    assert instances[1].log == ["handle next"]


class Crashy(Actor):
    """Crash (on_failure re-raises) on the string "crash"; count instances and stops."""

    instances: ClassVar[int] = 0
    stops: ClassVar[int] = 0

    def __init__(self) -> None:
        type(self).instances += 1
        self.seen = 0

    async def on_stop(self) -> None:
        type(self).stops += 1

    async def on_failure(self, error: Exception, message: Any) -> None:
        raise error

    async def handle(self, message: Any) -> Any:
        if message == "crash":
            raise RuntimeError("crash")
        self.seen += 1
        return self.seen


async def test_crashed_actors_restart_with_a_fresh_instance_and_the_same_mailbox(
    system: ActorSystem,
) -> None:
    Crashy.instances = Crashy.stops = 0
    ref = await system.spawn(Crashy, restart=RestartPolicy(max_restarts=2, window_s=60))
    assert await ref.ask("a") == 1
    ref.tell("crash")
    ref.tell("queued")  # still in the mailbox when the crash happens: the new instance gets it
    assert await ref.ask("b") == 2
    assert (Crashy.instances, Crashy.stops) == (2, 1)


async def test_too_many_crashes_stop_the_actor(system: ActorSystem) -> None:
    Crashy.instances = Crashy.stops = 0
    ref = await system.spawn(
        Crashy, name="crashy", restart=RestartPolicy(max_restarts=1, window_s=60)
    )
    ref.tell("crash")
    ref.tell("crash")
    pending = await enqueued(ref.ask("never"))
    with pytest.raises(ActorDeadError):
        await pending
    assert Crashy.instances == 2
    with pytest.raises(ActorNotFoundError):
        await system.lookup("crashy")


async def test_without_a_restart_policy_a_crash_stops_the_actor(system: ActorSystem) -> None:
    Crashy.instances = 0
    ref = await system.spawn(Crashy)
    ref.tell("crash")
    with pytest.raises(ActorDeadError):
        await ref.ask("x")
    assert Crashy.instances == 1


class FailsToStart(Actor):
    attempts: ClassVar[int] = 0

    async def on_start(self) -> None:
        type(self).attempts += 1
        if type(self).attempts < 2:
            raise OSError("device busy")

    async def handle(self, message: Any) -> Any:
        return "ready"


async def test_on_start_failure_fails_spawn_or_restarts(system: ActorSystem) -> None:
    FailsToStart.attempts = 0
    with pytest.raises(ActorDeadError, match="device busy"):
        await system.spawn(FailsToStart, name="fts")
    # The name is free again, and with a restart policy the second attempt succeeds.
    ref = await system.spawn(FailsToStart, name="fts", restart=RestartPolicy(max_restarts=1))
    assert await ref.ask("?") == "ready"


async def test_stop_finishes_the_current_message_and_fails_queued_asks(system: ActorSystem) -> None:
    gate = Gate()
    ref = await system.spawn(lambda: gate, name="gate")
    current = await enqueued(ref.ask("current"))
    await gate.entered.wait()
    queued = await enqueued(ref.ask("queued"))
    stopping = await enqueued(system.stop(ref))
    with pytest.raises(ActorDeadError, match="stopped"):
        await queued
    gate.gate.set()
    assert await current == "current"
    await stopping


async def test_stop_cancels_a_handler_that_does_not_finish(system: ActorSystem) -> None:
    gate = Gate()
    ref = await system.spawn(lambda: gate)
    current = await enqueued(ref.ask("stuck"))
    await gate.entered.wait()
    await system.stop(ref, timeout=0.05)
    with pytest.raises(ActorDeadError, match="cancelled"):
        await current


async def test_an_actor_can_stop_itself(system: ActorSystem) -> None:
    gate = Gate()
    ref = await system.spawn(lambda: gate, name="self-stopper")
    assert await ref.ask("stop-self") == "stopping"
    with pytest.raises(ActorNotFoundError):
        await system.lookup("self-stopper")


async def test_ask_timeout(system: ActorSystem) -> None:
    gate = Gate()
    ref = await system.spawn(lambda: gate)
    with pytest.raises(AskTimeoutError, match=r"within 0\.05 s"):
        await ref.ask("slow", timeout=0.05)
    gate.gate.set()  # the late answer is dropped; the actor keeps going
    assert await ref.ask("next") == "next"


async def test_a_full_mailbox_refuses_messages(system: ActorSystem) -> None:
    gate = Gate()
    ref = await system.spawn(lambda: gate, mailbox_size=2)
    first = await enqueued(ref.ask(1))
    await gate.entered.wait()  # 1 is being handled: the mailbox is empty again
    ref.tell(2)
    ref.tell(3)
    with pytest.raises(MailboxFullError, match="full"):
        ref.tell(4)
    with pytest.raises(MailboxFullError):
        await ref.ask(5)
    gate.gate.set()
    assert await first == 1


async def test_names_lookup_and_refs(system: ActorSystem) -> None:
    ref = await system.spawn(Echo, name="echo")
    with pytest.raises(ActorNameTakenError):
        await system.spawn(Echo, name="echo")
    auto = await system.spawn(Echo)
    assert auto.name.startswith("echo-") and auto != ref
    assert await system.lookup("echo") == ref
    assert system.ref("echo") == ref and system.ref(ref.id) == ref
    assert hash(system.ref("echo")) == hash(ref)
    with pytest.raises(ActorNotFoundError):
        await system.lookup("nobody")
    with pytest.raises(ActorDeadError):
        system.ref("nobody").tell(Ping())


async def test_shutdown_stops_every_actor_and_owns_every_task() -> None:
    Recorder.log = []
    before = asyncio.all_tasks()
    async with ActorSystem(replace(TEST_CONFIG, stop_timeout_s=0.05)) as system:
        ref = await system.spawn(Recorder, name="a")
        await system.spawn(Recorder, name="b")
        gate = Gate()
        gated = await system.spawn(lambda: gate)
        pending = await enqueued(gated.ask("never"))
        await gate.entered.wait()
        queued = await enqueued(gated.ask("queued"))
    assert sorted(e for e in Recorder.log if e.startswith("stop")) == ["stop a", "stop b"]
    with pytest.raises(ActorDeadError, match="cancelled"):
        await pending
    with pytest.raises(ActorDeadError, match="stopped"):
        await queued
    assert asyncio.all_tasks() - before <= {asyncio.current_task()}
    with pytest.raises(TransportClosedError):
        ref.tell("late")
    with pytest.raises(TransportClosedError):
        await ref.ask("late")
    with pytest.raises(TransportClosedError):
        await system.spawn(Echo)


async def test_an_exception_in_the_body_still_shuts_down_cleanly() -> None:
    Recorder.log = []
    with pytest.raises(ZeroDivisionError):
        async with ActorSystem(TEST_CONFIG) as system:
            await system.spawn(Recorder, name="r")
            1 / 0  # noqa: B018
    assert Recorder.log[-1] == "stop r"


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="mailbox_size"):
        SystemConfig(mailbox_size=0)
    with pytest.raises(ValueError, match="heartbeat"):
        SystemConfig(heartbeat_interval_s=2, heartbeat_timeout_s=1)
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)
