"""Benchmark `/v1/realtime` against the chat route's SSE stream on the same server, side by side.

    python scripts/bench_realtime.py                  # qwen3-omni-small, c = 1, 4, 16
    python scripts/bench_realtime.py --quick          # qwen3-omni-tiny, c = 1, 4

Starts ``mstar serve MODEL`` (a subprocess, as a user runs it), then at each concurrency c runs
c clients at once through each path in turn, ``--rounds`` times, every answer the same request
(a user text turn, greedy, ``--max-tokens`` tokens, spoken):

- ``realtime``: one session per client, opened before timing; TTFA is ``response.create``
  sent to the first ``response.output_audio.delta``;
- ``sse``: ``POST /v1/chat/completions`` with ``modalities: ["text", "audio"]`` and
  ``stream: true`` through the `openai` client; TTFA is the request sent to its first audio
  delta.

Then ``--cancels`` times, a session asks for a long answer and cancels at its first audio
delta: cancel-to-done is ``response.cancel`` sent to ``response.done`` (status cancelled), and
deltas arriving after it are counted (there must be none). Prints the configuration, a table of
TTFA p50 / p95 per path and c with the ratio realtime / sse, and the cancel figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
import openai

TEXT = "Tell me about the sea."


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(model: str, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "mstar.cli", "serve", model, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mstar serve {model} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"mstar serve {model} did not start in 300 s")


async def _realtime_ttfa(
    client: openai.AsyncOpenAI, model: str, max_tokens: int, go: asyncio.Event
) -> float | None:
    async with client.realtime.connect(model=model) as conn:
        await conn.recv()  # session.created
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": TEXT}],
        }
        await conn.conversation.item.create(item=item)
        await go.wait()
        start = time.perf_counter()
        await conn.response.create(response={"max_output_tokens": max_tokens})
        first = None
        async for event in conn:
            if event.type == "response.output_audio.delta" and first is None:
                first = time.perf_counter() - start
            if event.type == "response.done":
                break
    return first


async def _sse_ttfa(
    client: openai.AsyncOpenAI, model: str, max_tokens: int, go: asyncio.Event
) -> float | None:
    await go.wait()
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": TEXT}],
        modalities=["text", "audio"],
        audio={"voice": "default", "format": "pcm16"},  # type: ignore[typeddict-item]
        max_tokens=max_tokens,
        stream=True,
    )
    first = None
    async for chunk in stream:
        audio = chunk.choices[0].delta.audio if chunk.choices else None  # type: ignore[attr-defined]
        if first is None and audio and getattr(audio, "data", None):
            first = time.perf_counter() - start
    return first


async def _round(
    path: str, client: openai.AsyncOpenAI, model: str, c: int, max_tokens: int
) -> list[float | None]:
    go = asyncio.Event()
    run = _realtime_ttfa if path == "realtime" else _sse_ttfa
    tasks = [asyncio.create_task(run(client, model, max_tokens, go)) for _ in range(c)]
    await asyncio.sleep(0.5)  # realtime sessions open (and their items land) before timing
    go.set()
    return list(await asyncio.gather(*tasks))


async def _cancel(client: openai.AsyncOpenAI, model: str) -> tuple[float, int] | None:
    """One cancel at the first audio delta: (cancel-to-done seconds, deltas after done), or
    None where the answer ended before the cancel landed."""
    async with client.realtime.connect(model=model) as conn:
        await conn.recv()
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": TEXT}],
        }
        await conn.conversation.item.create(item=item)
        await conn.response.create(response={"max_output_tokens": 400})
        async for event in conn:
            if event.type == "response.done":
                return None  # said nothing (the talker drew the codec's end at once)
            if event.type == "response.output_audio.delta":
                break
        start = time.perf_counter()
        await conn.response.cancel()
        done = None
        async for event in conn:
            if event.type == "response.done":
                if event.response.status != "cancelled":
                    return None
                done = time.perf_counter() - start
                break
        late = 0
        try:
            while True:  # anything still coming after response.done is a late delta
                event = await asyncio.wait_for(conn.recv(), 0.5)
                late += event.type.endswith(".delta")
        except TimeoutError:
            pass
    assert done is not None
    return done, late


def _step_counters(port: int) -> dict[str, tuple[float, float]]:
    """Each KV-cache node's cumulative (steps, step seconds), from the server's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    got: dict[str, list[float]] = {}
    for line in text.splitlines():
        for index, name in enumerate(("mstar_engine_steps{", "mstar_engine_step_seconds{")):
            if line.startswith(name):
                labels, value = line[len(name) :].rsplit("} ", 1)
                node = labels.split('node="', 1)[1].split('"', 1)[0]
                got.setdefault(node, [0.0, 0.0])[index] = float(value)
    return {node: (v[0], v[1]) for node, v in got.items()}


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    print("bench_realtime: configuration")
    print(f"  model: {args.model} served by `mstar serve` in a subprocess; {os.cpu_count()} cores")
    print(
        f"  request: one user text turn {TEXT!r}, {args.max_tokens} tokens, spoken (pcm16 24 kHz)"
    )
    print(f"  concurrency: {levels}; rounds per point: {args.rounds}; cancels: {args.cancels}")
    port = _free_port()
    proc = _serve(args.model, port)
    try:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        await _round("sse", client, args.model, 1, args.max_tokens)  # warm up both paths
        await _round("realtime", client, args.model, 1, args.max_tokens)
        print("\n| c | realtime TTFA p50 / p95 ms | SSE TTFA p50 / p95 ms | realtime / SSE p50 |")
        print("|---|---|---|---|")
        for c in levels:
            got: dict[str, list[float | None]] = {"realtime": [], "sse": []}
            for _ in range(args.rounds):
                for path in ("sse", "realtime"):  # the same load on both, alternating
                    got[path] += await _round(path, client, args.model, c, args.max_tokens)
            # Answers whose talker said nothing (random weights draw the codec's end at
            # once, now and then) have no TTFA: they are counted apart.
            rt = [t for t in got["realtime"] if t is not None]
            sse = [t for t in got["sse"] if t is not None]
            silent = sum(t is None for ts in got.values() for t in ts)
            if not rt or not sse:
                print(f"| {c} | - | - | - |  ({silent} answers said nothing)")
                continue
            ratio = statistics.median(rt) / statistics.median(sse)
            print(
                f"| {c} | {_ms(rt, 0.5):.0f} / {_ms(rt, 0.95):.0f} | {_ms(sse, 0.5):.0f} / "
                f"{_ms(sse, 0.95):.0f} | {ratio:.2f}x |"
                + (f"  ({silent} said nothing)" if silent else "")
            )
        before = _step_counters(port)
        results = [await _cancel(client, args.model) for _ in range(args.cancels)]
        after = _step_counters(port)
        cancels = [r for r in results if r is not None]
        if cancels:
            done = [d for d, _ in cancels]
            late = sum(n for _, n in cancels)
            print(
                f"\ncancel: response.cancel -> response.done p50 {_ms(done, 0.5):.1f} ms, "
                f"max {1e3 * max(done):.1f} ms over {len(done)} cancels; deltas after done: {late}"
            )
            # A cancel lands within one step of the node that runs: its steps meanwhile.
            steps = {
                node: 1e3 * (after[node][1] - before.get(node, (0.0, 0.0))[1]) / n
                for node in after
                if (n := after[node][0] - before.get(node, (0.0, 0.0))[0]) > 0
            }
            print(
                "  mean step meanwhile: "
                + ", ".join(f"{node} {ms:.1f} ms" for node, ms in sorted(steps.items()))
            )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default qwen3-omni-small (--quick: tiny)")
    parser.add_argument("--concurrency", default=None, help="comma-separated (default 1,4,16)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cancels", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.model = args.model or ("qwen3-omni-tiny" if args.quick else "qwen3-omni-small")
    args.concurrency = args.concurrency or ("1,4" if args.quick else "1,4,16")
    if args.quick:
        args.rounds, args.cancels = min(args.rounds, 2), min(args.cancels, 3)
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
