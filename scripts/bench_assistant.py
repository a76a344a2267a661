"""Benchmark the spoken assistant: mstar streaming sentences to the voice against a plain pipeline.

    python scripts/bench_assistant.py                   # c = 1, 4, 16; 128-token answers
    python scripts/bench_assistant.py --quick           # c = 1, 2; 64-token answers
    python scripts/bench_assistant.py --concurrency 1 --max-tokens 24 --num-questions 2

Closed loop at each concurrency c: c users, each asks its next question when the spoken
answer to the last one has ended; at least 5 x c measured requests per point, after
``--warmup`` unmeasured ones per target. Questions are drawn (seeded) from a fixed list of
assistant questions whose answers run several sentences. Two targets answer the same
requests, one after the other at every point, with the same checkpoint (SmolLM2-135M-Instruct,
real weights), the same prompt (the assistant's system prompt and chat template), greedy
decoding, the same ``--max-tokens`` and end of turn, and the same Piper voice with its noise
at 0 (speech is a pure function of the text), so both say the same words:

- ``mstar``: `AsyncEngine` serving `AssistantModel` in this process, default placement (the
  LLM on rank 0, the voice on rank 1, each with its own step thread): tokens stream to the
  voice through `SentenceChunkPolicy`, so the first sentence is spoken while the next is
  written, and the LLM batches every user's decode step. Prefix caching is off (unless
  ``--prefix-caching``): the few questions repeat, and real users' questions would not.
- ``pipeline``: what a user writes without mstar. One request at a time (an asyncio lock
  around a one-thread executor, as a naive server does); transformers
  ``LlamaForCausalLM.generate`` (greedy, stopping at the tokenizer's end of turn) to the end,
  then `PiperSpeaker.speak` on the whole text. Its text streams token by token (a
  transformers streamer, as a chat server streams text), so TTFT means the same on both
  sides; its audio is one event once the whole answer is spoken.

Reported per c and target: TTFT p50 / p95, TTFA p50 / p95, RTF p50 (client E2E latency /
audio duration), audio seconds per second, streaming viability; the ratios pipeline / mstar
of TTFA and TTFT p50 and mstar / pipeline of audio s/s; where the pipeline's time goes
(generate, speak); whether both targets wrote the same text for each request (mismatches are
counted; greedy decoding on two implementations can part at a near tie) and how their audio
durations compare (mstar speaks sentence by sentence, the pipeline the whole text). Checks
the target: at c = 1 the pipeline's TTFA p50 >= 3x mstar's. Writes JSON and a PNG into
``--out``.
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
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mstar.baselines.streaming import QueueStreamer
from mstar.bench import (
    BenchRequest,
    BenchResult,
    ClosedLoop,
    OutputEvent,
    json_safe,
    make_requests,
    merge_results,
    plot_png,
    print_table,
    result_to_dict,
    run_benchmark,
)
from mstar.runtime import AsyncEngine, EngineConfig, Request
from mstar.zoo.assistant import AssistantModel, PiperSpeaker, VoiceSettings
from mstar.zoo.assistant.model import SYSTEM_PROMPT
from mstar.zoo.smollm2 import chat_prompt_ids, load_tokenizer, smollm2_checkpoint_dir

QUESTIONS = (
    "Why is the sky blue?",
    "How do airplanes stay in the air?",
    "Give me three tips for better sleep.",
    "How does a refrigerator keep food cold?",
    "What should I pack for a weekend hiking trip?",
    "Why do we have seasons on Earth?",
    "How can I make my morning routine more productive?",
    "What is the difference between weather and climate?",
)
TTFA_RATIO_TARGET = 3.0  # at c = 1: pipeline TTFA p50 >= 3x mstar's
TARGET_NAMES = ("mstar", "pipeline")
BLOCK_SIZE = 16  # the KV engine's default block size


@dataclass(frozen=True)
class Settings:
    """One run's configuration (printed first, recorded in the JSON)."""

    concurrency: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 128
    num_requests: int | None = None
    num_questions: int = len(QUESTIONS)
    warmup: int = 1
    threads: int = 1
    voice_threads: int = 1
    chunk_max_tokens: int = 48
    prefix_caching: bool = False
    seed: int = 0
    out: str = "results/assistant"

    @property
    def questions(self) -> tuple[str, ...]:
        """Return the questions requests are drawn from."""
        return QUESTIONS[: self.num_questions]


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """Return a question's prompt as the assistant builds it: system prompt, chat template."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return chat_prompt_ids(tokenizer, messages)


def text_event() -> OutputEvent:
    """Return the harness event of one text token."""
    return OutputEvent("text", num_tokens=1)


def audio_event(num_samples: int, sample_rate: int) -> OutputEvent:
    """Return the harness event of one audio chunk."""
    return OutputEvent("audio", num_samples=num_samples, sample_rate=sample_rate)


@dataclass
class Answer:
    """What one target answered to one request: its text and how much it said."""

    question: str
    text: str
    num_tokens: int
    num_samples: int


# --- the plain pipeline ------------------------------------------------------------------------


class PlainPipeline:
    """The assistant without mstar: ``generate`` to the end, then the voice on the whole text.

    One request at a time: an asyncio lock around a one-thread executor (with the run's
    torch threads: a new thread's OpenMP pool would start at every core).
    """

    def __init__(self, checkpoint_dir: Path, tokenizer: Any, settings: Settings) -> None:
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.tokenizer, self.settings = tokenizer, settings
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.model = LlamaForCausalLM.from_pretrained(
            str(checkpoint_dir), dtype=torch.float32
        ).eval()
        self.speaker = PiperSpeaker(
            settings=VoiceSettings(0.0, 0.0, threads=settings.voice_threads)
        )
        self.sample_rate = self.speaker.sample_rate
        self.executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="pipeline",
            initializer=functools.partial(torch.set_num_threads, settings.threads),
        )
        self.lock = asyncio.Lock()
        self.timings: dict[str, tuple[float, float]] = {}  # request id -> (generate s, speak s)

    def generate(self, prompt: list[int], max_tokens: int, streamer: QueueStreamer) -> list[int]:
        """Return the answer's token ids (greedy, to the end of turn); stream them meanwhile."""
        ids = torch.tensor([prompt])
        try:
            with torch.inference_mode():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_tokens,
                    eos_token_id=self.eos_token_id,
                    pad_token_id=self.eos_token_id,
                    streamer=streamer,
                )
        finally:
            streamer.end()  # also when generate raised: the request must not wait forever
        return [int(t) for t in out[0, len(prompt) :].tolist()]

    async def stream(self, request: BenchRequest) -> AsyncIterator[OutputEvent | Answer]:
        """Serve one request after those before it: its tokens as they come, then its speech."""
        async with self.lock:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[int | None] = asyncio.Queue()
            max_tokens = request.max_tokens or self.settings.max_tokens
            prompt = prompt_ids(self.tokenizer, request.prompt)
            start = time.perf_counter()
            generating = loop.run_in_executor(
                self.executor, self.generate, prompt, max_tokens, QueueStreamer(loop, [queue])
            )
            while await queue.get() is not None:
                yield text_event()
            token_ids = await generating
            generated = time.perf_counter()
            text = str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
            audio = await loop.run_in_executor(self.executor, self.speaker.speak, text)
            self.timings[request.request_id] = (generated - start, time.perf_counter() - generated)
            if audio.size:
                yield audio_event(int(audio.size), self.sample_rate)
            yield Answer(request.prompt, text, len(token_ids), int(audio.size))

    def close(self) -> None:
        """Stop the worker thread."""
        self.executor.shutdown()


