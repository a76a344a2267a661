"""Benchmark BAGEL's CFG loop: mstar against a stage pipeline's dense CFG, same weights.

    python scripts/bench_bagel.py                                   # bagel-small, c = 1, 2, 4, 8
    python scripts/bench_bagel.py --timesteps 10 --concurrency 1,2  # a quick look

Closed loop at each concurrency c, text-to-image and editing (one 256 px input image) in
turn; at least 5 x c measured requests per point after c unmeasured warm-up requests per
target. Three targets hold the same weights and run one after the other on the same requests:

- ``mstar``: `AsyncEngine` serving `BagelModel`. Each request's contexts live in one paged
  cache (the text-free and image-free contexts are forks of the full one), every step of all
  requests in flight runs as one batch, and a step runs only the CFG branches it needs (at the
  default text-to-image schedule, 90 LLM passes instead of 147).
- ``dense_cfg`` (a): what stage pipelines do. One request at a time on one thread (a DiT stage
  serving requests in turn); the contexts prefilled into dense per-layer tensors of their own;
  then every step runs all three branches, each concatenating its context's keys and values
  with the query's into new dense tensors (`DenseContext.velocity`, the same modules and
  attention math as mstar's dense reference); the same guidance, so the same image. Same
  kernels as mstar: the same fused products (oneDNN's packed layout in float32 on a CPU) and
  unmasked attention for full-attention rows.
- ``mstar_all_branches`` (b): mstar with branch skipping off (every branch on every step):
  what skipping buys (mstar vs b) and what paging and batching buy (b vs a).

Where mstar's design saves work at one request: each context is prefilled once (the text-free
one is a fork; (a) encodes and prefills the input image for both contexts that hold it), and
the branches of a step are embedded and projected by the first layer once. The rest of a step
(attention over each context, the MLPs) is the same arithmetic on both sides.

Reported per task and c: latency p50 / p95 and images/s per target, and the ratios. Checks the
targets: text-to-image p50 >= 1.5x lower than (a) at the default schedule, editing p50 >= 1.2x
lower, and at c = 8 images/s >= 1.3x (a)'s. Writes JSON and a PNG per task into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from rich.console import Console

from mstar.baselines.bagel import build_context
from mstar.bench import (
    BenchRequest,
    BenchResult,
    ClosedLoop,
    OutputEvent,
    add_device_argument,
    merge_results,
    plot_png,
    print_table,
    rank_devices,
    run_benchmark,
    write_json,
)
from mstar.runtime import AsyncEngine, EngineConfig, Request
from mstar.zoo.bagel.context import branch_items
from mstar.zoo.bagel.flow import CFG_IMG, CFG_TEXT, COND, FlowSpec, guidance
from mstar.zoo.bagel.latents import decode_image, latent_grid
from mstar.zoo.bagel.model import BagelModel
from mstar.zoo.bagel.nodes import png_bytes

PROMPTS = (
    "a red cube on a table",
    "a lighthouse at dusk",
    "two cats in the snow",
    "a bowl of ramen",
    "a city at night",
)
EDITS = (
    "make it blue",
    "add a hat",
    "turn it into a painting",
    "make it night",
    "remove the background",
)
T2I_P50_TARGET, EDIT_P50_TARGET, THROUGHPUT_TARGET = 1.5, 1.2, 1.3
TARGET_NAMES = ("mstar", "dense_cfg", "mstar_all_branches")


@dataclass(frozen=True)
class Settings:
    """One run's configuration (printed first, recorded in the JSON)."""

    config: str = "bagel-small"
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    tasks: tuple[str, ...] = ("image", "image_edit")
    timesteps: int | None = None  # None: the model's default schedule (50)
    num_requests: int | None = None
    threads: int = 1
    seed: int = 0
    out: str = "results/bagel"
    device: str = "cpu"


def request_data(task: str, seed: int, settings: Settings, size: tuple[int, int]) -> dict[str, Any]:
    """Return one request's data: a prompt (and an input image for edits) drawn from ``seed``."""
    prompts = PROMPTS if task == "image" else EDITS
    data: dict[str, Any] = {"prompt": prompts[seed % len(prompts)], "seed": seed}
    if task == "image_edit":
        data["image"] = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    if settings.timesteps is not None:
        data["num_timesteps"] = settings.timesteps
    return data


