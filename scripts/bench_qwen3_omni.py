"""Benchmark Qwen3-Omni's spoken answers: mstar's streaming graph against a stage pipeline and transformers.

    python scripts/bench_qwen3_omni.py                  # qwen3-omni-small, c = 1, 4, 16
    python scripts/bench_qwen3_omni.py --quick          # c = 1, 4; shorter answers
    python scripts/bench_qwen3_omni.py --concurrency 1 --max-tokens 8 --max-frames 12 --no-transformers

Closed loop at each concurrency c (at least 5 x c measured requests per point, ``--warmup``
unmeasured ones per target). Every target answers the same prompts with the same random
``qwen3-omni-small`` weights: the thinker greedy to ``--max-tokens`` (random weights rarely
reach end of turn), the talker sampled (temperature 0.9, top-k 50, repetition penalty 1.05, a
per-request seed) to codec EOS or ``--max-frames``. Targets:

- ``mstar``: `AsyncEngine` serving `Qwen3OmniModel` in this process, default placement
  (Thinker, Talker, Code2Wav on ranks 0, 1, 2, each stepping on its own thread): each answer
  token streams to the talker, each 25 frames to Code2Wav, and every step batches all users.
- ``stage``: what a stage DAG without streaming does, on mstar's own kernels and batching:
  the requests waiting when it is free form a batch; the thinker runs the whole batch to the
  end (its nodes on one `KVCacheEngine`, every step batched), then the talker the whole batch
  (batched steps, one code-predictor batch per step), then Code2Wav each request's codes
  (transformers' ``chunked_decode``, 300-frame chunks, 25 of context). Its text and audio
  arrive when their stage ends.
- ``transformers``: ``Qwen3OmniMoeForConditionalGeneration.generate`` one request at a time
  (all codes, then Code2Wav), its output when it returns (``--no-transformers`` skips it).

Reported per c and target: TTFT, TTFA p50 / p95, RTF p50 / p95 (client E2E latency / audio
duration), audio seconds per second, streaming viability; the ratios stage / mstar of TTFA p50
and RTF p50 and mstar / stage of audio s/s, with the targets (TTFA p50 >= 5x at every c; at
c = 16 RTF p50 >= 2.9x and audio s/s >= 1.5x). Writes JSON and a PNG into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mstar.bench import (
    BenchRequest,
    BenchResult,
    ClosedLoop,
    OutputEvent,
    make_requests,
    plot_png,
    print_table,
    result_to_dict,
    run_benchmark,
)
from mstar.engines.kv_engine import KVCacheEngine
from mstar.engines.kv_node import FiringRows
from mstar.runtime import AsyncEngine, EngineConfig, Request
from mstar.streaming import Chunk
from mstar.zoo.qwen3_omni.model import Qwen3OmniModel

PROMPTS = (
    "Tell me about the weather today.",
    "What is a good name for a cat?",
    "Explain how rainbows form.",
    "Give me a short poem about the sea.",
    "What should I cook for dinner?",
    "How far away is the moon?",
)
TARGETS = {"ttfa_p50_ratio": 5.0, "rtf_p50_ratio_c16": 2.9, "audio_s_per_s_ratio_c16": 1.5}


@dataclass(frozen=True)
class Settings:
    """One run's configuration (printed first, recorded in the JSON)."""

    config: str = "qwen3-omni-small"
    concurrency: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 48
    max_frames: int = 100
    num_requests: int | None = None
    warmup: int = 1
    threads: int = 1
    transformers: bool = True
    seed: int = 0
    out: str = "results/qwen3_omni"


def _text() -> OutputEvent:
    return OutputEvent("text", num_tokens=1)


def _audio(num_samples: int) -> OutputEvent:
    return OutputEvent("audio", num_samples=num_samples, sample_rate=24_000)


def request_data(settings: Settings, request: BenchRequest) -> dict[str, Any]:
    """Return the request every target answers (a per-request talker seed)."""
    seed = int(request.request_id.rsplit("-", 1)[-1]) if request.request_id[-1].isdigit() else 0
    return {
        "text": request.prompt,
        "temperature": 0.0,
        "max_tokens": settings.max_tokens,
        "max_audio_frames": settings.max_frames,
        "seed": seed,
    }


# --- the stage pipeline ------------------------------------------------------------------------


