"""Orpheus TTS without mstar, and its compute floor: what mstar's served Orpheus is timed against.

- `TransformersOrpheus`: what a user writes without mstar. One request at a time (an asyncio
  lock, as a naive server does); tokens from ``LlamaForCausalLM.generate`` running in a thread
  with a streamer, with Orpheus' constrained logits; each 28/7 window decoded with the same
  `SnacCodec` as soon as its tokens arrive.
- `OrpheusFloor` (not a server): the same requests as pure batched `KVCacheEngine` steps, then
  every window as pure codec calls. A served system's efficiency is floor time / its time for
  the same audio.

Equal work: every system masks end of speech (``AudioLogitsProcessor(..., allow_end=False)``,
as served Orpheus does for a request with ``ignore_eos``), so every request produces exactly
``max_tokens`` audio tokens, sampled with the same seed (`request_seed`) everywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.baselines.streaming import QueueStreamer
from mstar.bench import BenchRequest, OutputEvent, make_requests
from mstar.bench.phases import Meter, PointBreakdown
from mstar.engines import KVCacheEngine, SamplingParams
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

__all__ = [
    "FloorResult",
    "OrpheusFloor",
    "SpeechWork",
    "TransformersOrpheus",
    "audio_event",
    "check_num_samples",
    "request_seed",
]


@dataclass(frozen=True)
class SpeechWork:
    """What every request asks of each system: its voice, length and sampling."""

    voice: str = "tara"
    max_tokens: int = 56
    temperature: float = 0.6
    top_p: float = 0.8
    repetition_penalty: float = 1.3
    codec_batch_size: int = 4  # most windows per codec call (the floor)
    samples_per_frame: int = 2048

    @property
    def num_frames(self) -> int:
        """Return the frames each request produces."""
        return self.max_tokens // FRAME_SIZE

    @property
    def samples_per_request(self) -> int:
        """Return the audio samples each request produces."""
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


def audio_event(num_samples: int) -> OutputEvent:
    """Return the harness event of one audio chunk."""
    return OutputEvent("audio", num_samples=num_samples, sample_rate=SAMPLE_RATE)


def check_num_samples(total: int, expected: int, system: str) -> None:
    """Fail the request unless it produced every sample it was asked for (equal work)."""
    if total != expected:
        raise RuntimeError(f"{system} produced {total} samples, expected {expected}")


# --- the transformers baseline -----------------------------------------------------------------


class TransformersOrpheus:
    """Orpheus the way a user serves it without mstar: transformers ``generate`` plus SNAC.

    One request at a time (a lock); ``generate`` runs in a thread and streams token ids;
    each 28/7 window is decoded with SNAC as soon as its tokens are in (same windows, same
    emitted frames, same codec noise seeds as mstar), in a worker thread so the event
    loop keeps receiving tokens. ``meter`` accounts ``llm_generate`` (seconds, tokens) and
    ``codec`` (seconds, windows).
    """

    def __init__(self, cfg: OrpheusConfig, work: SpeechWork, meter: Meter) -> None:
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.cfg, self.work, self.meter = cfg, work, meter
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
        streamer: QueueStreamer,
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

        w = self.work
        # generate() appends custom processors after its own warpers; pass them all here, in
        # Orpheus' order (penalty, constraint, temperature, top-p), and disable the built-in ones.
        processors: list[Any] = []
        if w.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(w.repetition_penalty))
        processors.append(AudioConstraint())
        do_sample = w.temperature > 0
        if do_sample:
            processors.append(TemperatureLogitsWarper(w.temperature))
            if w.top_p < 1.0:
                processors.append(TopPLogitsWarper(w.top_p))
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
            streamer.fail(exc)
        finally:
            self.meter.add("llm_generate", time.perf_counter() - start, max_tokens)

    def _decode(self, windows: Sequence[AudioWindow]) -> list[torch.Tensor]:
        start = time.perf_counter()
        pieces = decode_windows(self.codec, windows)
        self.meter.add("codec", time.perf_counter() - start, len(windows))
        return pieces

    async def stream(self, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        """Serve one request (after the ones before it): stream its audio chunks."""
        w = self.work
        async with self.lock:
            seed = request_seed(request.request_id)
            prompt = self.tokenizer.format_prompt(request.prompt, w.voice)
            queue: asyncio.Queue[Any] = asyncio.Queue()
            cancel = threading.Event()
            streamer = QueueStreamer(asyncio.get_running_loop(), [queue])
            max_tokens = request.max_tokens or w.max_tokens
            thread = threading.Thread(
                target=self._generate,
                args=(prompt, seed, max_tokens, streamer, cancel),
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
                check_num_samples(total, w.samples_per_request, "transformers")
            finally:
                cancel.set()
                await asyncio.to_thread(thread.join)


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

    def breakdown(self) -> PointBreakdown:
        """Return where the floor's time went, as a row named ``floor``."""
        return PointBreakdown(
            "floor",
            self.concurrency,
            self.seconds,
            self.audio_s,
            self.llm_s,
            self.llm_forward_s,
            self.num_steps,
            self.codec_s,
            self.num_windows,
        )


class OrpheusFloor:
    """The same work with no serving around it: `KVCacheEngine` steps and codec calls."""

    def __init__(self, model: OrpheusModel, work: SpeechWork) -> None:
        self.cfg, self.work = model.config, work
        self.engine_config = model.engine_config
        self.llm = load_orpheus_llm(model.config)
        self.codec = load_orpheus_codec(model.config)
        self.tokenizer = OrpheusTokenizer(model.config.layout)

    def run(self, requests: Sequence[BenchRequest], concurrency: int) -> FloorResult:
        """Generate every request c at a time, then decode all their windows; time both."""
        w, layout = self.work, self.cfg.layout
        engine = KVCacheEngine(
            self.llm,
            dataclasses.replace(self.engine_config, max_num_seqs=concurrency),
            device="cpu",
        )
        tokens: dict[str, list[int]] = {}
        for r in requests:
            prompt = self.tokenizer.format_prompt(r.prompt, w.voice)
            params = w.sampling(
                r.max_tokens or w.max_tokens, request_seed(r.request_id), (layout.end_of_speech,)
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
            window
            for rid, ids in tokens.items()
            for window in plan_tokens(ids, layout, self.cfg.noise_seed + request_seed(rid))
        ]
        start = time.perf_counter()
        audio = decode_windows(self.codec, windows, max_batch_size=w.codec_batch_size)
        codec_s = time.perf_counter() - start
        phases = engine.runner.phases.seconds  # the engine's own timers (a new engine per run)
        num_samples = sum(int(a.numel()) for a in audio)
        check_num_samples(num_samples, len(requests) * w.samples_per_request, "the floor")
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

    def warm_up(self, prompt: str) -> None:
        """Run one short request through both halves (allocator, kernels)."""
        warm = make_requests([prompt], max_tokens=4 * FRAME_SIZE, ignore_eos=True)
        work, self.work = self.work, dataclasses.replace(self.work, max_tokens=4 * FRAME_SIZE)
        try:
            self.run(warm, 1)
        finally:
            self.work = work