class DenseCFG:
    """A stage pipeline's CFG: requests in turn, dense per-context caches, all branches every
    step."""

    def __init__(self, model: BagelModel) -> None:
        self.model = model
        self.weights, self.vae = model.load(torch.device("cpu"))
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="dense-cfg")
        self.lock = asyncio.Lock()
        self.num_passes = 0

    async def generate(self, task: str, data: dict[str, Any]) -> bytes:
        async with self.lock:  # one request at a time, as a stage serves them
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, self._generate, task, data
            )

    @torch.inference_mode()
    def _generate(self, task: str, data: dict[str, Any]) -> bytes:
        prepared = self.model.preprocess(Request(task, data))
        plan, spec = prepared.state, prepared.state.spec
        assert isinstance(spec, FlowSpec)
        contexts = {
            b: build_context(self.weights, self.vae, its)
            for b, its in branch_items(plan.items).items()
        }
        positions = latent_grid(self.weights, spec.height, spec.width)
        x = prepared.inputs["cfg_combine"]["flow"].x
        for k in range(spec.num_steps):
            t, dt = spec.step(k)
            # all three, every step
            v = {b: c.velocity(x, positions, t) for b, c in contexts.items()}
            self.num_passes += 3
            needed = spec.branches(k)
            x = (
                x
                - guidance(
                    spec,
                    v[COND],
                    v[CFG_TEXT] if CFG_TEXT in needed else None,
                    v[CFG_IMG] if CFG_IMG in needed else None,
                )
                * dt
            )
        return png_bytes(decode_image(self.weights, self.vae, x, spec.height, spec.width))


