"""Chaos run: serve a model under mixed load, inject faults on a schedule, prove nothing hangs.

    python scripts/chaos.py --duration 60                        # orpheus-tiny, then toy-composite
    python scripts/chaos.py --duration 5 --models toy-composite   # what the test suite runs
    python scripts/chaos.py --duration 900 --json soak.json       # the soak: 15 minutes per model

Each model is served in this process (uvicorn in a thread, as `mstar serve` runs it):
``orpheus-tiny`` with a worker process per rank and both nodes replicated on ranks 0 and 1,
``toy-composite`` with its workers in process. Clients stream speech from ``/generate`` and
``/v1/audio/speech`` in a closed loop while a scheduler injects, in turn:

- ``kill_worker`` / ``stop_worker``: SIGKILL a worker process, or SIGSTOP it and SIGCONT it
  a second later (worker processes only);
- ``drop_message``: the engine's actor system loses the next message that moves a walk on
  (a walk's start, a walk share's end, values between ranks; `ActorSystem.fault_hook`): that
  request fails with `RequestStalledError` after ``--stall-s`` seconds and is released;
- ``delay_message``: every message the engine's actor system sends or receives is held back
  for 0.1 to 1 s, then delivered in order (a link that stalls);
- ``node_raise``: a request whose text makes the toy LM raise at its first decode step, after
  its first token went out (toy-composite, which runs in this process);
- ``disconnect``: a client that leaves mid-stream;
- ``oversized`` / ``malformed`` / ``long_text``: a body over the 16 MiB limit, bytes that are
  not JSON, a text over the cap;
- ``kv_burst``: a burst of long requests past the running limit (KV-cache and admission
  pressure);
- ``fuzz``: bodies drawn from hypothesis strategies (random JSON values and near-valid
  requests) to every POST route.

Every request ends as ``ok``, ``typed_error`` (a 4xx/5xx with an error body, or a stream
whose last line or event is an error), ``lost`` (a cut stream, a non-JSON 500, a refused
connection while the server runs) or ``hung`` (no progress, neither its answer's headers nor
a body chunk, for ``--hang-s``; or ten times that in all). The run fails
unless lost, hung and every leftover (request state the engine still holds, processes,
shared segments, socket files, descriptors) are zero. The table goes to stdout at the end;
``--json`` writes the same figures to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.actors import ActorSystem
from mstar.engines.stateless import BatchedNode
from mstar.runtime import EngineConfig, Placement
from mstar.runtime.messages import NodeValuesMsg, StartWalkMsg, WalkDoneMsg
from mstar.server import AdmissionLimits, ServerConfig, configure_logging, make_app
from mstar.server.runner import DrainingServer, uvicorn_config
from mstar.transport.janitor import SHM_DIR, runtime_dir
from mstar.zoo import resolve_model
from mstar.zoo.toy import ToyModel, make_toy_inputs, make_toy_nodes

REPLICATED_ORPHEUS = "node_groups:\n  - {node_names: [LLM, snac_decoder], ranks: [0, 1]}\n"
FAULTS = (
    "kill_worker",
    "stop_worker",
    "drop_message",
    "disconnect",
    "oversized",
    "delay_message",
    "malformed",
    "node_raise",
    "long_text",
    "kv_burst",
    "fuzz",
)
WORKER_FAULTS = frozenset({"kill_worker", "stop_worker"})  # worker processes only
IN_PROCESS_FAULTS = frozenset({"node_raise"})  # a model of this script's own, in this process
# Messages that move a walk on: losing one stalls its request (see `drop_message`).
WALK_MESSAGES = (StartWalkMsg, WalkDoneMsg, NodeValuesMsg)
RAISE_TEXT = "chaos: raise in lm"
# How a stream that a lost worker ended is told (raw audio has no room for an error: it is cut).
WORKER_LOSS_KINDS = frozenset({"WorkerLostError", "WorkerUnavailableError", "cut raw audio"})


class RaisingToy(ToyModel):
    """toy-composite whose LM raises at the first decode step of a request whose text is
    `RAISE_TEXT` (its first token is out by then): a node failing for one request."""

    def submodule(self, node: str, device: torch.device) -> BatchedNode:
        inner = super().submodule(node, device)
        if node != "lm":
            return inner
        nodes = make_toy_nodes(self.config, self.seed)
        marker = nodes["encoder"](
            {"text": make_toy_inputs(RAISE_TEXT, self.config)["encoder"]["text"]}
        )["hidden"]
        bos = self.config.bos_id

        def lm(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
            for x in batch:
                if int(x["token"]) != bos and torch.equal(x["hidden"], marker):
                    raise RuntimeError("chaos: the toy LM fails this request on purpose")
            return list(inner(batch))

        return lm


class Progress:
    """When a request last made progress (its answer's headers, or a body chunk)."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        # when its answer was complete (before any Retry-After wait)
        self.ended: float | None = None
        self.headers_s: float | None = None
        self.num_bytes = 0

    def saw(self, num_bytes: int) -> None:
        now = time.monotonic()
        if self.headers_s is None:
            self.headers_s = now - self.start
        self.last = now
        self.num_bytes += num_bytes

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def describe(self) -> str:
        if self.headers_s is None:
            return f"no answer in {self.elapsed():.0f} s"
        idle = time.monotonic() - self.last
        return (
            f"headers after {self.headers_s:.1f} s, {self.num_bytes} bytes, then nothing "
            f"for {idle:.0f} s"
        )


class MessageFaults:
    """Fault hooks for an `ActorSystem` (installed, and run, on its event loop)."""

    def __init__(self, system: ActorSystem, loop: asyncio.AbstractEventLoop) -> None:
        self.system, self.loop = system, loop
        self.num_dropped = 0
        self.num_delayed = 0

    def drop_next_walk_message(self) -> None:
        """Lose the next message that moves a walk on."""

        def hook(target: str, message: Any, deliver: Callable[[], None]) -> bool:
            if not isinstance(message, WALK_MESSAGES):
                return False
            self.system.fault_hook = None
            self.num_dropped += 1
            return True

        self.loop.call_soon_threadsafe(setattr, self.system, "fault_hook", hook)

    def delay_everything(self, seconds: float) -> None:
        """Hold every message back for ``seconds``, then deliver them in the order they came."""
        held: deque[Callable[[], None]] = deque()

        def hook(target: str, message: Any, deliver: Callable[[], None]) -> bool:
            held.append(deliver)
            self.num_delayed += 1
            return True

        def release() -> None:
            if self.system.fault_hook is hook:
                self.system.fault_hook = None
            while held:
                # an actor or link gone meanwhile: lost, as on a wire
                with contextlib.suppress(Exception):
                    held.popleft()()

        def install() -> None:
            self.system.fault_hook = hook
            self.loop.call_later(seconds, release)

        self.loop.call_soon_threadsafe(install)


@dataclass(frozen=True)
class ChaosSettings:
    """What to run: models, how long, how hard, how often to inject a fault."""

    models: tuple[str, ...] = ("orpheus-tiny", "toy-composite")
    duration_s: float = 60.0
    concurrency: int = 4
    fault_every_s: float = 2.0
    hang_s: float = 60.0
    stall_s: float = 30.0
    seed: int = 0
    json_path: str | None = None


@dataclass
class Tally:
    """Outcomes of one model's run."""

    outcomes: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    affected: int = 0  # requests that overlapped a fault window or were faults themselves
    # from a worker fault until /health is 200 again
    recoveries: list[float] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)  # when a worker was killed (monotonic)
    # (start, end) of streams a lost worker ended
    worker_losses: list[tuple[float, float]] = field(default_factory=list)

    def stream_end_delays(self) -> list[float]:
        """Per kill, how long until the last stream it ended had its error (the loss seen and
        told)."""
        delays = []
        for kill in self.kills:
            ends = [end - kill for start, end in self.worker_losses if start <= kill <= end]
            if ends:
                delays.append(max(ends))
        return delays

    examples: dict[str, str] = field(default_factory=dict)  # outcome -> one example
    # typed errors by mstar_error (or HTTP status)
    error_kinds: Counter[str] = field(default_factory=Counter)
    slow: int = 0  # requests that took longer than --hang-s in all, making progress all along

    def record(
        self, outcome: str, detail: str = "", *, affected: bool = False, kind: str = ""
    ) -> None:
        self.outcomes[outcome] += 1
        self.affected += affected
        if outcome == "typed_error" and kind:
            self.error_kinds[kind] += 1
        if outcome not in ("ok", "typed_error") or outcome not in self.examples:
            self.examples.setdefault(outcome, detail[:200])


