"""Benchmark Orpheus TTS served by mstar against a transformers baseline and the compute floor.

Closed loop at each concurrency c (default 1, 4, 16) on ``orpheus-small`` (Llama hidden 512,
8 layers, the real 156,940-id token scheme; SNAC at its real 24 kHz size; random weights).
Three systems do the same work, side by side in the same run, point after point:

* ``mstar``: `AsyncEngine` serving the Orpheus graph (LLM prefill/decode on the paged KV
  cache, 28/7 windows streamed into the batched SNAC codec).
* ``transformers``: what a user writes without mstar. One request at a time (an asyncio
  lock, as a naive server does); tokens from ``LlamaForCausalLM.generate`` running in a
  thread with a streamer, on the same weights, with the same constrained logits; each 28/7
  window decoded with the same `SnacCodec` as soon as its tokens arrive.
* ``floor`` (not a server): the same requests as pure batched `KVCacheEngine` steps (c at a
  time), then every window as pure codec calls. mstar's efficiency = floor time / mstar
  time for the same audio (= mstar audio s/s / floor audio s/s).

Equal work: every request produces exactly ``--max-tokens`` audio tokens (a multiple of 7):
all three mask end of speech (``ignore_eos``) on top of Orpheus' constrained decoding. The
baseline, the floor and the equal-work model are `mstar.baselines.orpheus`; the time
accounting is `mstar.bench.phases`.

Reported: TTFA, RTF (client E2E latency / audio duration) p50 and p95, streaming viability,
audio seconds per second, ratios against the baseline, and where the time goes: LLM steps
(and their forward passes) versus codec windows, timed inside each system (for mstar, the
engines' own step and phase timers, read with ``AsyncEngine.stats()`` before and after each
point's measured requests; the baseline and the floor time their own calls).

    python scripts/bench_orpheus.py                          # the full run (c = 1, 4, 16)
    python scripts/bench_orpheus.py --quick                  # c = 1, 4; short requests
    python scripts/bench_orpheus.py --config orpheus-tiny --concurrency 1,2 --max-tokens 35
    python scripts/bench_orpheus.py --deterministic --skip-baseline --skip-floor

With ``--deterministic`` a second engine serving deterministically
(``EngineConfig(deterministic=True)``) runs as ``mstar-det`` beside the default one, point
after point; the summary gives its audio seconds per second over the default's (target: at
least 0.8 at the largest concurrency).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mstar.baselines.orpheus import (
    FloorResult,
    OrpheusFloor,
    SpeechWork,
    TransformersOrpheus,
    audio_event,
    check_num_samples,
    request_seed,
)
from mstar.bench import (
    BenchRequest,
    BenchResult,
    ClosedLoop,
    OutputEvent,
    add_device_argument,
    draw_requests,
    json_safe,
    make_requests,
    merge_results,
    plot_png,
    print_table,
    rank_devices,
    result_to_dict,
    run_benchmark,
)
from mstar.bench.phases import (
    Meter,
    PhaseTracker,
    PointBreakdown,
    breakdown_table,
    engine_figures,
)
from mstar.runtime import AsyncEngine, EngineConfig, Placement, Request
from mstar.zoo.orpheus import FRAME_SIZE, SAMPLE_RATE
from mstar.zoo.orpheus.model import OrpheusModel

PROMPTS = (
    "Hey there, my name is Tara, and I'm a speech generation model that can sound like a person.",
    "The quick brown fox jumps over the lazy dog.",
    "I've been thinking about what you said yesterday, and honestly, you were right.",
    "Could you remind me to call the dentist tomorrow morning at nine?",
    "Streaming audio arrives a frame at a time, so the listener never waits for the whole answer.",
    "Wow, that's amazing! <laugh> I can't believe it actually worked on the first try.",
    "Please turn left at the next intersection, then continue for two hundred meters.",
    "Once upon a time, in a village by the sea, there lived an old fisherman and his cat.",
)

TARGETS = {"audio_s_per_s": 2.0, "ttfa_p50": 0.2, "floor_efficiency": 0.85}
DETERMINISTIC_TARGET = 0.8  # deterministic audio s/s over the default's, at the top concurrency
"""At the largest concurrency: mstar/baseline audio s/s >= 2, TTFA p50 <= 1/5 of the
baseline's, and mstar audio s/s >= 85 % of the floor's."""

PLACEMENTS = {
    # Everything on rank 0 (the default): LLM steps and codec calls share one step thread
    # and all the cores; the LLM engine steps back to back and yields the thread to codec work.
    "one-rank": None,
    # LLM on rank 0, codec on rank 1, both in this process: two step threads, each with its
    # share of the cores, so decode steps and codec windows overlap.
    "two-ranks": "node_groups:\n  - {node_names: [LLM], ranks: [0]}\n  - {node_names: "
    "[snac_decoder], ranks: [1]}\n",
}


@dataclass(frozen=True)
class Settings:
    """One run's configuration (printed first, recorded in the JSON)."""

    config: str = "orpheus-small"
    concurrency: tuple[int, ...] = (1, 4, 16)
    work: SpeechWork = field(default_factory=SpeechWork)  # samples per frame: from the codec
    num_requests: int | None = None
    warmup: int = 1
    placement: str = "one-rank"
    threads: int = 0
    device: str = "cpu"
    seed: int = 0
    out: str = "results/bench_orpheus"
    skip_baseline: bool = False
    skip_floor: bool = False
    deterministic: bool = False  # also run a deterministic engine (mstar-det)

    @property
    def num_frames(self) -> int:
        """Return the frames each request produces."""
        return self.work.num_frames

    @property
    def samples_per_request(self) -> int:
        """Return the audio samples each request produces (2048 per frame)."""
        return self.work.samples_per_request


