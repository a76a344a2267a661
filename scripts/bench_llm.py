"""Benchmark LLM decode through mstar against transformers' `generate`, on the bench harness.

For each model and concurrency c, waves of c requests with random token prompts decode
`--new-tokens` greedy tokens each (end-of-sequence ignored, so both sides do equal work):

- `mstar`: the `llama` text model served by `AsyncEngine` (one rank, in process): prefill,
  then a `DynamicLoop` over the paged-KV node, continuous batching across requests.
- `transformers`: `LlamaForCausalLM.generate` on the same weights, the requests of a wave
  run as one batch (equal prompt lengths, so no padding), tokens streamed per step.

The harness (`mstar.bench`) times both identically on the client side and reports
throughput (output tokens/s), TTFT, TPOT, ITL and E2E (DESIGN §7), the ratios
mstar / transformers, a JSON file and a PNG per model. Peak memory added while a side
runs a point (CPU: peak RSS above the RSS before; CUDA: peak allocated above the
allocation before; weights excluded) is printed next to it.

Models: `tiny` (Llama, hidden 256, 4 layers, 8 heads / 4 KV heads, intermediate 512,
vocab 32000, fp32, random weights) and `smollm2` (SmolLM2-135M-Instruct, real weights).
Target (issue #4): at concurrency 16, at least 1.5x transformers' throughput.

    python scripts/bench_llm.py                      # the default sweep
    python scripts/bench_llm.py --models tiny --concurrency 1,16 --new-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mstar.bench import (
    BenchRequest,
    CallableTarget,
    OfflineWaves,
    OutputEvent,
    plot_png,
    print_table,
    run_benchmark,
    write_json,
)
from mstar.runtime import AsyncEngine, EngineConfig, Output, Request
from mstar.server.encoding import token_ids
from mstar.zoo.hf_checkpoint import save_state_dict
from mstar.zoo.llm import TextLLM

TARGET_RATIO = 1.5
TARGET_CONCURRENCY = 16

TINY_CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def make_tiny_checkpoint(directory: Path) -> Path:
    """Write a random-weight tiny Llama checkpoint (transformers' initialisation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY_CONFIG.items() if k != "model_type"})
    model = LlamaForCausalLM(config)
    save_state_dict(model.state_dict(), directory, config.to_dict())
    return directory


def checkpoint_for(name: str, scratch: Path) -> Path:
    """Return the checkpoint directory of a benchmark model."""
    if name == "tiny":
        return make_tiny_checkpoint(scratch / "tiny")
    if name == "smollm2":
        from mstar.zoo.smollm2 import smollm2_checkpoint_dir

        return smollm2_checkpoint_dir()
    raise SystemExit(f"unknown model {name!r} (choose tiny, smollm2)")


class PeakMemory:
    """Peak memory added while a side runs one load point, keyed by (side, point)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[tuple[str, str], float] = {}
        self._active: dict[str, int] = {}
        self._base: dict[str, int] = {}

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        return 0

    def start(self, side: str) -> None:
        """Note a request of `side` starting; the first of a burst resets the high-water mark."""
        if self._active.get(side, 0) == 0:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(self.device)
                self._base[side] = torch.cuda.memory_allocated(self.device)
            else:
                # Linux: "5" resets the VmHWM high-water mark of this process.
                with contextlib.suppress(OSError):
                    Path("/proc/self/clear_refs").write_text("5")
                self._base[side] = self._status("VmRSS:")
        self._active[side] = self._active.get(side, 0) + 1

    def stop(self, side: str, request_id: str) -> None:
        """Note a request of `side` ending; keep the largest peak of its point.

        The harness names requests `<kind>-<point>-<i>` (`warmup-<point>-<i>` for warm-up).
        """
        self._active[side] -= 1
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) - self._base[side]
        else:
            peak = self._status("VmHWM:") - self._base[side]
        key = (side, request_id.rsplit("-", 1)[0])
        self.peaks[key] = max(self.peaks.get(key, 0.0), peak / 2**20)


class _Streamer:
    """A transformers streamer that hands each step's tokens of a batch to its requests."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queues: list[asyncio.Queue[int | None]]) -> None:
        self.loop = loop
        self.queues = queues
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt itself
            self.prompt_seen = True
            return
        for queue, token in zip(self.queues, value.reshape(-1).tolist(), strict=True):
            self.loop.call_soon_threadsafe(queue.put_nowait, int(token))

    def end(self) -> None:
        for queue in self.queues:
            self.loop.call_soon_threadsafe(queue.put_nowait, None)


@dataclass
class _Waiting:
    prompt: list[int]
    new_tokens: int
    queue: asyncio.Queue[int | None]


class TransformersBatches:
    """transformers' `generate` as a service: requests waiting together run as one batch."""

    def __init__(self, hf: Any, device: torch.device) -> None:
        self.hf = hf
        self.device = device
        # The same torch threads as this thread (a new thread's OpenMP pool starts at every core).
        self.executor = ThreadPoolExecutor(
            1, thread_name_prefix="hf-generate", initializer=functools.partial(torch.set_num_threads, torch.get_num_threads())
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
                streamer = _Streamer(loop, [w.queue for w in batch])
                try:
                    await loop.run_in_executor(self.executor, self._run, batch, streamer)
                except Exception:
                    streamer.end()
                    raise
        finally:
            self.draining = False

    def _run(self, batch: list[_Waiting], streamer: _Streamer) -> None:
        if len({len(w.prompt) for w in batch}) != 1 or len({w.new_tokens for w in batch}) != 1:
            raise ValueError("a batch needs equal prompt lengths and output lengths")
        ids = torch.tensor([w.prompt for w in batch], device=self.device)
        n = batch[0].new_tokens
        with torch.inference_mode():
            self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0, streamer=streamer)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        streamer.end()


_ONE_TOKEN = (OutputEvent("text", num_tokens=1),)  # events are immutable: one serves every token


def _token_event(out: Any) -> Iterable[OutputEvent]:
    if isinstance(out, Output):
        if out.name != "tokens":
            return ()
        count = len(token_ids(out.data))
        return _ONE_TOKEN if count == 1 else (OutputEvent("text", num_tokens=count),)
    return _ONE_TOKEN


async def bench_model(name: str, args: argparse.Namespace, scratch: Path, console: Console) -> list[dict[str, Any]]:
    """Run the sweep of one model; return its rows for the summary table."""
    device = torch.device(args.device)
    checkpoint = checkpoint_for(name, scratch)
    small_cpu = device.type == "cpu" and not args.full and name == "smollm2"
    levels = args.smollm2_concurrency if small_cpu else args.concurrency
    new_tokens = args.smollm2_new_tokens if small_cpu else args.new_tokens
    block = 16
    per_seq_blocks = -(-(args.prompt_len + new_tokens) // block)
    kv = {
        "block_size": block, "num_blocks": max(levels) * per_seq_blocks + 8, "max_num_seqs": max(levels),
        "max_num_batched_tokens": max(2048, args.prompt_len), "attention_backend": args.backend,
        "cuda_graphs": not args.no_cuda_graphs,
    }
    model = TextLLM(checkpoint, name=name, engine_config=kv)
    engine = await AsyncEngine.start(model, config=EngineConfig(devices={0: str(device)}))
    from transformers import LlamaForCausalLM

    dtype = torch.float32 if device.type == "cpu" else None
    hf = LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=dtype or "auto").to(device).eval()
    baseline = TransformersBatches(hf, device)
    memory = PeakMemory(device)
    vocab = int(model.hf_config["vocab_size"])

    async def mstar_fn(request: BenchRequest) -> AsyncIterator[Output]:
        memory.start("mstar")
        try:
            data = {"prompt_token_ids": request.params["prompt_token_ids"],
                    "max_tokens": request.max_tokens, "ignore_eos": True, "temperature": 0.0}
            async for out in engine.generate(Request("generate", data)):
                yield out
        finally:
            memory.stop("mstar", request.request_id)

    async def hf_fn(request: BenchRequest) -> AsyncIterator[int]:
        memory.start("transformers")
        try:
            assert request.max_tokens is not None
            async for token in baseline.generate(request.params["prompt_token_ids"], request.max_tokens):
                yield token
        finally:
            memory.stop("transformers", request.request_id)

    targets = {"mstar": CallableTarget(mstar_fn, name="mstar", to_events=_token_event),
               "transformers": CallableTarget(hf_fn, name="transformers", to_events=_token_event)}
    gen = torch.Generator().manual_seed(1)
    requests = [
        BenchRequest(f"p{i}", "", new_tokens, True,
                     {"prompt_token_ids": torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()})
        # A large pool, so that waves rarely repeat a prompt (repeats would share KV blocks).
        for i in range(2048)
    ]
    config = {"model": name, "checkpoint": checkpoint.name, "device": str(device), "dtype": str(hf.dtype),
              "new_tokens": new_tokens, "prompt_len": args.prompt_len, "kv_cache": kv,
              "torch_threads": torch.get_num_threads(), "waves": args.waves}
    rows: list[dict[str, Any]] = []
    try:
        load = OfflineWaves(tuple(levels), num_waves=args.waves)
        result = await run_benchmark(targets, requests, load, name=f"bench_llm {name}",
                                     seed=0, progress=True, console=console, config=config)
        print_table(result, console)
        write_json(result, args.out / f"bench_llm_{name}.json")
        plot_png(result, args.out / f"bench_llm_{name}.png")
        for conc in levels:
            ours = result.result("mstar", float(conc)).summary
            theirs = result.result("transformers", float(conc)).summary
            key = f"{load.kind}-{conc}"
            rows.append({
                "model": name, "concurrency": conc, "new_tokens": new_tokens,
                "mstar_tokens_per_s": ours.output_tokens_per_s,
                "mstar_tpot_ms": ours.tpot_s.mean * 1e3 if ours.tpot_s else float("nan"),
                "mstar_ttft_ms": ours.ttft_s.p50 * 1e3 if ours.ttft_s else float("nan"),
                "mstar_peak_mib": memory.peaks.get(("mstar", key), float("nan")),
                "hf_tokens_per_s": theirs.output_tokens_per_s,
                "hf_tpot_ms": theirs.tpot_s.mean * 1e3 if theirs.tpot_s else float("nan"),
                "hf_ttft_ms": theirs.ttft_s.p50 * 1e3 if theirs.ttft_s else float("nan"),
                "hf_peak_mib": memory.peaks.get(("transformers", key), float("nan")),
                "ratio": ours.output_tokens_per_s / theirs.output_tokens_per_s,
                "failed": ours.num_failed + theirs.num_failed,
            })
    finally:
        await engine.shutdown()
        baseline.executor.shutdown()
    return rows


def report(rows: list[dict[str, Any]], console: Console) -> bool:
    """Print the summary table and the target check; return whether the target is met."""
    table = Table(title="LLM decode: mstar vs transformers generate (waves of c requests)")
    for col in ("model", "c", "new", "mstar tok/s", "TPOT ms", "TTFT ms", "+MiB",
                "hf tok/s", "TPOT ms", "TTFT ms", "+MiB", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], str(r["concurrency"]), str(r["new_tokens"]),
                      f"{r['mstar_tokens_per_s']:.1f}", f"{r['mstar_tpot_ms']:.2f}", f"{r['mstar_ttft_ms']:.1f}",
                      f"{r['mstar_peak_mib']:.0f}", f"{r['hf_tokens_per_s']:.1f}", f"{r['hf_tpot_ms']:.2f}",
                      f"{r['hf_ttft_ms']:.1f}", f"{r['hf_peak_mib']:.0f}", f"{r['ratio']:.2f}x")
    console.print(table)
    met = True
    for r in rows:
        if r["concurrency"] == TARGET_CONCURRENCY:
            ok = r["ratio"] >= TARGET_RATIO and r["failed"] == 0
            met = met and ok
            console.print(f"target {r['model']}: >= {TARGET_RATIO}x transformers' throughput at "
                          f"c={TARGET_CONCURRENCY} -> {r['ratio']:.2f}x: {'MET' if ok else 'NOT MET'}")
    return met


def _levels(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c]


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the sweep, print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--concurrency", type=_levels, default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    # SmolLM2 is ~30x the tiny model's compute: on a CPU its default sweep is cut so the
    # whole default run takes minutes; --full runs the complete sweep for both.
    parser.add_argument("--smollm2-concurrency", type=_levels, default=[1, 4, 16])
    parser.add_argument("--smollm2-new-tokens", type=int, default=64)
    parser.add_argument("--full", action="store_true", help="smollm2 uses --concurrency/--new-tokens")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--waves", type=int, default=2, help="measured waves per point")
    # One thread by default on CPU: on shared cores, multi-threaded GEMMs spin-wait on busy
    # siblings and slow down by an order of magnitude, which says nothing about the engines.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"])
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench-results/llm"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print("bench_llm", json.dumps({k: str(v) for k, v in vars(args).items()}))
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            rows += asyncio.run(bench_model(name, args, Path(scratch), console))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_llm_summary.json").write_text(json.dumps(rows, indent=1))
    met = report(rows, console)
    console.print(f"wrote {args.out}/ (harness JSON and PNG per model, bench_llm_summary.json); "
                  f"total {time.perf_counter() - start:.0f} s")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