class Chaos:
    """One model served under load and faults."""

    def __init__(self, model: str, cfg: ChaosSettings) -> None:
        self.model = model
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.tally = Tally()
        self.processes = model == "orpheus-tiny"
        self.fault_until = 0.0  # requests started before this overlap a fault
        self.url = ""
        self.server: DrainingServer | None = None
        self.messages: MessageFaults | None = None

    # --- server ------------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        config = ServerConfig(
            port=0, admission=AdmissionLimits(max_running=8, max_waiting=8), graceful_shutdown_s=2.0
        )
        engine = EngineConfig(
            worker_processes=self.processes,
            restart_wait_s=30.0,
            request_stall_timeout_s=self.cfg.stall_s,
        )
        placement = Placement.from_yaml(REPLICATED_ORPHEUS) if self.processes else None
        model = RaisingToy() if self.model == "toy-composite" else resolve_model(self.model)
        app = make_app(
            model, config, names=(self.model,), placement=placement, engine_config=engine
        )
        self.app = app
        self.server = DrainingServer(uvicorn_config(app, config), config, app)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.sock = sock
        thread = threading.Thread(target=lambda: self.server.run(sockets=[sock]), daemon=True)  # type: ignore[union-attr]
        thread.start()
        deadline = time.monotonic() + 300
        while not self.server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the server did not start: {getattr(app.state, 'startup_error', None)!r}"
                )
            time.sleep(0.05)
        assert self.server._loop is not None
        self.messages = MessageFaults(self.engine.system, self.server._loop)
        return thread

    @property
    def engine(self) -> Any:
        return self.app.state.server.engine

    # --- load --------------------------------------------------------------------------------

    def speech_body(self, *, long: bool = False) -> tuple[str, dict[str, Any]]:
        words = " ".join(
            self.rng.choice(["hello", "mstar", "serves", "speech", "today"])
            for _ in range(self.rng.randint(1, 6))
        )
        body: dict[str, Any]
        if self.rng.random() < 0.5:
            path, body = "/generate", {"task": "speech", "text": words}
        else:
            path, body = (
                "/v1/audio/speech",
                {"model": self.model, "input": words, "response_format": "pcm", "stream": True},
            )
            if self.rng.random() < 0.5:
                body["stream_format"] = "sse"
        if self.model == "orpheus-tiny":
            # Random weights rarely end speech: every request runs to max_tokens. Short ones
            # (1 to 12 SNAC frames of 7 tokens) keep its queues turning over; bursts are long.
            body["max_tokens"] = 560 if long else 7 * self.rng.randint(1, 12)
        return path, body

    async def one_request(
        self,
        http: httpx.AsyncClient,
        path: str,
        body: dict[str, Any],
        *,
        leave_after: int = 0,
        expect: str = "",
    ) -> None:
        """Send one request and record how it ended (``expect``: the typed error it must end
        with)."""
        affected = time.monotonic() < self.fault_until
        kind = ""
        progress = Progress()
        try:
            outcome, detail, kind = await self._until_idle(
                self._stream(http, path, body, leave_after, progress), progress
            )
        except TimeoutError:
            outcome, detail = "hung", f"{progress.describe()}: {path} {json.dumps(body)[:100]}"
        except httpx.RemoteProtocolError as exc:
            # Raw audio has no room for an error event: a failure cuts the chunked transfer
            # short (documented), which the client sees as this error, not as silence.
            is_raw_audio = path == "/v1/audio/speech" and "stream_format" not in body
            outcome, detail = ("typed_error", "") if is_raw_audio else ("lost", f"{path}: {exc}")
            kind = "cut raw audio"
        except httpx.HTTPError as exc:
            outcome, detail = "lost", f"{path}: {type(exc).__name__}: {exc}"
        if outcome == "typed_error" and kind in WORKER_LOSS_KINDS:
            self.tally.worker_losses.append((progress.start, progress.ended or time.monotonic()))
        if expect and (outcome, kind) != ("typed_error", expect):
            outcome, detail = (
                "lost",
                f"{path}: ended {outcome} ({kind or 'no error'}), not with {expect}",
            )
        self.tally.record(
            outcome, detail, affected=affected or time.monotonic() < self.fault_until, kind=kind
        )
        if progress.elapsed() > self.cfg.hang_s and outcome != "hung":
            self.tally.slow += 1

    async def _until_idle(
        self, work: Coroutine[Any, Any, tuple[str, str, str]], progress: Progress
    ) -> tuple[str, str, str]:
        """Await ``work``; raise TimeoutError once it made no progress for ``--hang-s`` (or ran
        ten times that long in all)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                idle = time.monotonic() - progress.last
                left = min(self.cfg.hang_s - idle, 10 * self.cfg.hang_s - progress.elapsed())
                if left <= 0:
                    raise TimeoutError
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task

    async def _stream(
        self,
        http: httpx.AsyncClient,
        path: str,
        body: dict[str, Any],
        leave_after: int,
        progress: Progress,
    ) -> tuple[str, str, str]:
        async with http.stream("POST", path, json=body) as response:
            progress.saw(0)
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                progress.ended = time.monotonic()
                if not _is_error_body(text):
                    return "lost", f"{response.status_code}: {text[:100]}", ""
                # a client that honours Retry-After (1 s here) rather than spinning
                if response.status_code == 503:
                    with contextlib.suppress(ValueError):
                        await asyncio.sleep(
                            min(float(response.headers.get("retry-after", "1")), 5.0)
                        )
                return "typed_error", "", _error_kind(text, response.status_code)
            last = b""
            received = 0
            async for chunk in response.aiter_bytes():
                progress.saw(len(chunk))
                received += 1
                last = (last + chunk)[-4096:]
                if leave_after and received >= leave_after:
                    # a client that disconnects
                    return "typed_error", "left on purpose", "client left"
            tail = [line for line in last.decode(errors="replace").splitlines() if line.strip()][
                -1:
            ]
            if path == "/generate" or "stream_format" in body:  # NDJSON lines, SSE events
                end = '"finished":true' if path == "/generate" else '"speech.audio.done"'
                if tail and end in tail[0]:
                    return "ok", "", ""
                if tail and _is_error_body(tail[0]):
                    return "typed_error", "", _error_kind(tail[0], None)
                return "lost", f"{path}: the stream ended without its end or an error: {tail!r}", ""
            return "ok", "", ""  # raw audio that ended with its last chunk

    async def client_loop(self, deadline: float) -> None:
        async with httpx.AsyncClient(
            base_url=self.url, timeout=httpx.Timeout(2 * self.cfg.hang_s)
        ) as http:
            while time.monotonic() < deadline:
                path, body = self.speech_body()
                await self.one_request(http, path, body)

    # --- faults ------------------------------------------------------------------------------

    def worker_pids(self) -> set[int]:
        return {p.pid for p in self.engine.processes.values() if p.pid is not None}

    async def inject(self, fault: str, http: httpx.AsyncClient) -> None:
        self.tally.faults[fault] += 1
        self.pids |= self.worker_pids()
        self.fault_until = time.monotonic() + 3.0
        if fault in ("kill_worker", "stop_worker"):
            procs = self.engine.processes
            rank = self.rng.choice(sorted(procs))
            pid = procs[rank].pid
            if pid is None:
                return
            start = time.monotonic()
            if fault == "kill_worker":
                os.kill(pid, signal.SIGKILL)
                self.tally.kills.append(start)
            else:
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(1.0)
                os.kill(pid, signal.SIGCONT)
            # A killed worker counts as recovered once its replacement serves (a probe may
            # otherwise find /health still 200 before the engine saw the death).
            replaced = (rank, pid) if fault == "kill_worker" else None
            self.tally.recoveries.append(await self.until_healthy(http, start, replaced))
        elif fault == "disconnect":
            path, body = self.speech_body()
            await self.one_request(http, path, body, leave_after=2)
        elif fault == "oversized":
            await self.expect_4xx(
                http, "/generate", content=b'{"text": "' + b"a" * (17 << 20) + b'"}', detail=fault
            )
        elif fault == "malformed":
            junk = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 64)))
            await self.expect_4xx(
                http, self.rng.choice(["/generate", "/v1/audio/speech"]), content=junk, detail=fault
            )
        elif fault == "long_text":
            await self.expect_4xx(
                http,
                "/generate",
                content=json.dumps({"task": "speech", "text": "a" * 20_000}).encode(),
                detail=fault,
            )
        elif fault == "drop_message":
            assert self.messages is not None
            self.messages.drop_next_walk_message()
        elif fault == "delay_message":
            assert self.messages is not None
            self.messages.delay_everything(self.rng.uniform(0.1, 1.0))
        elif fault == "node_raise":
            await self.one_request(
                http,
                "/generate",
                {"task": "speech", "text": RAISE_TEXT},
                expect="WalkExecutionError",
            )
        elif fault == "kv_burst":
            burst = [self.speech_body(long=True) for _ in range(20)]
            await asyncio.gather(*(self.one_request(http, p, b) for p, b in burst))
        elif fault == "fuzz":
            await asyncio.to_thread(self.fuzz)

    async def expect_4xx(
        self, http: httpx.AsyncClient, path: str, *, content: bytes, detail: str
    ) -> None:
        try:
            answer = await http.post(
                path, content=content, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            self.tally.record("lost", f"{detail}: {exc}", affected=True)
            return
        ok = 400 <= answer.status_code < 500 and _is_error_body(answer.text)
        kind = _error_kind(answer.text, answer.status_code) if ok else ""
        self.tally.record(
            "typed_error" if ok else "lost",
            f"{detail}: {answer.status_code} {answer.text[:100]}",
            affected=True,
            kind=kind,
        )

    def fuzz(self) -> None:
        """POST hypothesis-drawn bodies to every route: each must get a typed answer (no 5xx)."""
        url, tally, model = self.url, self.tally, self.model

        @settings(
            max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(
            st.sampled_from(
                ["/generate", "/v1/audio/speech", "/v1/chat/completions", "/v1/images/generations"]
            ),
            _bodies(model),
        )
        def post(path: str, body: Any) -> None:
            try:
                answer = httpx.post(url + path, json=body, timeout=self.cfg.hang_s)
            except httpx.HTTPError as exc:
                tally.record("lost", f"fuzz {path}: {exc}", affected=True)
                return
            typed = answer.status_code == 200 or (
                answer.status_code < 500 and _is_error_body(answer.text)
            )
            kind = (
                _error_kind(answer.text, answer.status_code)
                if typed and answer.status_code != 200
                else ""
            )
            tally.record(
                "typed_error" if typed else "lost",
                f"fuzz {path} {json.dumps(body)[:80]}: {answer.status_code} {answer.text[:80]}",
                affected=True,
                kind=kind,
            )

        post()

    async def until_healthy(
        self, http: httpx.AsyncClient, since: float, replaced: tuple[int, int] | None = None
    ) -> float:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if replaced is not None and self.engine.processes[replaced[0]].pid == replaced[1]:
                await asyncio.sleep(0.05)
                continue
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get("/health")).status_code == 200 and all(
                    self.engine.ranks_up().values()
                ):
                    return time.monotonic() - since
            await asyncio.sleep(0.05)
        return float("inf")

    async def _healthy_since(self, since: float) -> float:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            return await self.until_healthy(http, since)

    async def fault_loop(self, deadline: float) -> None:
        faults = [
            f
            for f in FAULTS
            if (f not in WORKER_FAULTS or self.processes)
            and (f not in IN_PROCESS_FAULTS or not self.processes)
        ]
        async with httpx.AsyncClient(
            base_url=self.url, timeout=httpx.Timeout(2 * self.cfg.hang_s)
        ) as http:
            turn = 0
            while time.monotonic() + self.cfg.fault_every_s < deadline:
                await asyncio.sleep(self.cfg.fault_every_s)
                await self.inject(faults[turn % len(faults)], http)
                turn += 1

    # --- the run -----------------------------------------------------------------------------

    async def run_load(self) -> None:
        deadline = time.monotonic() + self.cfg.duration_s
        await asyncio.gather(
            self.fault_loop(deadline),
            *(self.client_loop(deadline) for _ in range(self.cfg.concurrency)),
        )

    def run(self) -> dict[str, Any]:
        me = psutil.Process()
        rss_before = _rss(me)
        fds_before = me.num_fds()
        children_before = {p.pid for p in me.children(recursive=True)}
        files_before = _mstar_files({me.pid})
        thread = self.start()
        self.pids = {me.pid} | self.worker_pids()
        asyncio.run(self.run_load())
        assert self.messages is not None
        # an armed drop
        self.messages.loop.call_soon_threadsafe(setattr, self.engine.system, "fault_hook", None)
        recovered = asyncio.run(self._healthy_since(time.monotonic()))
        held = _wait_idle(self)
        self.pids |= self.worker_pids()
        rss_serving = _rss(me)
        assert self.server is not None
        self.server.handle_exit(signal.SIGTERM, None)
        thread.join(60)
        self.sock.close()
        leftover_procs = [
            p
            for p in me.children(recursive=True)
            if p.pid not in children_before
            and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())
        ]
        files = _mstar_files(self.pids) - files_before
        return {
            "model": self.model,
            "tally": self.tally,
            "recovered_s": recovered,
            "held_after": held,
            "messages_dropped": self.messages.num_dropped,
            "messages_delayed": self.messages.num_delayed,
            "server_stopped": not thread.is_alive(),
            "leftover_processes": len(leftover_procs),
            "leftover_segments": sum(1 for f in files if f.startswith("shm:")),
            "leftover_sockets": sum(1 for f in files if f.startswith("sock:")),
            "leftover_fds": max(0, me.num_fds() - fds_before),
            "rss_before_mb": rss_before,
            "rss_serving_mb": rss_serving,
            "rss_after_mb": _rss(me),
        }


def _bodies(model: str) -> st.SearchStrategy[Any]:
    """Random JSON values, and near-valid requests with fields of random types."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=40)
    )
    values = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )
    fields = [
        "text",
        "input",
        "prompt",
        "voice",
        "stream",
        "max_tokens",
        "temperature",
        "messages",
        "n",
        "response_format",
    ]
    near_valid = st.fixed_dictionaries(
        {"model": st.just(model), "task": st.just("speech")}, optional={f: values for f in fields}
    )
    return values | near_valid