def mstar_target(
    engine: AsyncEngine, work: SpeechWork
) -> Callable[[BenchRequest], AsyncIterator[OutputEvent]]:
    """Return the harness target that sends requests to the engine."""

    async def run(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        data = {
            "text": request.prompt,
            "voice": work.voice,
            "max_tokens": request.max_tokens,
            "temperature": work.temperature,
            "top_p": work.top_p,
            "repetition_penalty": work.repetition_penalty,
            "seed": request_seed(request.request_id),
        }
        total = 0
        async for out in engine.generate(Request("speech", data, request_id=request.request_id)):
            num_samples = int(out.data.numel())
            if num_samples:
                total += num_samples
                yield audio_event(num_samples)
        check_num_samples(total, work.samples_per_request, "mstar")

    return run


# --- the run -----------------------------------------------------------------------------------

BREAKDOWN_CAPTION = (
    "mstar/floor: LLM = KVCacheEngine steps (schedule + forward + sampling), forward = "
    "model + LM head "
    "and sampling; mstar: from the engines' own timers, codec = snac_decoder node steps; "
    "transformers: LLM = generate() per request (runs alongside the codec); steps = "
    "tokens there"
)


@dataclass
class Run:
    """Everything one run holds: the targets, the floor and what they measured."""

    settings: Settings
    templates: list[BenchRequest]
    targets: dict[str, Callable[[BenchRequest], AsyncIterator[OutputEvent]]]
    trackers: dict[str, PhaseTracker]
    floor: OrpheusFloor | None
    results: list[BenchResult] = field(default_factory=list)
    floors: list[FloorResult] = field(default_factory=list)
    breakdowns: list[PointBreakdown] = field(default_factory=list)

    async def point(self, c: int, console: Console) -> None:
        """Measure every target at concurrency c (the harness), then the floor."""
        s = self.settings
        targets = {name: self.trackers[name].wrap(fn) for name, fn in self.targets.items()}
        load = ClosedLoop((c,), num_requests=s.num_requests, warmup=s.warmup)
        seed = s.seed * 1000 + c
        started, load_before = time.perf_counter(), os.getloadavg()[0]
        result = await run_benchmark(
            targets,
            self.templates,
            load,
            name="bench_orpheus",
            seed=seed,
            progress=False,
            console=Console(quiet=True),
        )
        self.results.append(result)
        done = []
        for p in result.points:
            spent = self.trackers[p.target].spent(f"concurrency-{c}")
            wall_s, audio_s = p.summary.duration_s, p.summary.audio_s
            self.breakdowns.append(PointBreakdown.from_spent(p.target, c, wall_s, audio_s, spent))
            ok = p.summary.num_requests - p.summary.num_failed
            done.append(f"{p.target} {ok}/{p.summary.num_requests} ok in {wall_s:.1f} s")
            errors = sorted({r.error for r in p.records if r.error})
            if errors:
                console.print(f"  {p.target} errors: {errors[:3]}", highlight=False, markup=False)
        if self.floor is not None:
            # The same requests as the harness measured: it draws a run's first point with
            # seed * 1_000_003 + 1 and names them like this.
            measured = draw_requests(
                self.templates,
                load.requests_at(c),
                seed=seed * 1_000_003 + 1,
                prefix=f"concurrency-{c}",
            )
            fr = self.floor.run(measured, c)
            self.floors.append(fr)
            self.breakdowns.append(fr.breakdown())
            done.append(f"floor {fr.seconds:.1f} s")
        took = time.perf_counter() - started
        console.print(
            f"c={c}: {', '.join(done)} (point took {took:.0f} s; "
            f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f})",
            highlight=False,
            markup=False,
        )


