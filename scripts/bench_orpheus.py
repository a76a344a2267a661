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
all three mask end of speech (``ignore_eos``) on top of Orpheus' constrained decoding.

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
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers.generation.streamers import BaseStreamer

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
from mstar.engines import KVCacheEngine, SamplingParams
from mstar.runtime import AsyncEngine, EngineConfig, Placement, Request
from mstar.streaming import Chunk
from mstar.zoo.orpheus import (
    FRAME_SIZE,
    SAMPLE_RATE,
    AudioLogitsProcessor,
    AudioStreamState,
    AudioWindow,
    OrpheusConfig,
    OrpheusTokenizer,
    decode_windows,
    load_orpheus_codec,
    load_orpheus_llm,
    plan_chunk,
    plan_tokens,
)
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
    max_tokens: int = 56
    num_requests: int | None = None
    warmup: int = 1
    voice: str = "tara"
    temperature: float = 0.6
    top_p: float = 0.8
    repetition_penalty: float = 1.3
    codec_batch_size: int = 4
    placement: str = "one-rank"
    threads: int = 0
    device: str = "cpu"
    seed: int = 0
    out: str = "results/bench_orpheus"
    skip_baseline: bool = False
    skip_floor: bool = False
    deterministic: bool = False  # also run a deterministic engine (mstar-det)
    samples_per_frame: int = 2048  # set from the codec's config

    @property
    def num_frames(self) -> int:
        """Return the frames each request produces."""
        return self.max_tokens // FRAME_SIZE

    @property
    def samples_per_request(self) -> int:
        """Return the audio samples each request produces (2048 per frame)."""
        return self.num_frames * self.samples_per_frame

    def sampling(
        self, max_tokens: int, seed: int, stop_token_ids: tuple[int, ...]
    ) -> SamplingParams:
        """Return the engine's sampling parameters for one request."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            seed=seed,
        )


def request_seed(request_id: str) -> int:
    """Return a request's sampling (and codec noise) seed: the same in every system."""
    return zlib.crc32(request_id.encode()) & 0x7FFFFFFF


# --- timing ------------------------------------------------------------------------------------


Figures = dict[str, tuple[float, int]]
"""Seconds and counts per named activity: ``llm_step`` (seconds, steps), ``llm_forward``
(seconds), ``llm_generate`` (seconds, tokens), ``codec`` (seconds, windows)."""


class Meter:
    """Seconds and counts per named activity, for the baseline (``llm_generate``, ``codec``).

    Written by one thread at a time, read by the event loop between requests.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        """Account ``seconds`` and ``count`` units to ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + count

    def snapshot(self) -> Figures:
        """Return the totals so far."""
        return {k: (v, self.counts[k]) for k, v in list(self.seconds.items())}

    async def read(self) -> Figures:
        """Return the totals so far (the `PhaseTracker` interface; it does not suspend)."""
        return self.snapshot()

    @staticmethod
    def delta(
        before: Mapping[str, tuple[float, int]], after: Mapping[str, tuple[float, int]]
    ) -> Figures:
        """Return what was accounted between two snapshots."""
        return {
            k: (s - before.get(k, (0.0, 0))[0], n - before.get(k, (0.0, 0))[1])
            for k, (s, n) in after.items()
        }


async def engine_figures(engine: AsyncEngine) -> Figures:
    """Return mstar's figures so far, from the engines' own counters (summed over ranks).

    The LLM node's steps are whole `KVCacheEngine` steps (schedule, forward, sampling,
    update); its forward is the model's forward pass plus the LM head and sampling. The codec
    is the ``snac_decoder`` node's steps, one input per 28/7 window.
    """
    figures: Figures = {}
    for nodes in (await engine.stats()).values():
        llm, codec = nodes.get("LLM"), nodes.get("snac_decoder")
        if llm is not None:
            forward = llm.get("phase_forward_seconds", 0.0) + llm.get("phase_logits_seconds", 0.0)
            _add(figures, "llm_step", llm["step_seconds"], int(llm["steps"]))
            _add(figures, "llm_forward", forward, 0)
        if codec is not None:
            _add(figures, "codec", codec["step_seconds"], int(codec["batched"]))
    return figures


def _add(figures: Figures, name: str, seconds: float, count: int) -> None:
    total, num = figures.get(name, (0.0, 0))
    figures[name] = (total + seconds, num + count)


# --- equal work: fixed-length audio ------------------------------------------------------------


# --- targets -----------------------------------------------------------------------------------


def audio_event(num_samples: int) -> OutputEvent:
    """Return the harness event of one audio chunk."""
    return OutputEvent("audio", num_samples=num_samples, sample_rate=SAMPLE_RATE)


