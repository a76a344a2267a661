"""Benchmark Qwen3-Omni's spoken answers: mstar's streaming graph against a stage pipeline and
transformers.

    python scripts/bench_qwen3_omni.py                  # qwen3-omni-small, c = 1, 4, 16, both
    shapes
    python scripts/bench_qwen3_omni.py --shapes short   # the short shape only
    python scripts/bench_qwen3_omni.py --quick          # c = 1, 4; the short shape
    python scripts/bench_qwen3_omni.py --concurrency 1 --max-tokens 8 --max-frames 12 --transformers

Closed loop at each concurrency c (5 x c measured requests per point, 2 x c and at least 3
for answers over 300 frames, or ``--num-requests``; ``--warmup`` unmeasured ones per target).
Every target answers the same prompts with the same random ``qwen3-omni-small`` weights: the
thinker greedy to the shape's ``max_tokens`` (random weights rarely reach end of turn), the
talker sampled (temperature 0.9, top-k 50, repetition penalty 1.05, a per-request seed) to
codec EOS or the shape's ``max_frames``. Shapes (`SHAPES`): ``reference``, the M* reference's
256 answer tokens spoken at 3.75 frames a token (960 frames, 76.8 s of audio), ``short``
(32 tokens, 120 frames), and, with ``--shapes mixed``, answers of a quarter to all of
``reference``'s length by request (a stage's batch waits for its longest answer). Targets:

- ``mstar``: `AsyncEngine` serving `Qwen3OmniModel` in this process, default placement
  (Thinker, Talker, Code2Wav on ranks 0, 1, 2, each stepping on its own thread): each answer
  token streams to the talker, each 25 frames to Code2Wav, and every step batches all users.
- ``stage`` (`mstar.baselines.qwen3_omni_serving.StagePipeline`): what a stage DAG without
  streaming does, on mstar's own kernels and batching, with the same three step threads: each
  stage takes the requests waiting for it when it is free and runs them to its end, the
  thinker (its nodes on one `KVCacheEngine`, every step batched), then the talker (batched
  steps, one code-predictor batch per step), then Code2Wav (transformers' ``chunked_decode``,
  300-frame chunks, 25 of context); stages overlap across batches. Its text and audio arrive
  when their stage ends.
- ``transformers`` (``--transformers``, `TransformersQwen3Omni` there):
  ``Qwen3OmniMoeForConditionalGeneration.generate`` one request at a time (all codes, then
  Code2Wav), its output when it returns.

Reported per shape, c and target: TTFT, TTFA p50 / p95, RTF p50 / p95 (client E2E latency /
audio duration), audio seconds per second, streaming viability; the ratios stage / mstar of
TTFA p50 and RTF p50 and mstar / stage of audio s/s, with the targets (TTFA p50 >= 5x at every
c; at c = 16 RTF p50 >= 2.9x and audio s/s >= 1.5x); and where the CPU goes: each component's
thread CPU time (thinker, talker, Code2Wav, the event loop) per audio second made, and how
many cores the target kept busy. Writes a JSON and a PNG per shape into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mstar.baselines.qwen3_omni_serving import StagePipeline, TransformersQwen3Omni
from mstar.bench import (
    BenchRequest,
    BenchResult,
    ClosedLoop,
    OutputEvent,
    add_device_argument,
    json_safe,
    make_requests,
    plot_png,
    print_table,
    rank_devices,
    result_to_dict,
    run_benchmark,
)
from mstar.bench.cpu import CpuAccount
from mstar.runtime import AsyncEngine, EngineConfig, Request
from mstar.zoo.qwen3_omni.config import SAMPLE_RATE
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


SHAPES = {"reference": (256, 960), "short": (32, 120), "mixed": (256, 960)}
"""Answer shapes (answer tokens, most codec frames). ``reference``: the M* reference's thinker
budget of 256 tokens, spoken at 3.75 frames a token (12.5 frames/s at 3.3 tokens/s of speech);
``short``: a quick shape whose first audio comes well before the answer ends; ``mixed``
(opt-in): answers of 1/4, 2/4, 3/4 or all of ``reference``'s length, by request."""
DEFAULT_SHAPES = ("reference", "short")
VARIED = frozenset({"mixed"})