async def run(settings: Settings, console: Console) -> dict[str, Any]:
    """Run every point (mstar, baseline, floor side by side); print and write the results."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    model = OrpheusModel(
        settings.config,
        engine_config=_kv_config(settings),
        codec_batch_size=settings.work.codec_batch_size,
    )
    work = dataclasses.replace(settings.work, samples_per_frame=model.config.snac.samples_per_frame)
    settings = dataclasses.replace(settings, work=work)
    config = _describe(settings, model)
    console.print("[bold]bench_orpheus[/bold]: configuration")
    for key, value in config.items():
        console.print(f"  {key}: {value}", highlight=False, markup=False)
    meter = Meter()
    baseline = None if settings.skip_baseline else TransformersOrpheus(model.config, work, meter)
    floor = None if settings.skip_floor else OrpheusFloor(model, work)
    if floor is not None:
        floor.warm_up(PROMPTS[0])
    placement = PLACEMENTS[settings.placement]
    layout = Placement.from_yaml(placement) if placement else None
    devices = rank_devices(settings.device, layout)
    engines = {"mstar": await AsyncEngine.start(model, layout, EngineConfig(devices=devices))}
    if settings.deterministic:
        det = EngineConfig(devices=devices, deterministic=True)
        engines["mstar-det"] = await AsyncEngine.start(model, layout, det)
    templates = make_requests(
        list(PROMPTS), max_tokens=work.max_tokens, ignore_eos=True, params={"voice": work.voice}
    )
    targets = {name: mstar_target(engine, work) for name, engine in engines.items()}
    trackers = {
        name: PhaseTracker(
            partial(engine_figures, engine, llm_node="LLM", codec_node="snac_decoder")
        )
        for name, engine in engines.items()
    }
    if baseline is not None:
        targets["transformers"] = baseline.stream
        trackers["transformers"] = PhaseTracker(meter.read)
    bench = Run(settings, templates, targets, trackers, floor)
    try:
        for c in settings.concurrency:
            await bench.point(c, console)
    finally:
        for engine in engines.values():
            await engine.shutdown()
    merged = merge_results(bench.results, config)
    print_table(merged, console)
    console.print(breakdown_table(bench.breakdowns, BREAKDOWN_CAPTION))
    checks = _summary(merged, bench.floors, console)
    data = result_to_dict(merged)
    data["orpheus"] = json_safe(
        {
            "floor": [
                dataclasses.asdict(f) | {"seconds": f.seconds, "audio_s_per_s": f.audio_s_per_s}
                for f in bench.floors
            ],
            "breakdown": [dataclasses.asdict(b) | {"other_s": b.other_s} for b in bench.breakdowns],
            "targets": checks,
        }
    )
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench_orpheus.json"
    json_path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    png_path = plot_png(merged, out / "bench_orpheus.png")
    console.print(f"wrote {json_path} and {png_path}", highlight=False, markup=False)
    return data


def _kv_config(settings: Settings) -> dict[str, Any]:
    # Cache for the largest concurrency at the longest prompt plus the generation, not the
    # 1 GiB default: the benchmark shares its machine.
    longest = max(len(p) for p in PROMPTS) + 64  # a generous bound on a prompt's tokens
    blocks_per_seq = -(-(longest + settings.work.max_tokens) // 16)
    return {
        "max_num_seqs": max(settings.concurrency),
        "num_blocks": blocks_per_seq * max(settings.concurrency) + 8,
        "max_model_len": 1024 + settings.work.max_tokens,
    }


def _describe(settings: Settings, model: OrpheusModel) -> dict[str, Any]:
    cfg = model.config
    llm = cfg.llm
    return {
        "model": f"{cfg.name}: Llama hidden {llm.hidden_size}, {llm.num_hidden_layers} layers, "
        f"{llm.num_attention_heads}/{llm.num_key_value_heads} heads, MLP {llm.intermediate_size}, "
        f"vocab {llm.vocab_size}; SNAC decoder_dim {cfg.snac.decoder_dim}, "
        f"{cfg.snac.sampling_rate} Hz; random weights (constrained decoding)",
        "load": f"closed loop, concurrency {list(settings.concurrency)}, "
        f"measured requests per point max({settings.num_requests or 0}, 5 x c), warm-up "
        f"{settings.warmup}",
        "request": f"{settings.work.max_tokens} audio tokens = {settings.num_frames} frames = "
        f"{settings.samples_per_request / SAMPLE_RATE:.3f} s of audio (end of speech masked: "
        "equal work)",
        "sampling": f"temperature {settings.work.temperature}, top_p {settings.work.top_p}, "
        f"repetition_penalty {settings.work.repetition_penalty}, seed per request id",
        "mstar": f"AsyncEngine co-located ({settings.placement}), codec batch <= "
        f"{settings.work.codec_batch_size} "
        f"windows per call, KV {model.engine_config}",
        "transformers": "one request at a time; LlamaForCausalLM.generate (fp32) in a thread "
        "with a "
        "streamer; 28/7 windows decoded with SNAC as they arrive",
        "floor": "the same requests as KVCacheEngine.step batches (c at a time) + codec calls, "
        "no serving; efficiency = floor time / mstar time for the same audio",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
        "skip": [
            n
            for n, skip in (
                ("transformers", settings.skip_baseline),
                ("floor", settings.skip_floor),
            )
            if skip
        ],
    }


def _summary(
    result: BenchResult, floors: Sequence[FloorResult], console: Console
) -> dict[str, Any]:
    table = Table(title="summary: mstar against the baseline and the floor")
    headers = (
        "c|RTF p50|RTF p95|viable %|audio s/s|vs baseline|TTFA p50 ms|/ baseline|floor "
        "audio s/s|efficiency"
    )
    for header in headers.split("|"):
        table.add_column(header, justify="right")
    checks: dict[str, Any] = {}
    floor_by_c = {f.concurrency: f for f in floors}
    for point in result.load_points:
        c = int(point)
        ours = result.result("mstar", point).summary
        base = (
            result.result("transformers", point).summary
            if "transformers" in result.targets
            else None
        )
        fl = floor_by_c.get(c)
        row = {
            "rtf_p50": ours.rtf.p50 if ours.rtf else math.nan,
            "rtf_p95": ours.rtf.p95 if ours.rtf else math.nan,
            "viable": ours.viable_fraction if ours.viable_fraction is not None else math.nan,
            "audio_s_per_s": ours.audio_s_per_s,
            "audio_ratio": ours.audio_s_per_s / base.audio_s_per_s
            if base and base.audio_s_per_s
            else math.nan,
            "ttfa_p50": ours.ttfa_s.p50 if ours.ttfa_s else math.nan,
            "ttfa_ratio": ours.ttfa_s.p50 / base.ttfa_s.p50
            if base and base.ttfa_s and ours.ttfa_s
            else math.nan,
            "floor_audio_s_per_s": fl.audio_s_per_s if fl else math.nan,
            "efficiency": ours.audio_s_per_s / fl.audio_s_per_s if fl else math.nan,
        }
        checks[str(c)] = row
        table.add_row(
            str(c),
            f"{row['rtf_p50']:.2f}",
            f"{row['rtf_p95']:.2f}",
            f"{100 * row['viable']:.0f}",
            f"{row['audio_s_per_s']:.3f}",
            f"{row['audio_ratio']:.2f}x",
            f"{1e3 * row['ttfa_p50']:.0f}",
            f"{row['ttfa_ratio']:.3f}",
            f"{row['floor_audio_s_per_s']:.3f}",
            f"{100 * row['efficiency']:.0f} %",
        )
    console.print(table)
    floor_audio = {f.concurrency: f.audio_s for f in floors}
    for point in result.load_points:
        audio = {t: result.result(t, point).summary.audio_s for t in result.targets}
        if int(point) in floor_audio:
            audio["floor"] = floor_audio[int(point)]
        same = max(audio.values()) - min(audio.values()) < 1e-6
        note = "equal work" if same else "UNEQUAL work (failed requests?)"
        text = ", ".join(f"{t} {a:.2f} s" for t, a in audio.items())
        console.print(
            f"  c={int(point)} audio produced: {text}: {note}", highlight=False, markup=False
        )
    top = checks[str(max(int(p) for p in result.load_points))]
    ratio, ttfa, efficiency = top["audio_ratio"], top["ttfa_ratio"], top["efficiency"]
    verdicts = {
        "audio_s_per_s": (
            ratio,
            ratio >= TARGETS["audio_s_per_s"],
            ">= 2x the baseline's audio s/s",
        ),
        "ttfa_p50": (ttfa, ttfa <= TARGETS["ttfa_p50"], "TTFA p50 <= 1/5 of the baseline's"),
        "floor_efficiency": (
            efficiency,
            efficiency >= TARGETS["floor_efficiency"],
            ">= 85 % of the floor",
        ),
    }
    c_max = max(int(p) for p in result.load_points)
    console.print(f"targets at concurrency {c_max}:")
    for value, ok, text in verdicts.values():
        status = "n/a " if math.isnan(value) else ("MET " if ok else "MISS")
        console.print(f"  {status} {text}: {value:.3f}", highlight=False, markup=False)
    if "mstar-det" in result.targets:
        for point in result.load_points:
            det = result.result("mstar-det", point).summary.audio_s_per_s
            default = result.result("mstar", point).summary.audio_s_per_s
            checks[str(int(point))]["det_audio_ratio"] = det / default
            console.print(
                f"  c={int(point)} deterministic: {det:.3f} audio s/s, {det / default:.2f}x the "
                "default's",
                highlight=False,
                markup=False,
            )
        det_ratio = checks[str(c_max)]["det_audio_ratio"]
        verdicts["deterministic"] = (det_ratio, det_ratio >= DETERMINISTIC_TARGET, "")
        status = "MET " if det_ratio >= DETERMINISTIC_TARGET else "MISS"
        console.print(
            f"  {status} deterministic audio s/s >= {DETERMINISTIC_TARGET}x the default's at "
            f"c={c_max}: {det_ratio:.3f}",
            highlight=False,
            markup=False,
        )
    checks["verdicts"] = {k: {"value": v, "met": ok} for k, (v, ok, _) in verdicts.items()}
    return checks


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """Parse the command line into `Settings`."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--config", default="orpheus-small", help="Orpheus config (orpheus-small, orpheus-tiny)"
    )
    p.add_argument(
        "--concurrency", default="1,4,16", help="closed-loop concurrencies, comma-separated"
    )
    p.add_argument(
        "--max-tokens", type=int, default=56, help="audio tokens per request (a multiple of 7)"
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="measured requests per point (at least 5 x c)",
    )
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per point and target")
    p.add_argument(
        "--codec-batch-size",
        type=int,
        default=4,
        help="most windows per codec call (mstar and floor)",
    )
    p.add_argument("--placement", choices=sorted(PLACEMENTS), default="one-rank")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    add_device_argument(p)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--repetition-penalty", type=float, default=1.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_orpheus", help="directory for the JSON and PNG")
    p.add_argument(
        "--skip-baseline", action="store_true", help="run without the transformers baseline"
    )
    p.add_argument("--skip-floor", action="store_true", help="run without the floor")
    p.add_argument("--quick", action="store_true", help="concurrency 1,4 and 42-token requests")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="also run a deterministic engine beside the default one (mstar-det)",
    )
    args = p.parse_args(argv)
    concurrency = "1,4" if args.quick else args.concurrency
    max_tokens = 42 if args.quick else args.max_tokens
    try:
        levels = tuple(int(c) for c in concurrency.split(","))
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {concurrency!r}")
    if not levels or min(levels) < 1:
        p.error("--concurrency values must be >= 1")
    if max_tokens < FRAME_SIZE or max_tokens % FRAME_SIZE:
        p.error(
            f"--max-tokens must be a positive multiple of {FRAME_SIZE} (whole frames), got "
            f"{max_tokens}"
        )
    if args.codec_batch_size < 1:
        p.error("--codec-batch-size must be >= 1")
    return Settings(
        config=args.config,
        concurrency=levels,
        work=SpeechWork(
            max_tokens=max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
            codec_batch_size=args.codec_batch_size,
        ),
        num_requests=args.num_requests,
        warmup=args.warmup,
        placement=args.placement,
        threads=args.threads,
        device=args.device,
        seed=args.seed,
        out=args.out,
        skip_baseline=args.skip_baseline,
        skip_floor=args.skip_floor,
        deterministic=args.deterministic,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark from the command line; return what it wrote to JSON."""
    settings = parse_args(argv)
    return asyncio.run(run(settings, Console(width=150)))


if __name__ == "__main__":
    main()
