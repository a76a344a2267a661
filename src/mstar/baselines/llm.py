"""The LLM benchmark's peers: transformers ``generate`` batched, vLLM's client, the decode floor.

- `TransformersBatches`: what a user writes without mstar: ``generate`` run in a thread on
  each batch of the requests that waited together, its tokens streamed per step.
- `VllmPeer`: vLLM's CPU build in a subprocess of its own environment, streaming each
  engine step's tokens back over JSON lines.
- `decode_step_cost` and `add_floors`: the fastest a decode step can go, bound by the bytes it
  must read (every weight it multiplies, every cached key and value: `kv_cache_bytes`) over
  the measured memory bandwidth, or by its arithmetic over the measured FLOP rate
  (`mstar.bench.machine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.baselines.streaming import QueueStreamer

__all__ = [
    "PeerStartError",
    "TransformersBatches",
    "VllmPeer",
    "add_floors",
    "decode_step_cost",
    "kv_cache_bytes",
]


class PeerStartError(RuntimeError):
    """Raised when the vLLM peer cannot start: no interpreter, or it exits while loading."""


@dataclass
class _Waiting:
    """A request waiting for the next batch: its prompt, length and token queue."""

    prompt: list[int]
    new_tokens: int
    queue: asyncio.Queue[int | None]


class TransformersBatches:
    """transformers' `generate` as a service: requests waiting together run as one batch.

    A batch needs equal prompt lengths and output lengths (no padding); greedy, tokens
    streamed per step. ``hf`` is a causal LM (``LlamaForCausalLM``) on ``device``.
    """

    def __init__(self, hf: Any, device: torch.device) -> None:
        self.hf = hf
        self.device = device
        # The same torch threads as this thread (a new thread's OpenMP pool starts at every core).
        self.executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="hf-generate",
            initializer=functools.partial(torch.set_num_threads, torch.get_num_threads()),
        )
        self.waiting: list[_Waiting] = []
        self.draining = False

    async def generate(self, prompt: list[int], new_tokens: int) -> AsyncIterator[int]:
        """Yield the request's tokens as the batch it joined produces them."""
        item = _Waiting(prompt, new_tokens, asyncio.Queue())
        self.waiting.append(item)
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain())
        while (token := await item.queue.get()) is not None:
            yield token

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.waiting:
                batch, self.waiting = self.waiting, []
                streamer = QueueStreamer(loop, [w.queue for w in batch])
                try:
                    await loop.run_in_executor(self.executor, self._run, batch, streamer)
                except Exception:
                    streamer.end()
                    raise
        finally:
            self.draining = False

    def _run(self, batch: list[_Waiting], streamer: QueueStreamer) -> None:
        if len({len(w.prompt) for w in batch}) != 1 or len({w.new_tokens for w in batch}) != 1:
            raise ValueError("a batch needs equal prompt lengths and output lengths")
        ids = torch.tensor([w.prompt for w in batch], device=self.device)
        n = batch[0].new_tokens
        with torch.inference_mode():
            self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                streamer=streamer,
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        streamer.end()


class VllmPeer:
    """vLLM's CPU build in a subprocess of its own environment, serving token streams.

    ``script``, run by ``python`` with ``config`` (JSON) as its argument, speaks JSON lines:
    first ``{"ready": ...}`` (kept as `info`) once its engine is loaded; then a request per
    line in (``{"id", "prompt", "max_tokens"}``; ``{"exit": true}`` to stop), a line per engine
    step out (``{"step": [[id, new_tokens, done], ...]}``). One reader task routes them.
    """

    def __init__(
        self, python: Path, script: Path, config: dict[str, Any], *, threads: int, log: Path
    ) -> None:
        self.python, self.script, self.config = python, script, config
        self.threads, self.log = threads, log
        self.proc: asyncio.subprocess.Process | None = None
        self.queues: dict[str, asyncio.Queue[int | None]] = {}
        self.info: dict[str, Any] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = iter(range(1 << 62))

    async def start(self) -> None:
        """Start the peer and wait until its engine is loaded."""
        if not self.python.exists():
            raise PeerStartError(f"no interpreter of the vLLM environment at {self.python}")
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS=str(self.threads),
        )
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as log:
            self.proc = await asyncio.create_subprocess_exec(
                str(self.python),
                str(self.script),
                json.dumps(self.config),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env=env,
            )
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            await self.proc.wait()
            raise PeerStartError(
                f"the vLLM peer exited while loading (status {self.proc.returncode}); see "
                f"{self.log}"
            )
        self.info = json.loads(line)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            for request_id, tokens, done in json.loads(line)["step"]:
                queue = self.queues.get(request_id)
                if queue is None:
                    continue
                for token in tokens:
                    queue.put_nowait(int(token))
                if done:
                    queue.put_nowait(None)
        for queue in self.queues.values():  # the peer died: nobody waits forever
            queue.put_nowait(None)

    async def generate(self, prompt: list[int], new_tokens: int) -> AsyncIterator[int]:
        """Yield the request's tokens as the peer's steps produce them."""
        assert self.proc is not None and self.proc.stdin is not None
        request_id = f"r{next(self._ids)}"
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.queues[request_id] = queue
        try:
            line = json.dumps({"id": request_id, "prompt": prompt, "max_tokens": new_tokens})
            self.proc.stdin.write(line.encode() + b"\n")
            await self.proc.stdin.drain()
            count = 0
            while (token := await queue.get()) is not None:
                count += 1
                yield token
            if count < new_tokens:
                raise RuntimeError(
                    f"the vLLM peer ended a request after {count} of {new_tokens} tokens; "
                    f"see {self.log}"
                )
        finally:
            del self.queues[request_id]

    async def close(self) -> None:
        """Ask the peer to exit; kill it if it does not."""
        if self.proc is None:
            return
        if self.proc.returncode is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(b'{"exit": true}\n')
                await self.proc.stdin.drain()
                self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 60)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            await self._reader