@dataclass(frozen=True)
class Settings:
    """One run's configuration (printed first, recorded in the JSON); ``max_tokens`` and
    ``max_frames`` are the shape being run."""

    config: str = "qwen3-omni-small"
    concurrency: tuple[int, ...] = (1, 4, 16)
    shapes: tuple[tuple[str, int, int], ...] = tuple((k, *SHAPES[k]) for k in DEFAULT_SHAPES)
    max_tokens: int = SHAPES["reference"][0]
    max_frames: int = SHAPES["reference"][1]
    varied: bool = False  # the shape being run varies its answers' lengths by request
    num_requests: int | None = None
    warmup: int = 1
    threads: int = 1
    device: str = "cpu"
    transformers: bool = False
    seed: int = 0
    out: str = "results/qwen3_omni"

    def requests_at(self, c: int) -> int:
        """Measured requests at concurrency ``c``: ``--num-requests``, else 5 x c, or 2 x c (at
        least 3) for answers over 300 frames."""
        if self.num_requests is not None:
            return self.num_requests
        return max(3, 2 * c) if self.max_frames > 300 else 5 * c


@dataclass(frozen=True)
class Loop(ClosedLoop):
    """`ClosedLoop` with exactly ``num_requests`` measured requests (long answers take fewer per
    point)."""

    def requests_at(self, point: float) -> int:
        return self.num_requests or super().requests_at(point)


# --- where the CPU goes ---------------------------------------------------------------------

COMPONENTS = {
    "mstar": (("mstar-rank0", "thinker"), ("mstar-rank1", "talker"), ("mstar-rank2", "code2wav")),
    "stage": (
        ("stage-thinker", "thinker"),
        ("stage-talker", "talker"),
        ("stage-codec", "code2wav"),
    ),
    "transformers": (("hf", "generate"),),
}
"""Thread-name prefix -> component, per target (mstar's default placement: Thinker, Talker and
Code2Wav step on ranks 0, 1 and 2). The main thread (the event loop: mstar's conductor and
walks, the stage pipeline's hand-offs, the load generator) is ``loop``; any other thread
(prompt preprocessing, ...) is ``other``."""


Answer = Callable[[str, Mapping[str, Any]], AsyncIterator[OutputEvent]]
"""A baseline's answer to one request: (request id, request data) -> its output events."""


def _text() -> OutputEvent:
    return OutputEvent("text", num_tokens=1)


def _audio(num_samples: int) -> OutputEvent:
    return OutputEvent("audio", num_samples=num_samples, sample_rate=SAMPLE_RATE)