# --- the run -----------------------------------------------------------------------------------


@dataclass
class Run:
    """The targets, what they answered and what the harness measured."""

    settings: Settings
    engine: AsyncEngine
    pipeline: PlainPipeline
    tokenizer: Any
    sample_rate: int
    answers: dict[tuple[str, str], Answer] = dataclasses.field(default_factory=dict)
    results: list[BenchResult] = dataclasses.field(default_factory=list)

    async def mstar_target(self, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        data = {"text": request.prompt, "temperature": 0.0, "max_tokens": request.max_tokens}
        token_ids: list[int] = []
        num_samples = 0
        async for out in self.engine.generate(Request("generate", data)):
            if out.modality == "text":
                token_ids.append(int(out.data))
                yield text_event()
            elif out.modality == "audio" and out.data.numel():
                num_samples += int(out.data.numel())
                yield audio_event(int(out.data.numel()), self.sample_rate)
        text = str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
        self.answers[("mstar", request.request_id)] = Answer(
            request.prompt, text, len(token_ids), num_samples
        )

    async def pipeline_target(self, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        async for item in self.pipeline.stream(request):
            if isinstance(item, Answer):
                self.answers[("pipeline", request.request_id)] = item
            else:
                yield item

    async def point(self, c: int, templates: Sequence[BenchRequest], console: Console) -> None:
        """Measure both targets at concurrency c."""
        s = self.settings
        started = time.perf_counter()
        result = await run_benchmark(
            {"mstar": self.mstar_target, "pipeline": self.pipeline_target},
            templates,
            ClosedLoop((c,), num_requests=s.num_requests, warmup=s.warmup),
            name="bench_assistant",
            seed=s.seed * 1000 + c,
            progress=False,
            console=Console(quiet=True),
        )
        self.results.append(result)
        for p in result.points:
            errors = sorted({r.error for r in p.records if r.error})
            if errors:
                console.print(f"  {p.target} errors: {errors[:3]}", highlight=False, markup=False)
        text = ", ".join(
            f"{p.target} "
            f"{p.summary.num_requests - p.summary.num_failed}/{p.summary.num_requests} ok "
            f"in {p.summary.duration_s:.1f} s"
            for p in result.points
        )
        console.print(
            f"c={c}: {text} (point took {time.perf_counter() - started:.0f} s)",
            highlight=False,
            markup=False,
        )


async def run(settings: Settings, console: Console) -> dict[str, Any]:
    """Run every point (mstar, then the pipeline); print and write the results."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return await _run(settings, console)
    finally:
        torch.set_num_threads(threads_before)


async def _run(settings: Settings, console: Console) -> dict[str, Any]:
    checkpoint = smollm2_checkpoint_dir()
    tokenizer = load_tokenizer(checkpoint)
    engine_config = _kv_config(settings, tokenizer)
    model = AssistantModel(
        max_tokens=settings.max_tokens,
        chunk_max_tokens=settings.chunk_max_tokens,
        noise_scale=0.0,
        noise_w_scale=0.0,
        voice_threads=settings.voice_threads,
        engine_config=engine_config,
    )
    config = _describe(settings, model, engine_config)
    console.print("[bold]bench_assistant[/bold]: configuration")
    for key, value in config.items():
        console.print(f"  {key}: {value}", highlight=False, markup=False)
    pipeline = PlainPipeline(checkpoint, tokenizer, settings)
    engine = await AsyncEngine.start(model, None, EngineConfig(cpu_threads=settings.threads))
    bench = Run(settings, engine, pipeline, tokenizer, model.audio_sample_rate)
    templates = make_requests(list(settings.questions), max_tokens=settings.max_tokens)
    try:
        for c in settings.concurrency:
            await bench.point(c, templates, console)
    finally:
        await engine.shutdown()
        pipeline.close()
    merged = merge_results(bench.results, config)
    print_table(merged, console)
    rows = _summary(merged, pipeline.timings, console)
    agreement = _agreement(bench.answers, bench.sample_rate, console)
    verdicts = _verdicts(rows, console)
    data = result_to_dict(merged)
    data["assistant"] = json_safe(
        {
            "settings": dataclasses.asdict(settings),
            "summary": rows,
            "agreement": agreement,
            "verdicts": verdicts,
        }
    )
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench_assistant.json"
    json_path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    png_path = plot_png(merged, out / "bench_assistant.png")
    console.print(f"wrote {json_path} and {png_path}", highlight=False, markup=False)
    return data


def _kv_config(settings: Settings, tokenizer: Any) -> dict[str, Any]:
    # Cache for the largest concurrency at the longest prompt plus the answer, not the 1 GiB
    # default: the benchmark shares its machine. Prefix caching is off unless asked for: the
    # requests repeat a few questions, whose prompts would be served from the cache, as the
    # distinct questions of real users are not (the pipeline has no cache either).
    longest = max(len(prompt_ids(tokenizer, q)) for q in settings.questions)
    blocks_per_seq = -(-(longest + settings.max_tokens) // BLOCK_SIZE)
    return {
        "max_num_seqs": max(settings.concurrency),
        "num_blocks": blocks_per_seq * max(settings.concurrency) + 8,
        "enable_prefix_caching": settings.prefix_caching,
    }


def _describe(
    settings: Settings, model: AssistantModel, engine_config: Mapping[str, Any]
) -> dict[str, Any]:
    hf = model.llm.hf_config
    return {
        "settings": dataclasses.asdict(settings),
        "model": f"SmolLM2-135M-Instruct (real weights, Q4_1 dequantised to float32): hidden "
        f"{hf['hidden_size']}, {hf['num_hidden_layers']} layers; Piper en_US-joe-medium voice, "
        f"{model.audio_sample_rate} Hz, noise 0 / 0 (deterministic)",
        "requests": f"{settings.num_questions} questions, greedy, max_tokens "
        f"{settings.max_tokens}, "
        f"stop at end of turn {model.eos_token_ids}; system prompt {SYSTEM_PROMPT!r}",
        "load": f"closed loop, concurrency {list(settings.concurrency)}, measured requests "
        "per point "
        f"max({settings.num_requests or 0}, 5 x c), warm-up {settings.warmup} per target "
        "(not measured)",
        "mstar": f"AsyncEngine in process, default placement (LLM rank 0, voice rank 1); "
        f"{model.policy}; KV {dict(engine_config)}; cpu_threads {settings.threads}",
        "pipeline": "one request at a time (asyncio lock + one-thread executor); "
        "LlamaForCausalLM.generate (greedy, text streamed) to the end, then PiperSpeaker.speak "
        "on the whole text (one audio event)",
        "threads": f"torch {settings.threads} (LLM, both targets), voice {settings.voice_threads} "
        "(onnxruntime, both targets)",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
    }


def _ratio(numerator: float, denominator: float) -> float:
    if math.isnan(numerator) or math.isnan(denominator) or not denominator:
        return math.nan
    return numerator / denominator


def _summary(
    result: BenchResult, timings: Mapping[str, tuple[float, float]], console: Console
) -> dict[str, dict[str, Any]]:
    table = Table(title="assistant per concurrency (RTF = client E2E latency / audio duration)")
    headers = (
        "c|target|ok|TTFT p50 ms|TTFT p95 ms|TTFA p50 ms|TTFA p95 ms|RTF p50|audio s/s|viable %"
    )
    for header in headers.split("|"):
        table.add_column(header, justify="left" if header == "target" else "right")
    ratios = Table(title="pipeline / mstar (> 1: mstar better)")
    for header in ("c", "TTFA p50", "TTFT p50", "E2E p50", "audio s/s (mstar / pipeline)"):
        ratios.add_column(header, justify="right")

    def stat(value: Any, field: str) -> float:
        return math.nan if value is None else float(getattr(value, field))

    def ms(value: float) -> str:
        return "-" if math.isnan(value) else f"{1e3 * value:.0f}"

    rows: dict[str, dict[str, Any]] = {}
    for point in result.load_points:
        c = int(point)
        row: dict[str, Any] = {}
        for target in result.targets:
            s = result.result(target, point).summary
            r = row[target] = {
                "num_requests": s.num_requests,
                "num_failed": s.num_failed,
                "ttft_p50_s": stat(s.ttft_s, "p50"),
                "ttft_p95_s": stat(s.ttft_s, "p95"),
                "ttfa_p50_s": stat(s.ttfa_s, "p50"),
                "ttfa_p95_s": stat(s.ttfa_s, "p95"),
                "e2e_p50_s": stat(s.e2e_s, "p50"),
                "rtf_p50": stat(s.rtf, "p50"),
                "audio_s": s.audio_s,
                "audio_s_per_s": s.audio_s_per_s,
                "viable": math.nan if s.viable_fraction is None else s.viable_fraction,
            }
            table.add_row(
                str(c),
                target,
                f"{s.num_requests - s.num_failed}/{s.num_requests}",
                ms(r["ttft_p50_s"]),
                ms(r["ttft_p95_s"]),
                ms(r["ttfa_p50_s"]),
                ms(r["ttfa_p95_s"]),
                "-" if math.isnan(r["rtf_p50"]) else f"{r['rtf_p50']:.3f}",
                f"{r['audio_s_per_s']:.2f}",
                "-" if math.isnan(r["viable"]) else f"{100 * r['viable']:.0f}",
            )
        table.add_section()
        m, p = row["mstar"], row["pipeline"]
        row["ttfa_p50_ratio"] = _ratio(p["ttfa_p50_s"], m["ttfa_p50_s"])
        row["ttft_p50_ratio"] = _ratio(p["ttft_p50_s"], m["ttft_p50_s"])
        row["e2e_p50_ratio"] = _ratio(p["e2e_p50_s"], m["e2e_p50_s"])
        row["audio_s_per_s_ratio"] = _ratio(m["audio_s_per_s"], p["audio_s_per_s"])
        ratios.add_row(
            str(c),
            *(
                "-" if math.isnan(row[k]) else f"{row[k]:.2f}x"
                for k in (
                    "ttfa_p50_ratio",
                    "ttft_p50_ratio",
                    "e2e_p50_ratio",
                    "audio_s_per_s_ratio",
                )
            ),
        )
        # Where the pipeline's time goes: each request generates, then speaks (its TTFA is
        # the wait for the lock plus both).
        spent = [t for rid, t in timings.items() if rid.startswith(f"concurrency-{c}-")]
        row["pipeline_generate_s_mean"] = (
            sum(g for g, _ in spent) / len(spent) if spent else math.nan
        )
        row["pipeline_speak_s_mean"] = sum(v for _, v in spent) / len(spent) if spent else math.nan
        rows[str(c)] = row
    console.print(table)
    console.print(ratios)
    for label, row in rows.items():
        console.print(
            f"  c={label} pipeline per request: generate {row['pipeline_generate_s_mean']:.2f} s, "
            f"speak {row['pipeline_speak_s_mean']:.2f} s (mean over measured requests)",
            highlight=False,
            markup=False,
        )
    return rows


def _agreement(
    answers: Mapping[tuple[str, str], Answer], sample_rate: int, console: Console
) -> dict[str, Any]:
    pairs = [
        (rid, ours, answers[("pipeline", rid)])
        for (who, rid), ours in answers.items()
        if who == "mstar" and ("pipeline", rid) in answers
    ]
    mismatched = [(rid, a, b) for rid, a, b in pairs if a.text != b.text]
    duration_ratios = [a.num_samples / b.num_samples for _, a, b in pairs if b.num_samples]
    agreement: dict[str, Any] = {
        "num_compared": len(pairs),
        "num_text_mismatches": len(mismatched),
        "mismatches": [
            {"request_id": rid, "question": a.question, "mstar": a.text, "pipeline": b.text}
            for rid, a, b in mismatched[:3]
        ],
        "mstar_audio_s": sum(a.num_samples for _, a, _ in pairs) / sample_rate,
        "pipeline_audio_s": sum(b.num_samples for _, _, b in pairs) / sample_rate,
        "audio_duration_ratio_min": min(duration_ratios, default=math.nan),
        "audio_duration_ratio_max": max(duration_ratios, default=math.nan),
    }
    console.print(
        f"same text: {len(pairs) - len(mismatched)}/{len(pairs)} requests "
        f"({len(mismatched)} mismatches); audio mstar {agreement['mstar_audio_s']:.1f} s vs "
        f"pipeline {agreement['pipeline_audio_s']:.1f} s (per request mstar / pipeline in "
        f"[{agreement['audio_duration_ratio_min']:.3f}, "
        f"{agreement['audio_duration_ratio_max']:.3f}])",
        highlight=False,
        markup=False,
    )
    for m in agreement["mismatches"]:
        console.print(
            f"  mismatch {m['request_id']} ({m['question']!r}):\n    mstar:    {m['mstar']!r}\n"
            f"    pipeline: {m['pipeline']!r}",
            highlight=False,
            markup=False,
        )
    return agreement


def _verdicts(rows: Mapping[str, Mapping[str, Any]], console: Console) -> dict[str, Any]:
    value = rows["1"]["ttfa_p50_ratio"] if "1" in rows else math.nan
    met = None if math.isnan(value) else bool(value >= TTFA_RATIO_TARGET)
    status = "n/a " if met is None else ("PASS" if met else "MISS")
    console.print(
        f"target: {status} at c=1 pipeline TTFA p50 / mstar TTFA p50 >= {TTFA_RATIO_TARGET:g}x: "
        f"{value:.2f}x",
        highlight=False,
        markup=False,
    )
    return {"ttfa_p50_c1": {"value": value, "target": TTFA_RATIO_TARGET, "met": met}}


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """Parse the command line into `Settings` (explicit flags win over ``--quick``)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--concurrency",
        default=None,
        help="closed-loop concurrencies, comma-separated (default 1,4,16; --quick 1,2)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="most answer tokens (default 128; --quick 64)"
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="measured requests per point (at least 5 x c)",
    )
    p.add_argument(
        "--num-questions",
        type=int,
        default=len(QUESTIONS),
        help=f"draw requests from the first N of the {len(QUESTIONS)} questions",
    )
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per point and target")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the LLM (both targets)")
    p.add_argument(
        "--voice-threads",
        type=int,
        default=1,
        help="onnxruntime threads of the voice (both targets)",
    )
    p.add_argument(
        "--chunk-max-tokens", type=int, default=48, help="most tokens mstar's voice waits for"
    )
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="let mstar share the KV blocks of repeated prompts (off: every prompt is prefilled)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/assistant", help="directory for the JSON and PNG")
    p.add_argument("--quick", action="store_true", help="concurrency 1,2 and 64-token answers")
    args = p.parse_args(argv)
    concurrency = args.concurrency or ("1,2" if args.quick else "1,4,16")
    max_tokens = args.max_tokens if args.max_tokens is not None else (64 if args.quick else 128)
    try:
        levels = tuple(int(c) for c in concurrency.split(","))
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {concurrency!r}")
    if not levels or min(levels) < 1:
        p.error("--concurrency values must be >= 1")
    if not 1 <= max_tokens <= 1024:
        p.error(f"--max-tokens must be in [1, 1024], got {max_tokens}")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if not 1 <= args.num_questions <= len(QUESTIONS):
        p.error(f"--num-questions must be in [1, {len(QUESTIONS)}], got {args.num_questions}")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    for flag, value in (
        ("--threads", args.threads),
        ("--voice-threads", args.voice_threads),
        ("--chunk-max-tokens", args.chunk_max_tokens),
    ):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    return Settings(
        concurrency=levels,
        max_tokens=max_tokens,
        num_requests=args.num_requests,
        num_questions=args.num_questions,
        warmup=args.warmup,
        threads=args.threads,
        voice_threads=args.voice_threads,
        chunk_max_tokens=args.chunk_max_tokens,
        prefix_caching=args.prefix_caching,
        seed=args.seed,
        out=args.out,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark from the command line; return what it wrote to JSON."""
    settings = parse_args(argv)
    start = time.perf_counter()
    data = asyncio.run(run(settings, Console(width=160)))
    print(f"total {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return data


def _num_failed(data: Mapping[str, Any]) -> int:
    return sum(int(r["summary"]["num_failed"]) for r in data["results"])


if __name__ == "__main__":
    sys.exit(0 if _num_failed(main()) == 0 else 1)