def _heads(config: dict[str, Any]) -> tuple[int, int, int]:
    """Return the query heads, KV heads and head size of a Llama-style config."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return heads, kv_heads, int(config.get("head_dim") or int(config["hidden_size"]) // heads)


def kv_cache_bytes(
    config: dict[str, Any], element_size: int, concurrency: int, context: float
) -> float:
    """Return the bytes of cached keys and values a decode step of `concurrency` sequences at
    `context` tokens reads: every layer's keys and values of every sequence, once (attention's
    part of `decode_step_cost`'s bytes)."""
    _, kv_heads, head_dim = _heads(config)
    layers = int(config["num_hidden_layers"])
    return concurrency * context * layers * 2 * kv_heads * head_dim * element_size


def decode_step_cost(
    config: dict[str, Any], element_size: int, concurrency: int, context: float
) -> tuple[float, float]:
    """Return the bytes a decode step of `concurrency` sequences must read and its FLOPs.

    Bytes: every weight the step multiplies (layers, norms, head) once, the embedding rows
    of its tokens, and each sequence's cached keys and values at `context` tokens
    (`kv_cache_bytes`).
    """
    hidden, inner = int(config["hidden_size"]), int(config["intermediate_size"])
    layers, vocab = int(config["num_hidden_layers"]), int(config["vocab_size"])
    heads, kv_heads, head_dim = _heads(config)
    products = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inner  # per layer
    weights = layers * (products + 2 * hidden) + hidden + vocab * hidden + concurrency * hidden
    flops = (
        2 * concurrency * (layers * products + vocab * hidden)
        + 4 * concurrency * context * heads * head_dim * layers
    )
    kv = kv_cache_bytes(config, element_size, concurrency, context)
    return weights * element_size + kv, flops


def add_floors(row: dict[str, Any], bandwidth_bytes_per_s: float) -> None:
    """Add a point's bandwidth floor, its roofline floor (the larger of that and the arithmetic
    floor: a step can go no faster than either allows) and mstar's TPOT as a % of each; with
    the row's `kv_bytes`, attention's part of the bandwidth floor (`kv_floor_ms`) and its
    share of the step's bytes (`kv_share_pct`); with its `decode_step_ms` (the engine's
    decode-only steps) and `decode_step_bytes`, the floor as a % of those steps
    (`decode_floor_pct`)."""
    row["bandwidth_bytes_per_s"] = bandwidth_bytes_per_s
    row["floor_ms"] = row["step_bytes"] / bandwidth_bytes_per_s * 1e3
    row["floor_pct"] = 100 * row["floor_ms"] / row["mstar_tpot_ms"]
    row["roofline_ms"] = max(row["floor_ms"], row["flop_ms"])
    row["roofline_pct"] = 100 * row["roofline_ms"] / row["mstar_tpot_ms"]
    if "kv_bytes" in row:  # attention's part: its keys and values over the same bandwidth
        row["kv_floor_ms"] = row["kv_bytes"] / bandwidth_bytes_per_s * 1e3
        row["kv_share_pct"] = 100 * row["kv_bytes"] / row["step_bytes"]
    if "decode_step_ms" in row:  # the engine's decode-only steps at the point's concurrency
        floor_ms = row["decode_step_bytes"] / bandwidth_bytes_per_s * 1e3
        row["decode_floor_pct"] = 100 * floor_ms / row["decode_step_ms"]
