"""Qwen3-Omni served without mstar's streaming graph: what the spoken-answer benchmark races.

- `StagePipeline`: what a stage DAG without streaming does, on mstar's own kernels and
  batching: the thinker, the talker and Code2Wav each on a thread of its own, each stage
  taking the requests waiting for it when it is free and running them to its end (the thinker
  to the last answer token, then the talker to the last codec frame, then transformers'
  ``chunked_decode``); stages overlap across batches. A request's text and audio arrive when
  their stage ends.
- `TransformersQwen3Omni`: transformers' own ``Qwen3OmniMoeForConditionalGeneration.generate``,
  one request at a time (all codes, then Code2Wav), its output when it returns.

Both answer the request data `Qwen3OmniModel.preprocess` reads (``text``, ``max_tokens``,
``max_audio_frames``, ``seed``, ...) and stream `mstar.bench.OutputEvent`s: one per text token,
one for the audio.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from mstar.bench.records import OutputEvent
from mstar.engines.interfaces import FiringRows
from mstar.engines.kv_engine import KVCacheEngine
from mstar.runtime import Request
from mstar.streaming import Chunk
from mstar.zoo.qwen3_omni.config import SAMPLE_RATE
from mstar.zoo.qwen3_omni.model import Qwen3OmniModel

__all__ = ["StagePipeline", "TransformersQwen3Omni"]

_Results = list[tuple["asyncio.Future[Any]", Any]]
"""What a stage finishes: futures and their values, set once the stage's step is timed."""


def _text_event() -> OutputEvent:
    return OutputEvent("text", num_tokens=1)


def _audio_event(num_samples: int) -> OutputEvent:
    return OutputEvent("audio", num_samples=num_samples, sample_rate=SAMPLE_RATE)


class StagePipeline:
    """Thinker, then talker, then Code2Wav, each stage over its whole batch, nothing streamed
    between them.

    Each stage works on a thread of its own (the same three step threads and torch threads
    as mstar's ranks), so stages overlap across batches as a stage DAG's do: while the talker
    speaks one batch, the thinker answers the next. A stage takes every request waiting for
    it when it is free.
    """

    STAGES = ("thinker", "talker", "codec")

    def __init__(self, model: Qwen3OmniModel, threads: int) -> None:
        self.model = model
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
                initializer=functools.partial(torch.set_num_threads, threads),
            )
            for stage in self.STAGES
        }
        self.queues: dict[str, list[Any]] = {stage: [] for stage in self.STAGES}
        self.wakeups = {stage: asyncio.Event() for stage in self.STAGES}
        self.timings: list[tuple[str, int, float]] = []  # stage, batch size, wall s
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start serving the stages (on the running event loop)."""
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._serve(stage)) for stage in self.STAGES]

    async def stream(self, request_id: str, data: Mapping[str, Any]) -> AsyncIterator[OutputEvent]:
        """Answer one request (`Qwen3OmniModel`'s request data): its text tokens when the
        thinker stage ends, then its audio when Code2Wav's does."""
        loop = asyncio.get_running_loop()
        text, audio = loop.create_future(), loop.create_future()
        self._put("thinker", (request_id, dict(data), text, audio))
        for _ in range(len(await text)):
            yield _text_event()
        samples = await audio
        if samples:
            yield _audio_event(samples)

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
            results: _Results = []
            try:
                results = await loop.run_in_executor(self.executors[stage], run, loop, batch)
            except Exception as exc:
                for item in batch:
                    for f in (item[2], item[3]):
                        if not f.done():
                            f.set_exception(exc)
            # Timed before the answers it finishes are handed back: a caller that has them
            # sees the stage's timing too.
            self.timings.append((stage, len(batch), time.perf_counter() - started))
            for future, value in results:
                if not future.done():
                    future.set_result(value)
            if self.queues[stage]:
                self.wakeups[stage].set()

    def _fire(
        self, node: Any, engine: KVCacheEngine, work: Mapping[str, Mapping[str, Any]]
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
    def _think(self, loop: asyncio.AbstractEventLoop, batch: list[Any]) -> _Results:
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
            work = {
                "thinker_states": Chunk(tuple(items[rid]), 0, 0, True),
                "talker_params": talker_params[rid],
            }
            loop.call_soon_threadsafe(self._put, "talker", (rid, work, text, audio))
        return [(text, texts[rid]) for rid, _, text, _ in batch]

    @torch.inference_mode()
    def _talk(self, loop: asyncio.AbstractEventLoop, batch: list[Any]) -> _Results:
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
        return []  # handed to the next stage

    @torch.inference_mode()
    def _decode(self, loop: asyncio.AbstractEventLoop, batch: list[Any]) -> _Results:
        """transformers' ``chunked_decode`` (300-frame chunks, 25 of context) of each request's
        codes."""
        code2wav: Any = self.weights.code2wav  # transformers' Qwen3OmniMoeCode2Wav
        results: _Results = []
        for _, frames, _, audio in batch:
            samples = 0
            if frames:
                codes = torch.stack(frames, dim=1)[None]
                samples = int(
                    code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25).numel()
                )
            results.append((audio, samples))
        return results

    def close(self) -> None:
        """Stop the stages and their threads."""
        for task in self.tasks:
            task.cancel()
        for executor in self.executors.values():
            executor.shutdown()


class TransformersQwen3Omni:
    """transformers' own ``generate``, one request at a time: all codes, then Code2Wav."""

    def __init__(self, model: Qwen3OmniModel, threads: int) -> None:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeForConditionalGeneration,
        )
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = model
        self.reference = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            model.checkpoint, dtype=torch.float32
        ).eval()
        self.executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="hf",
            initializer=functools.partial(torch.set_num_threads, threads),
        )
        self.lock = asyncio.Lock()

    def _generate(self, data: Mapping[str, Any]) -> tuple[int, int]:
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

    async def stream(self, request_id: str, data: Mapping[str, Any]) -> AsyncIterator[OutputEvent]:
        """Answer one request after those before it: its text tokens and audio when it returns."""
        async with self.lock:
            loop = asyncio.get_running_loop()
            num_tokens, samples = await loop.run_in_executor(self.executor, self._generate, data)
        for _ in range(num_tokens):
            yield _text_event()
        if samples:
            yield _audio_event(samples)

    def close(self) -> None:
        """Stop the worker thread."""
        self.executor.shutdown()