class StagePipeline:
    """Thinker, then talker, then Code2Wav, each over the whole batch, nothing streamed between them."""

    def __init__(self, model: Qwen3OmniModel, settings: Settings) -> None:
        self.model, self.settings = model, settings
        device = torch.device("cpu")
        self.thinker = model.submodule("thinker", device)
        self.talker = model.submodule("talker", device)
        self.weights = model.load_weights(device)
        # One engine per stage for the whole run (its cache is allocated once, as mstar's is).
        self.thinker_engine = KVCacheEngine(self.thinker.model, self.thinker.engine_config)
        self.talker_engine = KVCacheEngine(self.talker.model, self.talker.engine_config)
        self.executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="stage",
            initializer=functools.partial(torch.set_num_threads, settings.threads),
        )
        self.queue: list[tuple[str, dict[str, Any], asyncio.Future[Any], asyncio.Future[Any]]] = []
        self.wakeup = asyncio.Event()
        self.timings: list[
            tuple[int, float, float, float]
        ] = []  # batch size, thinker s, talker s, codec s
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def stream(self, settings: Settings, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        loop = asyncio.get_running_loop()
        text, audio = loop.create_future(), loop.create_future()
        self.queue.append((request.request_id, request_data(settings, request), text, audio))
        self.wakeup.set()
        for _ in range(len(await text)):
            yield _text()
        samples = await audio
        if samples:
            yield _audio(samples)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            for _ in range(8):  # let the requests arriving together join the batch
                await asyncio.sleep(0)
            batch, self.queue = self.queue, []
            if not batch:
                continue
            try:
                await loop.run_in_executor(self.executor, self._run_batch, loop, batch)
            except Exception as exc:
                for _, _, text, audio in batch:
                    for f in (text, audio):
                        if not f.done():
                            loop.call_soon_threadsafe(f.set_exception, exc)
            if self.queue:
                self.wakeup.set()

    def _fire(
        self, node: Any, engine: KVCacheEngine, work: dict[str, Mapping[str, Any]]
    ) -> dict[str, Mapping[str, Any]]:
        """Fire ``node`` once for every request of ``work`` in shared engine steps; return each one's outputs."""
        firings: dict[str, list[torch.Tensor | None]] = {}
        for rid, inputs in work.items():
            rows: list[torch.Tensor | None] = []
            for chunk in node.forward(rid, inputs).chunks:
                args = {
                    "payload": chunk.payload,
                    "num_tokens": chunk.num_tokens,
                    "output_mode": chunk.output,
                }
                if engine.has_request(rid):
                    engine.resume(rid, chunk.token_ids or [], **args)
                else:
                    engine.add_request(rid, chunk.token_ids or [], keep_alive=True, **args)
                rows.append(None)
            firings[rid] = rows
        while engine.has_unfinished():
            for out in engine.step():
                if out.hidden is not None:
                    firings[out.request_id][-1] = out.hidden
        done = node.forward_outputs(
            [FiringRows(rid, work[rid], rows) for rid, rows in firings.items()]
        )
        for result in done:
            if isinstance(result, BaseException):
                raise result
        return dict(zip(firings, done, strict=True))

    @torch.inference_mode()
    def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[Any]) -> None:
        model = self.model
        start = time.perf_counter()
        inputs: dict[str, dict[str, Any]] = {}
        talker_params: dict[str, Any] = {}
        for rid, data, _, _ in batch:
            prepared = model.preprocess(Request("generate", data, rid))
            inputs[rid] = dict(prepared.inputs["thinker"])
            talker_params[rid] = prepared.inputs["talker"]["talker_params"]
        texts: dict[str, list[int]] = {rid: [] for rid in inputs}
        items: dict[str, list[Any]] = {rid: [] for rid in inputs}
        thinker_engine = self.thinker_engine
        active = dict(inputs)
        while active:  # the thinker to the end of every answer
            outs = self._fire(self.thinker, thinker_engine, active)
            for rid, out in outs.items():
                if "text" in out:
                    texts[rid].append(int(out["text"]))
                if "thinker_states" in out:
                    items[rid].append(out["thinker_states"])
                for key in ("cursor", "last"):
                    if key in out:
                        inputs[rid][key] = out[key]
                if out.get("stop") and int(inputs[rid]["cursor"]) >= len(inputs[rid]["segments"]):
                    active.pop(rid)
        for rid in inputs:
            self.thinker.release(rid)
            thinker_engine.abort(rid)
        thought = time.perf_counter()
        for rid, _, text, _ in batch:
            loop.call_soon_threadsafe(text.set_result, texts[rid])
        talker_engine = self.talker_engine
        frames: dict[str, list[torch.Tensor]] = {rid: [] for rid in inputs}
        work = {
            rid: {
                "thinker_states": Chunk(tuple(items[rid]), 0, 0, True),
                "talker_params": talker_params[rid],
            }
            for rid in inputs
        }
        while work:  # the talker over all of each answer's text
            outs = self._fire(self.talker, talker_engine, work)
            for rid, out in outs.items():
                if "codes" in out:
                    frames[rid].append(out["codes"])
                if out.get("stop"):
                    work.pop(rid)
        for rid in inputs:
            self.talker.release(rid)
            talker_engine.abort(rid)
        spoken = time.perf_counter()
        code2wav = self.weights.code2wav
        for rid, _, _, audio in batch:
            samples = 0
            if frames[rid]:
                codes = torch.stack(frames[rid], dim=1)[None]
                samples = int(
                    code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25).numel()
                )
            loop.call_soon_threadsafe(audio.set_result, samples)
        self.timings.append(
            (len(batch), thought - start, spoken - thought, time.perf_counter() - spoken)
        )

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.executor.shutdown()