class Run:
    """The targets and the images they returned."""

    def __init__(
        self, settings: Settings, model: BagelModel, engine: AsyncEngine, dense: DenseCFG, task: str
    ) -> None:
        self.settings, self.model, self.engine, self.dense, self.task = (
            settings,
            model,
            engine,
            dense,
            task,
        )
        self.images: dict[tuple[str, str], bytes] = {}

    def data(self, request: BenchRequest) -> dict[str, Any]:
        side = self.model.config.image_size
        return request_data(self.task, int(request.params["seed"]), self.settings, side)

    async def _mstar(
        self, name: str, request: BenchRequest, extra: dict[str, Any]
    ) -> AsyncIterator[OutputEvent]:
        async for out in self.engine.generate(Request(self.task, {**self.data(request), **extra})):
            if out.name == "image":
                self.images[(name, request.request_id)] = out.data
                yield OutputEvent("image", num_images=1, num_bytes=len(out.data))

    def mstar(self, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        return self._mstar("mstar", request, {})

    def mstar_all_branches(self, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        return self._mstar("mstar_all_branches", request, {"skip_branches": False})

    async def dense_cfg(self, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        png = await self.dense.generate(self.task, self.data(request))
        self.images[("dense_cfg", request.request_id)] = png
        yield OutputEvent("image", num_images=1, num_bytes=len(png))


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


def _agreement(images: dict[tuple[str, str], bytes]) -> dict[str, int]:
    """Return the largest pixel difference of each baseline's images from mstar's (same
    requests)."""
    out: dict[str, int] = {}
    for (target, rid), png in images.items():
        if target != "mstar" and ("mstar", rid) in images:
            diff = int(np.abs(_pixels(png) - _pixels(images[("mstar", rid)])).max())
            out[target] = max(out.get(target, 0), diff)
    return out


def _row(result: BenchResult, task: str, c: int) -> dict[str, Any]:
    row: dict[str, Any] = {"task": task, "c": c}
    for p in result.points:
        s = p.summary
        lat = s.image_latency_s or s.e2e_s
        row[p.target] = {
            "p50_s": lat.p50 if lat else None,
            "p95_s": lat.p95 if lat else None,
            "images_per_s": s.images_per_s,
            "failed": s.num_failed,
        }
    for base in ("dense_cfg", "mstar_all_branches"):
        m, b = row["mstar"], row[base]
        if m["p50_s"] and b["p50_s"]:
            row[f"p50_speedup_vs_{base}"] = b["p50_s"] / m["p50_s"]
            row[f"throughput_vs_{base}"] = (
                m["images_per_s"] / b["images_per_s"] if b["images_per_s"] else None
            )
    return row


def _verdicts(rows: Sequence[dict[str, Any]], settings: Settings) -> list[str]:
    lines = []
    default = settings.timesteps is None
    for task, target in (("image", T2I_P50_TARGET), ("image_edit", EDIT_P50_TARGET)):
        for row in rows:
            if row["task"] == task and row["c"] == 1 and "p50_speedup_vs_dense_cfg" in row:
                ok = row["p50_speedup_vs_dense_cfg"] >= target
                note = (
                    "" if default else " (not the default schedule: the target is for 50 timesteps)"
                )
                lines.append(
                    f"{task} p50 at c=1: {row['p50_speedup_vs_dense_cfg']:.2f}x lower than "
                    f"dense_cfg (target {target}x): {'met' if ok else 'MISSED'}{note}"
                )
    for row in rows:
        if row["c"] == 8 and row.get("throughput_vs_dense_cfg"):
            ok = row["throughput_vs_dense_cfg"] >= THROUGHPUT_TARGET
            lines.append(
                f"{row['task']} images/s at c=8: {row['throughput_vs_dense_cfg']:.2f}x "
                f"dense_cfg (target {THROUGHPUT_TARGET}x): {'met' if ok else 'MISSED'}"
            )
    return lines


async def run(settings: Settings, console: Console) -> dict[str, Any]:
    torch.set_num_threads(settings.threads)
    model = BagelModel(settings.config)
    dense = DenseCFG(model)
    out = Path(settings.out)
    rows: list[dict[str, Any]] = []
    agreement: dict[str, dict[str, int]] = {}
    console.print(f"bench_bagel: {json.dumps(asdict(settings))}", highlight=False, markup=False)
    async with await AsyncEngine.start(
        model, None, EngineConfig(devices=rank_devices(settings.device))
    ) as engine:
        for task in settings.tasks:
            runner = Run(settings, model, engine, dense, task)
            templates = [
                BenchRequest(f"{task}{i}", "", params={"seed": settings.seed * 100_000 + i})
                for i in range(64)
            ]
            results = []
            for c in settings.concurrency:
                started = time.perf_counter()
                result = await run_benchmark(
                    {
                        "mstar": runner.mstar,
                        "dense_cfg": runner.dense_cfg,
                        "mstar_all_branches": runner.mstar_all_branches,
                    },
                    templates,
                    ClosedLoop((c,), num_requests=settings.num_requests),
                    name=f"bench_bagel_{task}",
                    seed=settings.seed * 1000 + c,
                    progress=False,
                    console=Console(quiet=True),
                    config={
                        "model": settings.config,
                        "task": task,
                        "timesteps": settings.timesteps or 50,
                    },
                )
                results.append(result)
                rows.append(_row(result, task, c))
                console.print(
                    f"{task} c={c}: point took {time.perf_counter() - started:.0f} s",
                    highlight=False,
                    markup=False,
                )
                write_json(result, out / f"{task}_c{c}.json")
            agreement[task] = _agreement(runner.images)
            print_table(results[-1], console)
            if len(results) > 0:
                try:
                    plot_png(merge_results(results), out / f"{task}.png")
                except Exception as exc:  # the plot is a convenience: the JSON holds the figures
                    console.print(f"no plot for {task}: {exc}", highlight=False, markup=False)
    table = Console(width=160)
    table.print("task        c   target               p50 (s)  p95 (s)  images/s", highlight=False)
    for row in rows:
        for name in TARGET_NAMES:
            r = row[name]
            table.print(
                f"{row['task']:<11} {row['c']:<3} {name:<20} {r['p50_s'] or 0:8.3f} "
                f"{r['p95_s'] or 0:8.3f} {r['images_per_s']:9.3f}",
                highlight=False,
            )
        table.print(
            f"{'':<15} mstar vs dense_cfg: p50 "
            f"{row.get('p50_speedup_vs_dense_cfg', 0):.2f}x, images/s "
            f"{row.get('throughput_vs_dense_cfg') or 0:.2f}x;"
            f" vs all branches: p50 {row.get('p50_speedup_vs_mstar_all_branches', 0):.2f}x",
            highlight=False,
        )
    verdicts = _verdicts(rows, settings)
    for line in verdicts:
        console.print(line, highlight=False, markup=False)
    console.print(
        f"largest pixel difference from mstar's images: {agreement}", highlight=False, markup=False
    )
    summary = {
        "settings": asdict(settings),
        "rows": rows,
        "verdicts": verdicts,
        "agreement": agreement,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--config", default="bagel-small")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated, e.g. 1,2,4,8")
    parser.add_argument("--tasks", default="image,image_edit")
    parser.add_argument(
        "--timesteps", type=int, default=None, help="flow timesteps (default: the model's 50)"
    )
    parser.add_argument(
        "--num-requests", type=int, default=None, help="measured requests per point (default 5 x c)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bagel")
    add_device_argument(parser)
    a = parser.parse_args(argv)
    return Settings(
        a.config,
        tuple(int(c) for c in a.concurrency.split(",")),
        tuple(a.tasks.split(",")),
        a.timesteps,
        a.num_requests,
        a.threads,
        a.seed,
        a.out,
        a.device,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    settings = parse_args(argv)
    return asyncio.run(run(settings, Console()))


if __name__ == "__main__":
    main(sys.argv[1:])