def _is_error_body(text: str) -> bool:
    for line in text.strip().splitlines()[-1:] or [text]:
        line = line.removeprefix("data: ").strip()
        with contextlib.suppress(ValueError):
            parsed = json.loads(line)
            return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict | str)
    return False


def _error_kind(text: str, status: int | None) -> str:
    """Name a typed error: the mstar error class its body names, else its HTTP status (None: an
    error event in a stream)."""
    for line in text.strip().splitlines()[-1:] or [text]:
        with contextlib.suppress(ValueError, TypeError, KeyError):
            error = json.loads(line.removeprefix("data: ").strip())["error"]
            if isinstance(error, dict) and error.get("mstar_error"):
                return str(error["mstar_error"])
    return "error event" if status is None else f"HTTP {status}"


def _rss(proc: psutil.Process) -> float:
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return round(total / 2**20, 1)


def _mstar_files(pids: set[int]) -> set[str]:
    """Return the shared segments and socket files owned by ``pids`` (other mstar processes
    on the machine have theirs)."""
    prefixes = tuple(f"mstar-{pid}-" for pid in pids)
    out = set()
    for kind, directory in (("shm", SHM_DIR), ("sock", runtime_dir())):
        with contextlib.suppress(OSError):
            out |= {f"{kind}:{p.name}" for p in directory.iterdir() if p.name.startswith(prefixes)}
    return out