def check_length(total: int, settings: Settings, system: str) -> None:
    """Fail the request unless it produced every frame it was asked for (equal work)."""
    if total != settings.samples_per_request:
        raise RuntimeError(
            f"{system} produced {total} samples, expected {settings.samples_per_request}"
        )


def mstar_target(
    engine: AsyncEngine, settings: Settings
) -> Callable[[BenchRequest], AsyncIterator[OutputEvent]]:
    """Return the harness target that sends requests to the engine."""

    async def run(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        data = {
            "text": request.prompt,
            "voice": settings.voice,
            "max_tokens": request.max_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "repetition_penalty": settings.repetition_penalty,
            "seed": request_seed(request.request_id),
        }
        total = 0
        async for out in engine.generate(Request("speech", data, request_id=request.request_id)):
            num_samples = int(out.data.numel())
            if num_samples:
                total += num_samples
                yield audio_event(num_samples)
        check_length(total, settings, "mstar")

    return run


class _TokenStreamer(BaseStreamer):
    """A transformers streamer handing each generated token id to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
        super().__init__()
        self.loop, self.queue = loop, queue
        self._is_prompt = True

    def put(self, value: torch.Tensor) -> None:
        """Forward new token ids (``generate`` first puts the prompt, which is skipped)."""
        if self._is_prompt:
            self._is_prompt = False
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, int(token))

    def end(self) -> None:
        """Mark the end of generation."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class TransformersBaseline:
    """Orpheus the way a user serves it without mstar: transformers ``generate`` plus SNAC.

    One request at a time (a lock); ``generate`` runs in a thread and streams token ids;
    each 28/7 window is decoded with SNAC as soon as its tokens are in (same windows, same
    emitted frames, same codec noise seeds as mstar), in a worker thread so the event
    loop keeps receiving tokens.
    """

    def __init__(self, cfg: OrpheusConfig, settings: Settings, meter: Meter) -> None:
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.cfg, self.settings, self.meter = cfg, settings, meter
        self.layout = cfg.layout
        self.model = LlamaForCausalLM.from_pretrained(str(cfg.llm_dir), dtype=torch.float32).eval()
        self.codec = load_orpheus_codec(cfg)
        self.tokenizer = OrpheusTokenizer(cfg.layout)
        self.lock = asyncio.Lock()

    def _generate(
        self,
        prompt: list[int],
        seed: int,
        max_tokens: int,
        streamer: _TokenStreamer,
        cancel: threading.Event,
    ) -> None:
        from transformers import (
            LogitsProcessor,
            LogitsProcessorList,
            RepetitionPenaltyLogitsProcessor,
            StoppingCriteria,
            StoppingCriteriaList,
            TemperatureLogitsWarper,
            TopPLogitsWarper,
        )

        constraint = AudioLogitsProcessor(self.layout, len(prompt), allow_end=False)

        class AudioConstraint(LogitsProcessor):  # the same mask as mstar's, row by row
            def __call__(
                self, input_ids: torch.LongTensor, scores: torch.FloatTensor
            ) -> torch.FloatTensor:
                for row in range(scores.shape[0]):
                    constraint(input_ids[row].tolist(), scores[row])
                return scores

        class Cancelled(StoppingCriteria):
            def __call__(
                self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
            ) -> Any:
                return torch.full((input_ids.shape[0],), cancel.is_set(), dtype=torch.bool)

        s = self.settings
        # generate() appends custom processors after its own warpers; pass them all here, in
        # Orpheus' order (penalty, constraint, temperature, top-p), and disable the built-in ones.
        processors: list[Any] = []
        if s.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
        processors.append(AudioConstraint())
        do_sample = s.temperature > 0
        if do_sample:
            processors.append(TemperatureLogitsWarper(s.temperature))
            if s.top_p < 1.0:
                processors.append(TopPLogitsWarper(s.top_p))
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        try:
            torch.manual_seed(seed)
            with torch.inference_mode():
                self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=do_sample,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=max_tokens,
                    logits_processor=LogitsProcessorList(processors),
                    stopping_criteria=StoppingCriteriaList([Cancelled()]),
                    streamer=streamer,
                    eos_token_id=self.layout.end_of_speech,
                    pad_token_id=self.layout.pad,
                )
        except BaseException as exc:  # surfaced to the request, not lost in the thread
            streamer.loop.call_soon_threadsafe(streamer.queue.put_nowait, exc)
        finally:
            self.meter.add("llm_generate", time.perf_counter() - start, max_tokens)

    def _decode(self, windows: Sequence[AudioWindow]) -> list[torch.Tensor]:
        start = time.perf_counter()
        pieces = decode_windows(self.codec, windows)
        self.meter.add("codec", time.perf_counter() - start, len(windows))
        return pieces

    async def stream(self, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        """Serve one request (after the ones before it): stream its audio chunks."""
        s = self.settings
        async with self.lock:
            seed = request_seed(request.request_id)
            prompt = self.tokenizer.format_prompt(request.prompt, s.voice)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Any] = asyncio.Queue()
            cancel = threading.Event()
            thread = threading.Thread(
                target=self._generate,
                args=(
                    prompt,
                    seed,
                    request.max_tokens or s.max_tokens,
                    _TokenStreamer(loop, queue),
                    cancel,
                ),
                name="hf-generate",
                daemon=True,
            )
            thread.start()
            state = AudioStreamState(noise_seed=self.cfg.noise_seed + seed)
            total = 0
            try:
                while not state.is_done:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    is_last = item is None
                    chunk = Chunk(() if is_last else (item,), state.num_items, 0, is_last)
                    state, windows = plan_chunk(state, chunk, self.layout)
                    if windows:
                        pieces = await asyncio.to_thread(self._decode, windows)
                        num_samples = sum(int(p.numel()) for p in pieces)
                        total += num_samples
                        yield audio_event(num_samples)
                check_length(total, s, "transformers")
            finally:
                cancel.set()
                await asyncio.to_thread(thread.join)