class TransformersTarget:
    """transformers' own ``generate``, one request at a time: all codes, then Code2Wav."""

    def __init__(self, model: Qwen3OmniModel, settings: Settings) -> None:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeForConditionalGeneration,
        )
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model, self.settings = model, settings
        self.reference = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            model.checkpoint, dtype=torch.float32
        ).eval()
        self.executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="hf",
            initializer=functools.partial(torch.set_num_threads, settings.threads),
        )
        self.lock = asyncio.Lock()

    def _generate(self, data: dict[str, Any]) -> tuple[int, int]:
        ids, _ = self.model._prompt(data)
        torch.manual_seed(int(data["seed"]))
        with torch.inference_mode():
            sequences, wav = self.reference.generate(
                input_ids=torch.tensor([ids]), thinker_max_new_tokens=data["max_tokens"], thinker_do_sample=False,
                thinker_eos_token_id=self.model.eos_token_ids[0], talker_max_new_tokens=data["max_audio_frames"],
                talker_do_sample=True,
            )  # fmt: skip
        return int(sequences.shape[-1]) - len(ids), 0 if wav is None else int(wav.numel())

    async def stream(self, settings: Settings, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        async with self.lock:
            loop = asyncio.get_running_loop()
            num_tokens, samples = await loop.run_in_executor(
                self.executor, self._generate, request_data(settings, request)
            )
        for _ in range(num_tokens):
            yield _text()
        if samples:
            yield _audio(samples)

    def close(self) -> None:
        self.executor.shutdown()


# --- the run -------------------------------------------------------------------------------------


async def run(settings: Settings, console: Console) -> dict[str, Any]:
    """Run every point, print the tables, write JSON and PNG."""
    before = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return await _run(settings, console)
    finally:
        torch.set_num_threads(before)


async def _run(settings: Settings, console: Console) -> dict[str, Any]:
    model = Qwen3OmniModel(
        settings.config, max_tokens=settings.max_tokens, max_audio_frames=settings.max_frames
    )
    stage = StagePipeline(Qwen3OmniModel(settings.config, colocated=True), settings)
    reference = TransformersTarget(model, settings) if settings.transformers else None
    config = {
        "settings": dataclasses.asdict(settings),
        "model": f"{settings.config} (random weights): thinker {model.config.thinker_text}, talker {model.config.talker_text}",
        "mstar": "AsyncEngine in process, default placement (Thinker rank 0, Talker rank 1, Code2Wav rank 2); "
        "streams FixedChunkPolicy(1) and LeftContextChunkPolicy(25, 25)",
        "stage": "batch of waiting requests: thinker to the end, then talker, then Code2Wav chunked_decode (300/25)",
        "transformers": "Qwen3OmniMoeForConditionalGeneration.generate one at a time"
        if reference
        else "skipped",
        "rtf": "client E2E latency / audio duration",
        "torch": f"{torch.__version__}, {settings.threads} threads per target",
    }
    console.print("[bold]bench_qwen3_omni[/bold]: configuration")
    for key, value in config.items():
        console.print(f"  {key}: {value}", highlight=False, markup=False)
    engine = await AsyncEngine.start(model, None, EngineConfig(cpu_threads=settings.threads))
    stage.start()

    async def mstar_target(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        async for out in engine.generate(Request("generate", request_data(settings, request))):
            if out.modality == "text":
                yield _text()
            elif out.modality == "audio" and out.data.numel():
                yield _audio(int(out.data.numel()))

    targets: dict[str, Any] = {
        "mstar": mstar_target,
        "stage": functools.partial(stage.stream, settings),
    }
    if reference is not None:
        targets["transformers"] = functools.partial(reference.stream, settings)
    templates = make_requests(list(PROMPTS), max_tokens=settings.max_tokens)
    results: list[BenchResult] = []
    try:
        for c in settings.concurrency:
            started = time.perf_counter()
            result = await run_benchmark(
                targets, templates, ClosedLoop((c,), num_requests=settings.num_requests, warmup=settings.warmup),
                name="bench_qwen3_omni", seed=settings.seed * 1000 + c, progress=False, console=Console(quiet=True),
            )  # fmt: skip
            results.append(result)
            for p in result.points:
                errors = sorted({r.error for r in p.records if r.error})
                if errors:
                    console.print(
                        f"  {p.target} errors: {errors[:3]}", highlight=False, markup=False
                    )
            console.print(
                f"c={c}: point took {time.perf_counter() - started:.0f} s",
                highlight=False,
                markup=False,
            )
    finally:
        await engine.shutdown()
        stage.close()
        if reference is not None:
            reference.close()
    first = results[0]
    merged = dataclasses.replace(
        first,
        config={
            **first.config,
            **config,
            "load": {"pattern": "closed_loop", "points": [r.load_points[0] for r in results]},
        },
        points=tuple(p for r in results for p in r.points),
    )
    print_table(merged, console)
    rows = _summary(merged, console)
    verdicts = _verdicts(rows, console)
    stage_time = [
        {"batch": b, "thinker_s": t, "talker_s": k, "code2wav_s": w} for b, t, k, w in stage.timings
    ]
    data = result_to_dict(merged)
    data["qwen3_omni"] = _json_safe(
        {
            "settings": dataclasses.asdict(settings),
            "summary": rows,
            "verdicts": verdicts,
            "stage_batches": stage_time,
        }
    )
    from pathlib import Path

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench_qwen3_omni.json"
    json_path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    png_path = plot_png(merged, out / "bench_qwen3_omni.png")
    console.print(f"wrote {json_path} and {png_path}", highlight=False, markup=False)
    return data


def _stat(value: Any, field: str) -> float:
    return math.nan if value is None else float(getattr(value, field))


def _ratio(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) or not b else a / b


def _summary(result: BenchResult, console: Console) -> dict[str, dict[str, Any]]:
    table = Table(title="Qwen3-Omni per concurrency (RTF = client E2E latency / audio duration)")
    for header in [
        "c",
        "target",
        "ok",
        "TTFT p50 ms",
        "TTFA p50 ms",
        "TTFA p95 ms",
        "RTF p50",
        "RTF p95",
        "audio s/s",
        "viable %",
    ]:
        table.add_column(header, justify="left" if header == "target" else "right")
    rows: dict[str, dict[str, Any]] = {}
    for point in result.load_points:
        c = int(point)
        row: dict[str, Any] = {}
        for target in result.targets:
            s = result.result(target, point).summary
            r = row[target] = {
                "num_requests": s.num_requests, "num_failed": s.num_failed,
                "ttft_p50_s": _stat(s.ttft_s, "p50"), "ttfa_p50_s": _stat(s.ttfa_s, "p50"), "ttfa_p95_s": _stat(s.ttfa_s, "p95"),
                "rtf_p50": _stat(s.rtf, "p50"), "rtf_p95": _stat(s.rtf, "p95"), "audio_s_per_s": s.audio_s_per_s,
                "viable": math.nan if s.viable_fraction is None else s.viable_fraction,
            }  # fmt: skip
            table.add_row(
                str(c), target, f"{s.num_requests - s.num_failed}/{s.num_requests}",
                *(f"{1e3 * r[k]:.0f}" if not math.isnan(r[k]) else "-" for k in ("ttft_p50_s", "ttfa_p50_s", "ttfa_p95_s")),
                *(f"{r[k]:.3f}" if not math.isnan(r[k]) else "-" for k in ("rtf_p50", "rtf_p95")),
                f"{r['audio_s_per_s']:.2f}", "-" if math.isnan(r["viable"]) else f"{100 * r['viable']:.0f}",
            )  # fmt: skip
        table.add_section()
        m, st = row["mstar"], row["stage"]
        row["ttfa_p50_ratio"] = _ratio(st["ttfa_p50_s"], m["ttfa_p50_s"])
        row["rtf_p50_ratio"] = _ratio(st["rtf_p50"], m["rtf_p50"])
        row["audio_s_per_s_ratio"] = _ratio(m["audio_s_per_s"], st["audio_s_per_s"])
        rows[str(c)] = row
    console.print(table)
    for c, row in rows.items():
        console.print(
            f"  c={c} stage / mstar: TTFA p50 {row['ttfa_p50_ratio']:.2f}x, RTF p50 {row['rtf_p50_ratio']:.2f}x; "
            f"mstar / stage audio s/s {row['audio_s_per_s_ratio']:.2f}x",
            highlight=False, markup=False,
        )  # fmt: skip
    return rows


def _verdicts(rows: Mapping[str, Mapping[str, Any]], console: Console) -> dict[str, Any]:
    checks: dict[str, tuple[float, float]] = {
        f"ttfa_p50_ratio_c{c}": (row["ttfa_p50_ratio"], TARGETS["ttfa_p50_ratio"])
        for c, row in rows.items()
    }
    if "16" in rows:
        checks["rtf_p50_ratio_c16"] = (rows["16"]["rtf_p50_ratio"], TARGETS["rtf_p50_ratio_c16"])
        checks["audio_s_per_s_ratio_c16"] = (
            rows["16"]["audio_s_per_s_ratio"],
            TARGETS["audio_s_per_s_ratio_c16"],
        )
    verdicts = {}
    for name, (value, target) in checks.items():
        met = None if math.isnan(value) else bool(value >= target)
        status = "n/a " if met is None else ("PASS" if met else "MISS")
        console.print(
            f"target: {status} {name} >= {target:g}x: {value:.2f}x", highlight=False, markup=False
        )
        verdicts[name] = {"value": value, "target": target, "met": met}
    return verdicts


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """Parse the command line into `Settings` (explicit flags win over ``--quick``)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--config", default="qwen3-omni-small", choices=["qwen3-omni-tiny", "qwen3-omni-small"]
    )
    p.add_argument(
        "--concurrency", default=None, help="comma-separated (default 1,4,16; --quick 1,4)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="answer tokens (default 48; --quick 24)"
    )
    p.add_argument(
        "--max-frames",
        type=int,
        default=None,
        help="most codec frames per answer (default 100; --quick 50)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="measured requests per point (at least 5 x c)",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads (every target)")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/qwen3_omni")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    concurrency = args.concurrency or ("1,4" if args.quick else "1,4,16")
    try:
        levels = tuple(int(c) for c in concurrency.split(","))
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {concurrency!r}")
    max_tokens = args.max_tokens if args.max_tokens is not None else (24 if args.quick else 48)
    max_frames = args.max_frames if args.max_frames is not None else (50 if args.quick else 100)
    if not levels or min(levels) < 1:
        p.error("--concurrency values must be >= 1")
    for flag, value in (
        ("--max-tokens", max_tokens),
        ("--max-frames", max_frames),
        ("--threads", args.threads),
        ("--num-requests", args.num_requests or 1),
    ):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return Settings(
        config=args.config, concurrency=levels, max_tokens=max_tokens, max_frames=max_frames, num_requests=args.num_requests,
        warmup=args.warmup, threads=args.threads, transformers=not args.no_transformers, seed=args.seed, out=args.out,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark from the command line; return what it wrote to JSON."""
    settings = parse_args(argv)
    start = time.perf_counter()
    data = asyncio.run(run(settings, Console(width=160)))
    print(f"total {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return data


if __name__ == "__main__":
    result = main()
    sys.exit(0 if all(int(r["summary"]["num_failed"]) == 0 for r in result["results"]) else 1)