def _wait_idle(chaos: Chaos, timeout: float = 30.0) -> int:
    """Wait (bounded) until the server and the engine hold nothing; return what they still hold
    (requests running, admission slots, and every count of `AsyncEngine.held_state`)."""
    state = chaos.app.state.server
    assert chaos.messages is not None
    deadline = time.monotonic() + timeout
    left = -1
    while time.monotonic() < deadline:
        left = len(state.running) + state.admission.num_running
        if left == 0:
            held = asyncio.run_coroutine_threadsafe(
                state.engine.held_state(), chaos.messages.loop
            ).result(60)
            left = sum(v for counts in held.values() for v in counts.values())
            if left == 0:
                return 0
        time.sleep(0.05)
    return left


def parse_args(argv: list[str] | None = None) -> ChaosSettings:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of load per model (default 60)"
    )
    parser.add_argument(
        "--models", default="orpheus-tiny,toy-composite", help="comma-separated zoo models"
    )
    parser.add_argument(
        "--concurrency", type=int, default=4, help="closed-loop clients (default 4)"
    )
    parser.add_argument(
        "--fault-every", type=float, default=2.0, help="seconds between faults (default 2)"
    )
    parser.add_argument(
        "--hang-s",
        type=float,
        default=60.0,
        help="a request with no progress (headers, a body chunk) for this long is hung "
        "(default 60)",
    )
    parser.add_argument(
        "--stall-s",
        type=float,
        default=30.0,
        help="the engine's request_stall_timeout_s: a request whose message was dropped "
        "fails after this long (default 30)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", dest="json_path", metavar="PATH", help="also write the figures to this JSON file"
    )
    args = parser.parse_args(argv)
    models = tuple(m for m in args.models.split(",") if m)
    if args.duration <= 0 or args.concurrency < 1 or args.fault_every <= 0 or not models:
        parser.error("--duration, --fault-every must be > 0, --concurrency >= 1, and name a model")
    if not 0 < args.stall_s < args.hang_s:
        parser.error(
            "--stall-s must be > 0 and below --hang-s (a stalled request must fail before it "
            "counts as hung)"
        )
    return ChaosSettings(
        models,
        args.duration,
        args.concurrency,
        args.fault_every,
        args.hang_s,
        args.stall_s,
        args.seed,
        args.json_path,
    )