def request_data(settings: Settings, request: BenchRequest) -> dict[str, Any]:
    """Return the request every target answers (a per-request talker seed; a varied shape's length
    by request)."""
    seed = int(request.request_id.rsplit("-", 1)[-1]) if request.request_id[-1].isdigit() else 0
    quarters = 1 + seed % 4 if settings.varied else 4
    return {
        "text": request.prompt,
        "temperature": 0.0,
        "max_tokens": max(1, settings.max_tokens * quarters // 4),
        "max_audio_frames": max(1, settings.max_frames * quarters // 4),
        "seed": seed,
    }


def answers(
    settings: Settings, stream: Answer
) -> Callable[[BenchRequest], AsyncIterator[OutputEvent]]:
    """Return the harness target asking a baseline's ``stream`` for each request's answer."""

    def target(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        return stream(request.request_id, request_data(settings, request))

    return target


# --- the run -------------------------------------------------------------------------------------


async def run(settings: Settings, console: Console) -> dict[str, Any]:
    """Run every shape and point, print the tables, write JSON and PNGs."""
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
    stage = StagePipeline(Qwen3OmniModel(settings.config, colocated=True), settings.threads)
    reference = TransformersQwen3Omni(model, settings.threads) if settings.transformers else None
    config = {
        "settings": dataclasses.asdict(settings),
        "model": f"{settings.config} (random weights): thinker {model.config.thinker_text}, "
        f"talker {model.config.talker_text}",
        "mstar": "AsyncEngine in process, default placement (Thinker rank 0, Talker rank 1, "
        "Code2Wav rank 2, "
        "each stepping on a thread of its own); streams FixedChunkPolicy(1) and "
        "LeftContextChunkPolicy(25, 25)",
        "stage": "thinker, talker and Code2Wav stages on a thread each, overlapping across "
        "batches; each takes "
        "the requests waiting for it: the thinker to the end, then the talker, then "
        "chunked_decode (300/25)",
        "transformers": "Qwen3OmniMoeForConditionalGeneration.generate one at a time"
        if reference
        else "skipped (--transformers)",
        "rtf": "client E2E latency / audio duration",
        "cpu": "thread CPU time per component while a target has requests in flight, per "
        "audio second made",
        "torch": f"{torch.__version__}, {settings.threads} threads per step thread; "
        f"{_cores()} cores",
    }
    console.print("[bold]bench_qwen3_omni[/bold]: configuration")
    for key, value in config.items():
        console.print(f"  {key}: {value}", highlight=False, markup=False)
    engine = await AsyncEngine.start(
        model,
        None,
        EngineConfig(cpu_threads=settings.threads, devices=rank_devices(settings.device)),
    )
    stage.start()
    account = CpuAccount(COMPONENTS, SAMPLE_RATE)
    shapes: dict[str, Any] = {}
    try:
        for name, max_tokens, max_frames in settings.shapes:
            shaped = dataclasses.replace(
                settings, max_tokens=max_tokens, max_frames=max_frames, varied=name in VARIED
            )
            console.print(
                f"shape {name}: max_tokens {max_tokens}, max_frames {max_frames}",
                highlight=False,
                markup=False,
            )
            shapes[name] = await _run_shape(
                shaped, name, engine, stage, reference, account, config, console
            )
    finally:
        await engine.shutdown()
        stage.close()
        if reference is not None:
            reference.close()
    return {
        "settings": json_safe(dataclasses.asdict(settings)),
        "config": config,
        "shapes": shapes,
    }


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


async def _run_shape(
    settings: Settings,
    name: str,
    engine: AsyncEngine,
    stage: StagePipeline,
    reference: TransformersQwen3Omni | None,
    account: CpuAccount,
    config: Mapping[str, Any],
    console: Console,
) -> dict[str, Any]:
    async def mstar_target(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        async for out in engine.generate(Request("generate", request_data(settings, request))):
            if out.modality == "text":
                yield _text()
            elif out.modality == "audio" and out.data.numel():
                yield _audio(int(out.data.numel()))

    targets: dict[str, Any] = {
        "mstar": account.wrap("mstar", mstar_target),
        "stage": account.wrap("stage", answers(settings, stage.stream)),
    }
    if reference is not None:
        targets["transformers"] = account.wrap("transformers", answers(settings, reference.stream))
    templates = make_requests(list(PROMPTS), max_tokens=settings.max_tokens)
    results: list[BenchResult] = []
    cpu: dict[str, Any] = {}
    stage.timings.clear()
    for c in settings.concurrency:
        started = time.perf_counter()
        load = Loop((c,), num_requests=settings.requests_at(c), warmup=settings.warmup)
        result = await run_benchmark(
            targets,
            templates,
            load,
            name=f"bench_qwen3_omni ({name})",
            seed=settings.seed * 1000 + c,
            progress=False,
            console=Console(quiet=True),
        )
        results.append(result)
        cpu[str(c)] = account.take()
        for p in result.points:
            errors = sorted({r.error for r in p.records if r.error})
            if errors:
                console.print(f"  {p.target} errors: {errors[:3]}", highlight=False, markup=False)
        console.print(
            f"{name} c={c}: {load.requests_at(c)} requests per target, point took "
            f"{time.perf_counter() - started:.0f} s",
            highlight=False,
            markup=False,
        )
    first = results[0]
    merged = dataclasses.replace(
        first,
        config={
            **first.config,
            **config,
            "shape": {
                "name": name,
                "max_tokens": settings.max_tokens,
                "max_frames": settings.max_frames,
            },
            "load": {"pattern": "closed_loop", "points": [r.load_points[0] for r in results]},
        },
        points=tuple(p for r in results for p in r.points),
    )
    print_table(merged, console)
    rows = _summary(merged, name, console)
    _cpu_table(cpu, name, console)
    verdicts = _verdicts(rows, console)
    stage_time = [{"stage": st, "batch": b, "wall_s": w} for st, b, w in stage.timings]
    data = result_to_dict(merged)
    data["qwen3_omni"] = json_safe(
        {
            "settings": dataclasses.asdict(settings),
            "summary": rows,
            "cpu_ms_per_audio_s": cpu,
            "verdicts": verdicts,
            "stage_batches": stage_time,
        }
    )
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"bench_qwen3_omni_{name}.json"
    json_path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    png_path = plot_png(merged, out / f"bench_qwen3_omni_{name}.png")
    console.print(f"wrote {json_path} and {png_path}", highlight=False, markup=False)
    return data


def _cpu_table(
    cpu: Mapping[str, Mapping[str, Mapping[str, float]]], name: str, console: Console
) -> None:
    components = sorted(
        {k for per in cpu.values() for row in per.values() for k in row} - {"total", "cores_busy"}
    )
    table = Table(title=f"Qwen3-Omni ({name}): ms of CPU per audio second, per component")
    for header in ["c", "target", *components, "total", "cores busy"]:
        table.add_column(header, justify="left" if header == "target" else "right")
    for c, per in cpu.items():
        for target, row in per.items():
            table.add_row(
                c,
                target,
                *(
                    f"{row[k]:.1f}" if k in row and not math.isnan(row[k]) else "-"
                    for k in components
                ),
                f"{row['total']:.1f}",
                f"{row['cores_busy']:.2f}",
            )
        table.add_section()
    console.print(table)


def _stat(value: Any, field: str) -> float:
    return math.nan if value is None else float(getattr(value, field))


def _ratio(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) or not b else a / b


def _summary(result: BenchResult, name: str, console: Console) -> dict[str, dict[str, Any]]:
    table = Table(
        title=f"Qwen3-Omni ({name}) per concurrency (RTF = client E2E latency / audio duration)"
    )
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
                "num_requests": s.num_requests,
                "num_failed": s.num_failed,
                "ttft_p50_s": _stat(s.ttft_s, "p50"),
                "ttfa_p50_s": _stat(s.ttfa_s, "p50"),
                "ttfa_p95_s": _stat(s.ttfa_s, "p95"),
                "rtf_p50": _stat(s.rtf, "p50"),
                "rtf_p95": _stat(s.rtf, "p95"),
                "audio_s_per_s": s.audio_s_per_s,
                "viable": math.nan if s.viable_fraction is None else s.viable_fraction,
            }
            table.add_row(
                str(c),
                target,
                f"{s.num_requests - s.num_failed}/{s.num_requests}",
                *(
                    f"{1e3 * r[k]:.0f}" if not math.isnan(r[k]) else "-"
                    for k in ("ttft_p50_s", "ttfa_p50_s", "ttfa_p95_s")
                ),
                *(f"{r[k]:.3f}" if not math.isnan(r[k]) else "-" for k in ("rtf_p50", "rtf_p95")),
                f"{r['audio_s_per_s']:.2f}",
                "-" if math.isnan(r["viable"]) else f"{100 * r['viable']:.0f}",
            )
        table.add_section()
        m, st = row["mstar"], row["stage"]
        row["ttfa_p50_ratio"] = _ratio(st["ttfa_p50_s"], m["ttfa_p50_s"])
        row["rtf_p50_ratio"] = _ratio(st["rtf_p50"], m["rtf_p50"])
        row["audio_s_per_s_ratio"] = _ratio(m["audio_s_per_s"], st["audio_s_per_s"])
        rows[str(c)] = row
    console.print(table)
    for c, row in rows.items():
        console.print(
            f"  c={c} stage / mstar: TTFA p50 {row['ttfa_p50_ratio']:.2f}x, RTF p50 "
            f"{row['rtf_p50_ratio']:.2f}x; "
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
        "--shapes",
        default=None,
        help=f"comma-separated answer shapes of {sorted(SHAPES)} (default reference,short; "
        "--quick short)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="answer tokens: one custom shape instead"
    )
    p.add_argument(
        "--max-frames", type=int, default=None, help="most codec frames per answer (custom shape)"
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="measured requests per point (default 5 x c; 2 x c, at least 3, over 300 frames)",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads (every step thread)")
    add_device_argument(p)
    p.add_argument("--transformers", action="store_true", help="add transformers' generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/qwen3_omni")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    concurrency = args.concurrency or ("1,4" if args.quick else "1,4,16")
    try:
        levels = tuple(int(c) for c in concurrency.split(","))
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {concurrency!r}")
    if not levels or min(levels) < 1:
        p.error("--concurrency values must be >= 1")
    if args.max_tokens is not None or args.max_frames is not None:
        if args.shapes is not None:
            p.error("give --shapes or --max-tokens / --max-frames, not both")
        base = SHAPES["short" if args.quick else "reference"]
        shapes = (
            (
                "custom",
                base[0] if args.max_tokens is None else args.max_tokens,
                base[1] if args.max_frames is None else args.max_frames,
            ),
        )
    else:
        names = (args.shapes or ("short" if args.quick else ",".join(DEFAULT_SHAPES))).split(",")
        unknown = [n for n in names if n not in SHAPES]
        if unknown or not names:
            p.error(f"--shapes must name shapes of {sorted(SHAPES)}, got {args.shapes!r}")
        shapes = tuple((n, *SHAPES[n]) for n in names)
    for flag, value in (
        ("--max-tokens", min(s[1] for s in shapes)),
        ("--max-frames", min(s[2] for s in shapes)),
        ("--threads", args.threads),
        ("--num-requests", args.num_requests or 1),
    ):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return Settings(
        config=args.config,
        concurrency=levels,
        shapes=shapes,
        max_tokens=shapes[0][1],
        max_frames=shapes[0][2],
        num_requests=args.num_requests,
        warmup=args.warmup,
        threads=args.threads,
        device=args.device,
        transformers=args.transformers,
        seed=args.seed,
        out=args.out,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark from the command line; return what it wrote to JSON (per shape)."""
    settings = parse_args(argv)
    start = time.perf_counter()
    data = asyncio.run(run(settings, Console(width=160)))
    print(f"total {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return data


if __name__ == "__main__":
    result = main()
    failed = sum(
        int(r["summary"]["num_failed"])
        for shape in result["shapes"].values()
        for r in shape["results"]
    )
    sys.exit(0 if failed == 0 else 1)
