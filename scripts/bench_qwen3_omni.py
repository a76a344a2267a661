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
- ``stage``: what a stage DAG without streaming does, on mstar's own kernels and batching,
  with the same three step threads: each stage takes the requests waiting for it when it is
  free and runs them to its end, the thinker (its nodes on one `KVCacheEngine`, every step
  batched), then the talker (batched steps, one code-predictor batch per step), then Code2Wav
  (transformers' ``chunked_decode``, 300-frame chunks, 25 of context); stages overlap across
  batches. Its text and audio arrive when their stage ends.
- ``transformers`` (``--transformers``): ``Qwen3OmniMoeForConditionalGeneration.generate``
  one request at a time (all codes, then Code2Wav), its output when it returns.

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
import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

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
from mstar.engines.interfaces import FiringRows
from mstar.engines.kv_engine import KVCacheEngine
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


# --- where the CPU goes ----------------------------------------------------------------------

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


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """Return every live thread's CPU seconds so far, by thread id."""
    out: dict[int, tuple[str, float]] = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            out[thread.ident] = (thread.name, time.clock_gettime(clock))
        except (OSError, ProcessLookupError):  # the thread just ended
            continue
    return out


class CpuAccount:
    """CPU seconds per component while a target has requests in flight, and the audio it made.

    The load generator runs one target at a time, so a target's windows (first request in
    flight to last one out, warmup included) hold only its own work; the threads of the
    targets not running stay idle and are not counted, nor is a thread that ends inside a
    window (every step thread lives for the whole run).
    """

    def __init__(self) -> None:
        self.active: dict[str, int] = {}
        self.since: dict[str, tuple[float, dict[int, tuple[str, float]]]] = {}
        self.cpu: dict[str, dict[str, float]] = {}
        self.wall: dict[str, float] = {}
        self.samples: dict[str, int] = {}

    def wrap(self, target: str, fn: Any) -> Any:
        async def stream(request: BenchRequest) -> AsyncIterator[OutputEvent]:
            self._enter(target)
            try:
                async for event in fn(request):
                    if event.num_samples:
                        self.samples[target] = self.samples.get(target, 0) + event.num_samples
                    yield event
            finally:
                self._exit(target)

        return stream

    def _enter(self, target: str) -> None:
        if not self.active.get(target):
            self.since[target] = (time.perf_counter(), _thread_cpu())
        self.active[target] = self.active.get(target, 0) + 1

    def _exit(self, target: str) -> None:
        self.active[target] -= 1
        if self.active[target]:
            return
        started, before = self.since.pop(target)
        self.wall[target] = self.wall.get(target, 0.0) + time.perf_counter() - started
        cpu = self.cpu.setdefault(target, {})
        prefixes = COMPONENTS.get(target, ())
        for ident, (name, now) in _thread_cpu().items():
            used = now - before.get(ident, (name, 0.0))[1]
            if name == "MainThread":
                component = "loop"
            else:
                component = next((c for p, c in prefixes if name.startswith(p)), None) or (
                    "other"
                    if not any(name.startswith(p) for ps in COMPONENTS.values() for p, _ in ps)
                    else ""
                )
            if component:  # another target's threads: idle now, not this target's
                cpu[component] = cpu.get(component, 0.0) + used

    def take(self) -> dict[str, dict[str, float]]:
        """Return per target: ms of CPU per audio second per component, the total, and cores busy;
        reset."""
        out: dict[str, dict[str, float]] = {}
        for target, cpu in self.cpu.items():
            audio_s = self.samples.get(target, 0) / 24_000
            row = {k: 1e3 * v / audio_s if audio_s else math.nan for k, v in sorted(cpu.items())}
            row["total"] = 1e3 * sum(cpu.values()) / audio_s if audio_s else math.nan
            wall = self.wall.get(target, 0.0)
            row["cores_busy"] = sum(cpu.values()) / wall if wall else math.nan
            out[target] = row
        self.cpu, self.wall, self.samples = {}, {}, {}
        return out


def _text() -> OutputEvent:
    return OutputEvent("text", num_tokens=1)


def _audio(num_samples: int) -> OutputEvent:
    return OutputEvent("audio", num_samples=num_samples, sample_rate=24_000)


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


# --- the stage pipeline ------------------------------------------------------------------------


class StagePipeline:
    """Thinker, then talker, then Code2Wav, each stage over its whole batch, nothing streamed
    between them.

    Each stage works on a thread of its own (the same three step threads and torch threads
    as mstar's ranks), so stages overlap across batches as a stage DAG's do: while the talker
    speaks one batch, the thinker answers the next. A stage takes every request waiting for
    it when it is free.
    """

    STAGES = ("thinker", "talker", "codec")

    def __init__(self, model: Qwen3OmniModel, settings: Settings) -> None:
        self.model, self.settings = model, settings
        device = torch.device("cpu")
        self.thinker = model.submodule("thinker", device)
        self.talker = model.submodule("talker", device)
        self.weights = model.load_weights(device)
        # One engine per stage for the whole run (its cache is allocated once, as mstar's is).
        self.thinker_engine = KVCacheEngine(self.thinker.model, self.thinker.engine_config)
        self.talker_engine = KVCacheEngine(self.talker.model, self.talker.engine_config)
        self.executors = {
            stage: ThreadPoolExecutor(
                1,
                thread_name_prefix=f"stage-{stage}",
                initializer=functools.partial(torch.set_num_threads, settings.threads),
            )
            for stage in self.STAGES
        }
        self.queues: dict[str, list[Any]] = {stage: [] for stage in self.STAGES}
        self.wakeups = {stage: asyncio.Event() for stage in self.STAGES}
        self.timings: list[tuple[str, int, float]] = []  # stage, batch size, wall s
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._serve(stage)) for stage in self.STAGES]

    async def stream(self, settings: Settings, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        loop = asyncio.get_running_loop()
        text, audio = loop.create_future(), loop.create_future()
        self._put("thinker", (request.request_id, request_data(settings, request), text, audio))
        for _ in range(len(await text)):
            yield _text()
        samples = await audio
        if samples:
            yield _audio(samples)

    def _put(self, stage: str, item: Any) -> None:
        self.queues[stage].append(item)
        self.wakeups[stage].set()

    async def _serve(self, stage: str) -> None:
        loop = asyncio.get_running_loop()
        run = {"thinker": self._think, "talker": self._talk, "codec": self._decode}[stage]
        while True:
            await self.wakeups[stage].wait()
            self.wakeups[stage].clear()
            for _ in range(8):  # let the requests arriving together join the batch
                await asyncio.sleep(0)
            batch, self.queues[stage] = self.queues[stage], []
            if not batch:
                continue
            started = time.perf_counter()
            try:
                await loop.run_in_executor(self.executors[stage], run, loop, batch)
            except Exception as exc:
                for item in batch:
                    for f in (item[2], item[3]):
                        if not f.done():
                            f.set_exception(exc)
            self.timings.append((stage, len(batch), time.perf_counter() - started))
            if self.queues[stage]:
                self.wakeups[stage].set()

    def _fire(
        self, node: Any, engine: KVCacheEngine, work: dict[str, Mapping[str, Any]]
    ) -> dict[str, Mapping[str, Any]]:
        """Fire ``node`` once for every request of ``work`` in shared engine steps; return each
        one's outputs."""
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
    def _think(self, loop: asyncio.AbstractEventLoop, batch: list[Any]) -> None:
        """The thinker to the end of every answer of the batch; then the batch waits for the
        talker."""
        inputs: dict[str, dict[str, Any]] = {}
        talker_params: dict[str, Any] = {}
        for rid, data, _, _ in batch:
            prepared = self.model.preprocess(Request("generate", data, rid))
            inputs[rid] = dict(prepared.inputs["thinker"])
            talker_params[rid] = prepared.inputs["talker"]["talker_params"]
        texts: dict[str, list[int]] = {rid: [] for rid in inputs}
        items: dict[str, list[Any]] = {rid: [] for rid in inputs}
        # The prompt's segments but the last, as forward firings batched across requests.
        active = {rid: x for rid, x in inputs.items() if len(x["segments"]) > 1}
        while active:
            outs = self._fire(self.thinker, self.thinker_engine, active)
            for rid, out in outs.items():
                if "thinker_states" in out:
                    items[rid].append(out["thinker_states"])
                inputs[rid]["cursor"] = out["cursor"]
                if int(out["cursor"]) == len(inputs[rid]["segments"]) - 1:
                    active.pop(rid)
        # Then every answer as a token walk, in shared engine steps.
        engine = self.thinker_engine
        for rid, x in inputs.items():
            turn = self.thinker.turn(rid, x, is_first=not engine.has_request(rid))
            args = {"logits_processor": turn.logits_processor, "return_rows": turn.return_rows}
            if engine.has_request(rid):
                engine.resume(rid, turn.new_token_ids, turn.sampling_params, **args)
            else:
                engine.add_request(
                    rid, turn.new_token_ids, turn.sampling_params, keep_alive=True, **args
                )
        while engine.has_unfinished():
            for o in engine.step():
                if o.error is not None:
                    raise o.error
                history = list(engine.get_sequence(o.request_id).token_ids) if o.finished else None
                rows = {} if o.hidden is None else {"rows": o.hidden}
                out = self.thinker.outputs(o.request_id, o.new_token_ids[0], history, **rows)
                texts[o.request_id].append(int(out["text"]))
                if "thinker_states" in out:
                    items[o.request_id].append(out["thinker_states"])
        for rid in inputs:
            self.thinker.release(rid)
            self.thinker_engine.abort(rid)
        for rid, _, text, audio in batch:
            loop.call_soon_threadsafe(text.set_result, texts[rid])
            work = {
                "thinker_states": Chunk(tuple(items[rid]), 0, 0, True),
                "talker_params": talker_params[rid],
            }
            loop.call_soon_threadsafe(self._put, "talker", (rid, work, text, audio))

    @torch.inference_mode()
    def _talk(self, loop: asyncio.AbstractEventLoop, batch: list[Any]) -> None:
        """The talker over all of each answer's text, every step batched; then Code2Wav's turn."""
        frames: dict[str, list[torch.Tensor]] = {rid: [] for rid, *_ in batch}
        work = {rid: inputs for rid, inputs, _, _ in batch}
        while work:
            outs = self._fire(self.talker, self.talker_engine, work)
            for rid, out in outs.items():
                if "codes" in out:
                    frames[rid].append(out["codes"])
                if out.get("stop"):
                    work.pop(rid)
        for rid, _, text, audio in batch:
            self.talker.release(rid)
            self.talker_engine.abort(rid)
            loop.call_soon_threadsafe(self._put, "codec", (rid, frames[rid], text, audio))

    @torch.inference_mode()
    def _decode(self, loop: asyncio.AbstractEventLoop, batch: list[Any]) -> None:
        """transformers' ``chunked_decode`` (300-frame chunks, 25 of context) of each request's
        codes."""
        code2wav = self.weights.code2wav
        for _, frames, _, audio in batch:
            samples = 0
            if frames:
                codes = torch.stack(frames, dim=1)[None]
                samples = int(
                    code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25).numel()
                )
            loop.call_soon_threadsafe(audio.set_result, samples)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for executor in self.executors.values():
            executor.shutdown()


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
        ids, _ = self.model.prompt(data)
        torch.manual_seed(int(data["seed"]))
        with torch.inference_mode():
            sequences, wav = self.reference.generate(
                input_ids=torch.tensor([ids]),
                thinker_max_new_tokens=data["max_tokens"],
                thinker_do_sample=False,
                thinker_eos_token_id=self.model.eos_token_ids[0],
                talker_max_new_tokens=data["max_audio_frames"],
                talker_do_sample=True,
            )
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
    stage = StagePipeline(Qwen3OmniModel(settings.config, colocated=True), settings)
    reference = TransformersTarget(model, settings) if settings.transformers else None
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
    account = CpuAccount()
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
    reference: TransformersTarget | None,
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
        "stage": account.wrap("stage", functools.partial(stage.stream, settings)),
    }
    if reference is not None:
        targets["transformers"] = account.wrap(
            "transformers", functools.partial(reference.stream, settings)
        )
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