def report(results: list[dict[str, Any]]) -> str:
    rows = [
        (
            "faults injected",
            lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["tally"].faults.items())) or "0",
        ),
        ("requests", lambda r: sum(r["tally"].outcomes.values())),
        ("requests affected by a fault", lambda r: r["tally"].affected),
        ("completed", lambda r: r["tally"].outcomes["ok"]),
        ("failed with a typed error", lambda r: r["tally"].outcomes["typed_error"]),
        (
            "  of them stalled (lost message)",
            lambda r: r["tally"].error_kinds["RequestStalledError"],
        ),
        ("  of them a node's error", lambda r: r["tally"].error_kinds["WalkExecutionError"]),
        (
            "  of them a lost or restarting worker",
            lambda r: (
                r["tally"].error_kinds["WorkerLostError"]
                + r["tally"].error_kinds["WorkerUnavailableError"]
            ),
        ),
        (
            "messages dropped / delayed",
            lambda r: f"{r['messages_dropped']} / {r['messages_delayed']}",
        ),
        ("lost (must be 0)", lambda r: r["tally"].outcomes["lost"]),
        ("hung (must be 0)", lambda r: r["tally"].outcomes["hung"]),
        ("slow (over --hang-s in all, never idle)", lambda r: r["tally"].slow),
        (
            "worker killed to its streams ended, max s",
            lambda r: f"{max(r['tally'].stream_end_delays(), default=0.0):.2f}",
        ),
        (
            "time to recover (restart), max s",
            lambda r: f"{max(r['tally'].recoveries, default=0.0):.2f}",
        ),
        ("healthy after the load, s", lambda r: f"{r['recovered_s']:.2f}"),
        ("requests still held", lambda r: r["held_after"]),
        ("leftover processes", lambda r: r["leftover_processes"]),
        ("leftover shared segments", lambda r: r["leftover_segments"]),
        ("leftover socket files", lambda r: r["leftover_sockets"]),
        ("leftover fds", lambda r: r["leftover_fds"]),
        (
            "RSS before / serving / after, MiB",
            lambda r: f"{r['rss_before_mb']} / {r['rss_serving_mb']} / {r['rss_after_mb']}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{r['model']:>24}" for r in results)]
    for name, cell in rows:
        lines.append(f"{name:{width}}  " + "  ".join(f"{cell(r)!s:>24}" for r in results))
    for r in results:
        for outcome, example in r["tally"].examples.items():
            if outcome in ("lost", "hung"):
                lines.append(f"{r['model']}: {outcome} e.g. {example}")
    return "\n".join(lines)