class PhaseTracker:
    """Read a target's figures around each point's measured requests (warm-up excluded).

    The harness names measured requests ``{kind}-{point}-{i}`` and warm-up ones
    ``warmup-...``; in a closed loop every warm-up request ends before the first measured one.
    The first measured request of a point reads the figures before any of the point's
    requests is sent; each one that ends reads them again, and the read begun last (after
    the point's last request ended) is the point's end.
    """

    def __init__(self, read: Callable[[], Awaitable[Figures]]) -> None:
        self.read = read
        self.begin: dict[str, asyncio.Task[Figures]] = {}
        self.end: dict[str, tuple[int, Figures]] = {}
        self._num_reads = 0

    def wrap(
        self, fn: Callable[[BenchRequest], AsyncIterator[OutputEvent]]
    ) -> Callable[[BenchRequest], AsyncIterator[OutputEvent]]:
        """Return ``fn`` with reads at the first start and the last end of each point."""

        async def run(request: BenchRequest) -> AsyncIterator[OutputEvent]:
            phase = (
                None
                if request.request_id.startswith("warmup-")
                else request.request_id.rsplit("-", 1)[0]
            )
            if phase is not None:
                if phase not in self.begin:
                    self.begin[phase] = asyncio.ensure_future(self.read())
                await self.begin[phase]  # the point's other first requests wait for it too
            try:
                async for event in fn(request):
                    yield event
            finally:
                if phase is not None:
                    self._num_reads += 1
                    order, figures = self._num_reads, await self.read()
                    if order > self.end.get(phase, (0, {}))[0]:
                        self.end[phase] = (order, figures)

        return run

    def spent(self, phase: str) -> Figures:
        """Return what the target accounted during a point's measured requests."""
        begin = self.begin[phase].result() if phase in self.begin else {}
        return Meter.delta(begin, self.end.get(phase, (0, {}))[1])


# --- the floor ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FloorResult:
    """Pure compute for one point's requests: batched LLM steps, then codec windows."""

    concurrency: int
    num_requests: int
    llm_s: float
    llm_forward_s: float
    num_steps: int
    codec_s: float
    num_windows: int
    audio_s: float

    @property
    def seconds(self) -> float:
        """Return the floor's time: LLM steps plus codec calls."""
        return self.llm_s + self.codec_s

    @property
    def audio_s_per_s(self) -> float:
        """Return the audio seconds per second of pure compute."""
        return self.audio_s / self.seconds


