"""Chaos run: serve a model under mixed load, inject faults on a schedule, prove nothing hangs.

    python scripts/chaos.py --duration 60                        # orpheus-tiny, then toy-composite
    python scripts/chaos.py --duration 5 --models toy-composite   # what the test suite runs

Each model is served in this process (uvicorn in a thread, as `mstar serve` runs it):
``orpheus-tiny`` with a worker process per rank and both nodes replicated on ranks 0 and 1,
``toy-composite`` with its workers in process. Clients stream speech from ``/generate`` and
``/v1/audio/speech`` in a closed loop while a scheduler injects, in turn:

- ``kill_worker`` / ``stop_worker``: SIGKILL a worker process, or SIGSTOP it and SIGCONT it
  a second later (worker processes only);
- ``disconnect``: a client that leaves mid-stream;
- ``oversized`` / ``malformed`` / ``long_text``: a body over the 16 MiB limit, bytes that are
  not JSON, a text over the cap;
- ``kv_burst``: a burst of long requests past the running limit (KV-cache and admission
  pressure);
- ``fuzz``: bodies drawn from hypothesis strategies (random JSON values and near-valid
  requests) to every POST route.

Every request ends as ``ok``, ``typed_error`` (a 4xx/5xx with an error body, or a stream
whose last line or event is an error), ``lost`` (a cut stream, a non-JSON 500, a refused
connection while the server runs) or ``hung`` (no end within ``--hang-s``). The run fails
unless lost, hung and every leftover (processes, shared segments, socket files, descriptors)
are zero.
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
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Any

import httpx
import psutil
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.runtime import EngineConfig, Placement
from mstar.server import AdmissionLimits, ServerConfig, configure_logging, make_app
from mstar.server.serve_cli import DrainingServer, uvicorn_config
from mstar.transport.janitor import SHM_DIR, runtime_dir
from mstar.zoo import resolve_model

REPLICATED_ORPHEUS = "node_groups:\n  - {node_names: [LLM, snac_decoder], ranks: [0, 1]}\n"
FAULTS = ("kill_worker", "stop_worker", "disconnect", "oversized", "malformed", "long_text", "kv_burst", "fuzz")


@dataclass(frozen=True)
class ChaosSettings:
    """What to run: models, how long, how hard, how often to inject a fault."""

    models: tuple[str, ...] = ("orpheus-tiny", "toy-composite")
    duration_s: float = 60.0
    concurrency: int = 4
    fault_every_s: float = 2.0
    hang_s: float = 60.0
    seed: int = 0


@dataclass
class Tally:
    """Outcomes of one model's run."""

    outcomes: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    affected: int = 0  # requests that overlapped a fault window or were faults themselves
    recoveries: list[float] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)  # outcome -> one example

    def record(self, outcome: str, detail: str = "", *, affected: bool = False) -> None:
        self.outcomes[outcome] += 1
        self.affected += affected
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

    # --- server ------------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        config = ServerConfig(port=0, admission=AdmissionLimits(max_running=8, max_waiting=8), graceful_shutdown_s=2.0)
        engine = EngineConfig(worker_processes=self.processes, restart_wait_s=30.0)
        placement = Placement.from_yaml(REPLICATED_ORPHEUS) if self.processes else None
        app = make_app(resolve_model(self.model), config, names=(self.model,), placement=placement, engine_config=engine)
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
                raise RuntimeError(f"the server did not start: {getattr(app.state, 'startup_error', None)!r}")
            time.sleep(0.05)
        return thread

    @property
    def engine(self) -> Any:
        return self.app.state.server.engine

    # --- load --------------------------------------------------------------------------------

    def speech_body(self, *, long: bool = False) -> tuple[str, dict[str, Any]]:
        words = " ".join(self.rng.choice(["hello", "mstar", "serves", "speech", "today"]) for _ in range(self.rng.randint(1, 6)))
        if self.rng.random() < 0.5:
            body: dict[str, Any] = {"task": "speech", "text": words}
            if long and self.model == "orpheus-tiny":
                body["max_tokens"] = 560
            return "/generate", body
        body = {"model": self.model, "input": words, "response_format": "pcm", "stream": True}
        if self.rng.random() < 0.5:
            body["stream_format"] = "sse"
        return "/v1/audio/speech", body

    async def one_request(self, http: httpx.AsyncClient, path: str, body: dict[str, Any], *, leave_after: int = 0) -> None:
        affected = time.monotonic() < self.fault_until
        try:
            async with asyncio.timeout(self.cfg.hang_s):
                outcome, detail = await self._stream(http, path, body, leave_after)
        except TimeoutError:
            outcome, detail = "hung", f"{path} {json.dumps(body)[:100]}"
        except httpx.RemoteProtocolError as exc:
            # Raw audio has no room for an error event: a failure cuts the chunked transfer
            # short (documented), which the client sees as this error, not as silence.
            is_raw_audio = path == "/v1/audio/speech" and "stream_format" not in body
            outcome, detail = ("typed_error", "") if is_raw_audio else ("lost", f"{path}: {exc}")
        except httpx.HTTPError as exc:
            outcome, detail = "lost", f"{path}: {type(exc).__name__}: {exc}"
        self.tally.record(outcome, detail, affected=affected or time.monotonic() < self.fault_until)

    async def _stream(self, http: httpx.AsyncClient, path: str, body: dict[str, Any], leave_after: int) -> tuple[str, str]:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return ("typed_error", "") if _is_error_body(text) else ("lost", f"{response.status_code}: {text[:100]}")
            last = b""
            received = 0
            async for chunk in response.aiter_bytes():
                received += 1
                last = (last + chunk)[-4096:]
                if leave_after and received >= leave_after:
                    return "typed_error", "left on purpose"  # a client that disconnects
            tail = [line for line in last.decode(errors="replace").splitlines() if line.strip()][-1:]
            if path == "/generate" or "stream_format" in body:  # NDJSON lines, SSE events
                end = '"finished":true' if path == "/generate" else '"speech.audio.done"'
                if tail and end in tail[0]:
                    return "ok", ""
                if tail and _is_error_body(tail[0]):
                    return "typed_error", ""
                return "lost", f"{path}: the stream ended without its end or an error: {tail!r}"
            return "ok", ""  # raw audio that ended with its last chunk

    async def client_loop(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.cfg.hang_s)) as http:
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
            else:
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(1.0)
                os.kill(pid, signal.SIGCONT)
            self.tally.recoveries.append(await self.until_healthy(http, start))
        elif fault == "disconnect":
            path, body = self.speech_body()
            await self.one_request(http, path, body, leave_after=2)
        elif fault == "oversized":
            await self.expect_4xx(http, "/generate", content=b'{"text": "' + b"a" * (17 << 20) + b'"}', detail=fault)
        elif fault == "malformed":
            junk = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 64)))
            await self.expect_4xx(http, self.rng.choice(["/generate", "/v1/audio/speech"]), content=junk, detail=fault)
        elif fault == "long_text":
            await self.expect_4xx(http, "/generate", content=json.dumps({"task": "speech", "text": "a" * 20_000}).encode(), detail=fault)
        elif fault == "kv_burst":
            burst = [self.speech_body(long=True) for _ in range(20)]
            await asyncio.gather(*(self.one_request(http, p, b) for p, b in burst))
        elif fault == "fuzz":
            await asyncio.to_thread(self.fuzz)

    async def expect_4xx(self, http: httpx.AsyncClient, path: str, *, content: bytes, detail: str) -> None:
        try:
            answer = await http.post(path, content=content, headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            self.tally.record("lost", f"{detail}: {exc}", affected=True)
            return
        ok = 400 <= answer.status_code < 500 and _is_error_body(answer.text)
        self.tally.record("typed_error" if ok else "lost", f"{detail}: {answer.status_code} {answer.text[:100]}", affected=True)

    def fuzz(self) -> None:
        """POST hypothesis-drawn bodies to every route: each must get a typed answer (no 5xx)."""
        url, tally, model = self.url, self.tally, self.model

        @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(["/generate", "/v1/audio/speech", "/v1/chat/completions", "/v1/images/generations"]), _bodies(model))
        def post(path: str, body: Any) -> None:
            try:
                answer = httpx.post(url + path, json=body, timeout=self.cfg.hang_s)
            except httpx.HTTPError as exc:
                tally.record("lost", f"fuzz {path}: {exc}", affected=True)
                return
            typed = answer.status_code == 200 or (answer.status_code < 500 and _is_error_body(answer.text))
            tally.record("typed_error" if typed else "lost", f"fuzz {path} {json.dumps(body)[:80]}: {answer.status_code} {answer.text[:80]}", affected=True)

        post()

    async def until_healthy(self, http: httpx.AsyncClient, since: float) -> float:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get("/health")).status_code == 200 and all(self.engine.ranks_up().values()):
                    return time.monotonic() - since
            await asyncio.sleep(0.05)
        return float("inf")

    async def _healthy_since(self, since: float) -> float:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            return await self.until_healthy(http, since)

    async def fault_loop(self, deadline: float) -> None:
        faults = [f for f in FAULTS if self.processes or f not in ("kill_worker", "stop_worker")]
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.cfg.hang_s)) as http:
            turn = 0
            while time.monotonic() + self.cfg.fault_every_s < deadline:
                await asyncio.sleep(self.cfg.fault_every_s)
                await self.inject(faults[turn % len(faults)], http)
                turn += 1

    # --- the run -----------------------------------------------------------------------------

    async def run_load(self) -> None:
        deadline = time.monotonic() + self.cfg.duration_s
        await asyncio.gather(self.fault_loop(deadline), *(self.client_loop(deadline) for _ in range(self.cfg.concurrency)))

    def run(self) -> dict[str, Any]:
        me = psutil.Process()
        rss_before = _rss(me)
        fds_before = me.num_fds()
        children_before = {p.pid for p in me.children(recursive=True)}
        files_before = _mstar_files({me.pid})
        thread = self.start()
        self.pids = {me.pid} | self.worker_pids()
        asyncio.run(self.run_load())
        recovered = asyncio.run(self._healthy_since(time.monotonic()))
        held = _wait_idle(self)
        self.pids |= self.worker_pids()
        rss_serving = _rss(me)
        assert self.server is not None
        self.server.handle_exit(signal.SIGTERM, None)
        thread.join(60)
        self.sock.close()
        leftover_procs = [
            p for p in me.children(recursive=True)
            if p.pid not in children_before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())
        ]
        files = _mstar_files(self.pids) - files_before
        return {
            "model": self.model,
            "tally": self.tally,
            "recovered_s": recovered,
            "held_after": held,
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
    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
    fields = ["text", "input", "prompt", "voice", "stream", "max_tokens", "temperature", "messages", "n", "response_format"]
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
    """Wait (bounded) until the engine holds nothing; return what it still holds."""
    state = chaos.app.state.server
    deadline = time.monotonic() + timeout
    left = -1
    while time.monotonic() < deadline:
        left = len(state.running) + state.admission.num_running
        if left == 0:
            return 0
        time.sleep(0.05)
    return left


def parse_args(argv: list[str] | None = None) -> ChaosSettings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per model (default 60)")
    parser.add_argument("--models", default="orpheus-tiny,toy-composite", help="comma-separated zoo models")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop clients (default 4)")
    parser.add_argument("--fault-every", type=float, default=2.0, help="seconds between faults (default 2)")
    parser.add_argument("--hang-s", type=float, default=60.0, help="a request not done in this long is hung")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    models = tuple(m for m in args.models.split(",") if m)
    if args.duration <= 0 or args.concurrency < 1 or args.fault_every <= 0 or not models:
        parser.error("--duration, --fault-every must be > 0, --concurrency >= 1, and name a model")
    return ChaosSettings(models, args.duration, args.concurrency, args.fault_every, args.hang_s, args.seed)


def report(results: list[dict[str, Any]]) -> str:
    rows = [
        ("faults injected", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["tally"].faults.items())) or "0"),
        ("requests", lambda r: sum(r["tally"].outcomes.values())),
        ("requests affected by a fault", lambda r: r["tally"].affected),
        ("completed", lambda r: r["tally"].outcomes["ok"]),
        ("failed with a typed error", lambda r: r["tally"].outcomes["typed_error"]),
        ("lost (must be 0)", lambda r: r["tally"].outcomes["lost"]),
        ("hung (must be 0)", lambda r: r["tally"].outcomes["hung"]),
        ("time to recover, max s", lambda r: f"{max(r['tally'].recoveries, default=0.0):.2f}"),
        ("healthy after the load, s", lambda r: f"{r['recovered_s']:.2f}"),
        ("requests still held", lambda r: r["held_after"]),
        ("leftover processes", lambda r: r["leftover_processes"]),
        ("leftover shared segments", lambda r: r["leftover_segments"]),
        ("leftover socket files", lambda r: r["leftover_sockets"]),
        ("leftover fds", lambda r: r["leftover_fds"]),
        ("RSS before / serving / after, MiB", lambda r: f"{r['rss_before_mb']} / {r['rss_serving_mb']} / {r['rss_after_mb']}"),
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
    keys = ("held_after", "leftover_processes", "leftover_segments", "leftover_sockets", "leftover_fds")
    outcomes = result["tally"].outcomes
    return outcomes["lost"] == outcomes["hung"] == 0 and result["server_stopped"] and not any(result[k] for k in keys)


def warm_up() -> None:
    """Create what a process creates once (loop and executor pipes, the ZeroMQ context), so
    that the descriptors counted around each run are the run's own."""
    zmq.Context.instance().socket(zmq.DEALER).close(linger=0)
    resource_tracker.ensure_running()  # spawn starts it once, with a pipe it keeps
    Chaos("toy-composite", ChaosSettings(("toy-composite",), 0.5, 1, 10.0, 30.0)).run()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    configure_logging("error", json=False)
    warm_up()
    print(f"chaos: models={','.join(cfg.models)} duration={cfg.duration_s}s concurrency={cfg.concurrency} "
          f"fault_every={cfg.fault_every_s}s hang_s={cfg.hang_s} seed={cfg.seed}", flush=True)
    print("orpheus-tiny: worker processes, LLM and SNAC replicated on ranks 0 and 1; toy-composite: in-process workers", flush=True)
    results = [Chaos(model, cfg).run() for model in cfg.models]
    print(report(results), flush=True)
    return 0 if all(is_clean(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