def is_clean(result: dict[str, Any]) -> bool:
    """Whether a model's run lost, hung and leaked nothing."""
    keys = (
        "held_after",
        "leftover_processes",
        "leftover_segments",
        "leftover_sockets",
        "leftover_fds",
    )
    outcomes = result["tally"].outcomes
    return (
        outcomes["lost"] == outcomes["hung"] == 0
        and result["server_stopped"]
        and not any(result[k] for k in keys)
    )


def warm_up() -> None:
    """Create what a process creates once (loop and executor pipes, the ZeroMQ context), so
    that the descriptors counted around each run are the run's own."""
    zmq.Context.instance().socket(zmq.DEALER).close(linger=0)
    resource_tracker.ensure_running()  # spawn starts it once, with a pipe it keeps
    Chaos("toy-composite", ChaosSettings(("toy-composite",), 0.5, 1, 10.0, 30.0)).run()


def to_json(cfg: ChaosSettings, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the run's settings and figures as JSON values."""
    models = []
    for r in results:
        tally: Tally = r["tally"]
        figures = {k: v for k, v in r.items() if k != "tally"}
        models.append(
            {
                **figures,
                "faults": dict(tally.faults),
                "outcomes": {k: tally.outcomes[k] for k in ("ok", "typed_error", "lost", "hung")},
                "requests": sum(tally.outcomes.values()),
                "affected": tally.affected,
                "slow": tally.slow,
                "typed_errors_by_kind": dict(tally.error_kinds),
                "recover_max_s": max(tally.recoveries, default=0.0),
                "worker_loss_streams_end_max_s": max(tally.stream_end_delays(), default=0.0),
                "examples": tally.examples,
                "is_clean": is_clean(r),
            }
        )
    return {"settings": asdict(cfg), "models": models}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    configure_logging("error", json=False)
    warm_up()
    print(
        f"chaos: models={','.join(cfg.models)} duration={cfg.duration_s}s "
        f"concurrency={cfg.concurrency} "
        f"fault_every={cfg.fault_every_s}s hang_s={cfg.hang_s} stall_s={cfg.stall_s} "
        f"seed={cfg.seed}",
        flush=True,
    )
    print(
        "orpheus-tiny: worker processes, LLM and SNAC replicated on ranks 0 and 1; "
        "toy-composite: in-process workers",
        flush=True,
    )
    started = time.monotonic()
    results = [Chaos(model, cfg).run() for model in cfg.models]
    print(report(results), flush=True)
    print(f"wall time {time.monotonic() - started:.0f} s", flush=True)
    if cfg.json_path is not None:
        figures = to_json(cfg, results)
        Path(cfg.json_path).write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0 if all(is_clean(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