class Floor:
    """The same work with no serving around it: `KVCacheEngine` steps and codec calls."""

    def __init__(self, model: OrpheusModel, settings: Settings) -> None:
        self.cfg, self.settings = model.config, settings
        self.engine_config = model.engine_config
        self.llm = load_orpheus_llm(model.config)
        self.codec = load_orpheus_codec(model.config)
        self.tokenizer = OrpheusTokenizer(model.config.layout)

    def run(self, requests: Sequence[BenchRequest], concurrency: int) -> FloorResult:
        """Generate every request c at a time, then decode all their windows; time both."""
        s, layout = self.settings, self.cfg.layout
        engine = KVCacheEngine(
            self.llm,
            dataclasses.replace(self.engine_config, max_num_seqs=concurrency),
            device="cpu",
        )
        tokens: dict[str, list[int]] = {}
        for r in requests:
            prompt = self.tokenizer.format_prompt(r.prompt, s.voice)
            params = s.sampling(
                r.max_tokens or s.max_tokens, request_seed(r.request_id), (layout.end_of_speech,)
            )
            processor = AudioLogitsProcessor(layout, len(prompt), allow_end=False)
            engine.add_request(r.request_id, prompt, params, logits_processor=processor)
            tokens[r.request_id] = []
        num_steps = 0
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            num_steps += 1
        llm_s = time.perf_counter() - start
        windows = [
            w
            for rid, ids in tokens.items()
            for w in plan_tokens(ids, layout, self.cfg.noise_seed + request_seed(rid))
        ]
        start = time.perf_counter()
        audio = decode_windows(self.codec, windows, max_batch_size=s.codec_batch_size)
        codec_s = time.perf_counter() - start
        phases = engine.runner.phases.seconds  # the engine's own timers (a new engine per run)
        num_samples = sum(int(a.numel()) for a in audio)
        if num_samples != len(requests) * s.samples_per_request:
            raise RuntimeError(
                f"the floor produced {num_samples} samples, expected "
                f"{len(requests) * s.samples_per_request}"
            )
        return FloorResult(
            concurrency,
            len(requests),
            llm_s,
            phases["forward"] + phases["logits"],
            num_steps,
            codec_s,
            len(windows),
            num_samples / SAMPLE_RATE,
        )

    def warm_up(self) -> None:
        """Run one short request through both halves (allocator, kernels)."""
        warm = make_requests([PROMPTS[0]], max_tokens=4 * FRAME_SIZE, ignore_eos=True)
        settings, self.settings = (
            self.settings,
            dataclasses.replace(self.settings, max_tokens=4 * FRAME_SIZE),
        )
        try:
            self.run(warm, 1)
        finally:
            self.settings = settings


# --- the run -----------------------------------------------------------------------------------


@dataclass
class PointBreakdown:
    """Where one target's time went at one point."""

    target: str
    concurrency: int
    wall_s: float
    audio_s: float
    llm_s: float
    llm_forward_s: float | None
    num_steps: int
    codec_s: float
    num_windows: int

    @property
    def other_s(self) -> float:
        """Return wall time not spent in LLM steps or codec calls (may be < 0 when they overlap)."""
        return self.wall_s - self.llm_s - self.codec_s


def _breakdown(
    target: str, c: int, wall_s: float, audio_s: float, spent: Mapping[str, tuple[float, int]]
) -> PointBreakdown:
    llm_key = "llm_step" if "llm_step" in spent else "llm_generate"
    forward = spent.get("llm_forward")
    return PointBreakdown(
        target,
        c,
        wall_s,
        audio_s,
        spent.get(llm_key, (0.0, 0))[0],
        None if forward is None else forward[0],
        spent.get(llm_key, (0.0, 0))[1],
        spent.get("codec", (0.0, 0))[0],
        spent.get("codec", (0.0, 0))[1],
    )


@dataclass
class Run:
    """Everything one run holds: the engine, the baseline, the floor and what they measured."""

    settings: Settings
    engine: AsyncEngine
    templates: list[BenchRequest]
    trackers: dict[str, PhaseTracker]
    baseline: TransformersBaseline | None
    floor: Floor | None
    det_engine: AsyncEngine | None = None
    results: list[BenchResult] = dataclasses.field(default_factory=list)
    floors: list[FloorResult] = dataclasses.field(default_factory=list)
    breakdowns: list[PointBreakdown] = dataclasses.field(default_factory=list)

    async def point(self, c: int, console: Console) -> None:
        """Measure mstar and the baseline at concurrency c (the harness), then the floor."""
        s = self.settings
        targets: dict[str, Any] = {
            "mstar": self.trackers["mstar"].wrap(mstar_target(self.engine, s))
        }
        if self.det_engine is not None:
            det = mstar_target(self.det_engine, s)
            targets["mstar-det"] = self.trackers["mstar-det"].wrap(det)
        if self.baseline is not None:
            targets["transformers"] = self.trackers["transformers"].wrap(self.baseline.stream)
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
            self.breakdowns.append(
                _breakdown(p.target, c, p.summary.duration_s, p.summary.audio_s, spent)
            )
            ok = p.summary.num_requests - p.summary.num_failed
            done.append(
                f"{p.target} {ok}/{p.summary.num_requests} ok in {p.summary.duration_s:.1f} s"
            )
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
            self.breakdowns.append(
                PointBreakdown(
                    "floor",
                    c,
                    fr.seconds,
                    fr.audio_s,
                    fr.llm_s,
                    fr.llm_forward_s,
                    fr.num_steps,
                    fr.codec_s,
                    fr.num_windows,
                )
            )
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
    meter = Meter()
    model = OrpheusModel(
        settings.config,
        engine_config=_kv_config(settings),
        codec_batch_size=settings.codec_batch_size,
    )
    cfg = model.config
    settings = dataclasses.replace(settings, samples_per_frame=cfg.snac.samples_per_frame)
    config = _describe(settings, model)
    console.print("[bold]bench_orpheus[/bold]: configuration")
    for key, value in config.items():
        console.print(f"  {key}: {value}", highlight=False, markup=False)
    baseline = None if settings.skip_baseline else TransformersBaseline(cfg, settings, meter)
    floor = None if settings.skip_floor else Floor(model, settings)
    if floor is not None:
        floor.warm_up()
    placement = PLACEMENTS[settings.placement]
    layout = Placement.from_yaml(placement) if placement else None
    devices = rank_devices(settings.device, layout)
    engine = await AsyncEngine.start(model, layout, EngineConfig(devices=devices))
    det_engine = None
    if settings.deterministic:
        det_engine = await AsyncEngine.start(
            model, layout, EngineConfig(devices=devices, deterministic=True)
        )
    templates = make_requests(
        list(PROMPTS),
        max_tokens=settings.max_tokens,
        ignore_eos=True,
        params={"voice": settings.voice},
    )
    bench = Run(
        settings,
        engine,
        templates,
        {
            "mstar": PhaseTracker(lambda: engine_figures(engine)),
            "transformers": PhaseTracker(meter.read),
        },
        baseline,
        floor,
        det_engine,
    )
    if det_engine is not None:
        bench.trackers["mstar-det"] = PhaseTracker(lambda: engine_figures(det_engine))
    try:
        for c in settings.concurrency:
            await bench.point(c, console)
    finally:
        await engine.shutdown()
        if det_engine is not None:
            await det_engine.shutdown()
    merged = merge_results(bench.results, config)
    print_table(merged, console)
    console.print(_breakdown_table(bench.breakdowns))
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
    blocks_per_seq = -(-(longest + settings.max_tokens) // 16)
    return {
        "max_num_seqs": max(settings.concurrency),
        "num_blocks": blocks_per_seq * max(settings.concurrency) + 8,
        "max_model_len": 1024 + settings.max_tokens,
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
        "request": f"{settings.max_tokens} audio tokens = {settings.num_frames} frames = "
        f"{settings.samples_per_request / SAMPLE_RATE:.3f} s of audio (end of speech masked: "
        "equal work)",
        "sampling": f"temperature {settings.temperature}, top_p {settings.top_p}, "
        f"repetition_penalty {settings.repetition_penalty}, seed per request id",
        "mstar": f"AsyncEngine co-located ({settings.placement}), codec batch <= "
        f"{settings.codec_batch_size} "
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


def _breakdown_table(rows: Sequence[PointBreakdown]) -> Table:
    table = Table(title="where the time goes (seconds during each point's measured phase)")
    headers = (
        "c|target|wall s|audio s|LLM s|(forward s)|steps|ms/step|codec s|windows|ms/window|other s"
    )
    for header in headers.split("|"):
        table.add_column(header, justify="left" if header == "target" else "right")
    for b in rows:
        table.add_row(
            str(b.concurrency),
            b.target,
            f"{b.wall_s:.1f}",
            f"{b.audio_s:.1f}",
            f"{b.llm_s:.1f}",
            "-" if b.llm_forward_s is None else f"{b.llm_forward_s:.1f}",
            str(b.num_steps),
            f"{1e3 * b.llm_s / b.num_steps:.1f}" if b.num_steps else "-",
            f"{b.codec_s:.1f}",
            str(b.num_windows),
            f"{1e3 * b.codec_s / b.num_windows:.0f}" if b.num_windows else "-",
            f"{b.other_s:.1f}",
        )
    table.caption = (
        "mstar/floor: LLM = KVCacheEngine steps (schedule + forward + sampling), forward = "
        "model + LM head "
        "and sampling; mstar: from the engines' own timers, codec = snac_decoder node steps; "
        "transformers: LLM = generate() per request (runs alongside the codec); steps = "
        "tokens there"
    )
    return table


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
        max_tokens=max_tokens,
        num_requests=args.num_requests,
        warmup=args.warmup,
        temperature=args.temperature,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        codec_batch_size=args.codec_batch_size,
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
