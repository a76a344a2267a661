"""Benchmark pi0.5 serving many DROID robots: mstar against an openpi-style server, same weights.

    python scripts/bench_pi05.py                                  # pi05-small, c = 1, 4, 16
    python scripts/bench_pi05.py --config pi05-tiny --concurrency 1,2   # a few seconds

Closed loop at each concurrency c: c robots, each sends its next observation when its last
action chunk arrived; at least 5 x c measured requests per point, after c unmeasured warm-up
requests per target. Two targets hold the same weights (each its own copy: the engine stores its
products fused, in the layouts that multiply fastest) and run one after the other at every
point, on the same requests:

- ``mstar``: `AsyncEngine` serving `Pi05Model` in this process. Each robot's prefix (SigLIP
  image tokens and the prompt with the binned state) is written once into the paged KV cache;
  the ten Euler steps of all robots in flight run as one batch per step.
- ``openpi``: what openpi's policy server does. One request at a time (an asyncio lock around
  a one-thread executor, as its synchronous websocket server serves one ``infer`` after the
  other); the same `Pi05Model.preprocess`; then a plain-torch sampler with batch 1
  (`mstar.baselines.pi05.DenseKVSampler`): the prefix once through the VLM layers keeping
  every layer's K/V in dense tensors (openpi's ``sample_actions`` with ``use_cache``), then
  ten Euler steps in which the action expert attends to [cached prefix K/V ; its own K/V];
  the same postprocessing (`Pi05Model.postprocess`).

A request is a DROID observation drawn from a seed (two uint8 cameras at the model's image
size, 7 joint positions, the gripper, one of a few task prompts) and the ``seed`` that fixes
its noise, so both targets must return the same actions: the script compares them (max |diff|).

Reported per c: JCT (sending an observation to receiving its action chunk) p50 / p95,
actions/s (= action chunks/s x horizon, one action per control step), the share of requests
within DROID's 530 ms control budget, the ratios mstar / openpi, and where each target's time
goes (mstar: the engines' own step and phase timers, read with ``AsyncEngine.stats()`` around
each point's measured requests; openpi: its own timers). Checks the targets: at c = 16 mstar
>= 3x openpi's actions/s; at c = 1 mstar's JCT p50 <= 1.1x openpi's. For scale it also counts
one chunk's FLOPs (matmuls) and times a float32 GEMM at the run's threads: each target's
GFLOP/s as a share of that peak, and the most any server could beat openpi by (peak / openpi's
GFLOP/s). Writes JSON and a PNG into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from mstar.baselines.pi05 import OpenpiServer, chunk_flops
from mstar.bench import (
    BenchRequest,
    BenchResult,
    ClosedLoop,
    Counters,
    CounterWindow,
    OutputEvent,
    add_device_argument,
    engine_counters,
    figures_delta,
    is_warmup,
    json_safe,
    merge_results,
    print_table,
    rank_devices,
    result_to_dict,
    run_benchmark,
)
from mstar.bench.machine import measure_flops
from mstar.runtime import AsyncEngine, EngineConfig, Request
from mstar.zoo.pi05.model import Pi05Model
from mstar.zoo.pi05.policy import (
    EXTERIOR_IMAGE_KEY,
    GRIPPER_POSITION_KEY,
    JOINT_POSITION_KEY,
    PROMPT_KEY,
    WRIST_IMAGE_KEY,
)

TASKS = (
    "pick up the cup",
    "open the drawer",
    "put the marker in the bowl",
    "wipe the table with the towel",
    "close the laptop lid",
)
BUDGET_S = 0.530  # DROID's control budget: an action chunk must come within it
ACTIONS_RATIO_TARGET = 3.0  # at c = 16: mstar actions/s >= 3x openpi's
JCT_RATIO_TARGET = 1.1  # at c = 1: mstar JCT p50 <= 1.1x openpi's
AGREE_ATOL = 1e-3
TARGET_NAMES = ("mstar", "openpi")


@dataclass(frozen=True)
class Settings:
    """One run's configuration (printed first, recorded in the JSON)."""

    config: str = "pi05-small"
    concurrency: tuple[int, ...] = (1, 4, 16)
    num_requests: int | None = None
    threads: int = 1
    device: str = "cpu"
    num_templates: int = 64
    seed: int = 0
    out: str = "results/pi05"


def make_observation(seed: int, size: int) -> dict[str, Any]:
    """Return a DROID observation drawn from ``seed``; its ``seed`` fixes the flow's noise."""
    g = np.random.default_rng(seed)
    return {
        EXTERIOR_IMAGE_KEY: g.integers(0, 256, (size, size, 3), dtype=np.uint8),
        WRIST_IMAGE_KEY: g.integers(0, 256, (size, size, 3), dtype=np.uint8),
        JOINT_POSITION_KEY: g.uniform(-1.5, 1.5, 7),
        GRIPPER_POSITION_KEY: g.uniform(0.0, 1.0, 1),
        PROMPT_KEY: TASKS[seed % len(TASKS)],
        "seed": seed,
    }


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Run:
    """The targets, what they returned and what they measured."""

    settings: Settings
    model: Pi05Model
    engine: AsyncEngine
    openpi: OpenpiServer
    window: CounterWindow
    actions: dict[tuple[str, str], np.ndarray] = dataclasses.field(default_factory=dict)
    results: list[BenchResult] = dataclasses.field(default_factory=list)
    breakdowns: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def observation(self, request: BenchRequest) -> dict[str, Any]:
        return make_observation(int(request.params["seed"]), self.model.config.vision.image_size)

    async def mstar_target(self, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        async for out in self.engine.generate(Request("act", self.observation(request))):
            if out.name == "actions":
                self.actions[("mstar", request.request_id)] = np.asarray(out.data)
                yield OutputEvent("action", num_bytes=int(np.asarray(out.data).nbytes))
        if is_warmup(request.request_id):
            await self.window.after_warmup()

    async def openpi_target(self, request: BenchRequest) -> AsyncIterator[OutputEvent]:
        actions = await self.openpi.act(request.request_id, self.observation(request))
        self.actions[("openpi", request.request_id)] = actions
        yield OutputEvent("action", num_bytes=int(actions.nbytes))

    async def point(self, c: int, templates: Sequence[BenchRequest], console: Console) -> None:
        """Measure both targets at concurrency c; account where their time went."""
        s = self.settings
        load = ClosedLoop((c,), num_requests=s.num_requests)
        openpi_before = self.openpi.meter.snapshot()
        started = time.perf_counter()
        result = await run_benchmark(
            {"mstar": self.mstar_target, "openpi": self.openpi_target},
            templates,
            load,
            name="bench_pi05",
            seed=s.seed * 1000 + c,
            progress=False,
            console=Console(quiet=True),
        )
        spent_mstar = await self.window.spent()
        spent_openpi = {
            k: seconds
            for k, (seconds, _num) in figures_delta(
                openpi_before, self.openpi.meter.snapshot()
            ).items()
        }
        num_measured = load.requests_at(c)
        self.results.append(result)
        by_target = {p.target: p for p in result.points}
        self.breakdowns.append(
            _mstar_breakdown(c, by_target["mstar"].summary.duration_s, num_measured, spent_mstar)
        )
        self.breakdowns.append(
            _openpi_breakdown(
                c,
                by_target["openpi"].summary.duration_s,
                num_measured,
                self.model.config.num_steps,
                spent_openpi,
            )
        )
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


def _mstar_breakdown(c: int, wall: float, num: int, f: Counters) -> dict[str, Any]:
    vision, llm = f.get("vision_step_seconds", 0.0), f.get("llm_step_seconds", 0.0)
    steps = f.get("llm_steps", 0.0)
    phases = {
        k.removeprefix("llm_phase_").removesuffix("_seconds"): v
        for k, v in f.items()
        if k.startswith("llm_phase_")
    }
    return {
        "concurrency": c,
        "target": "mstar",
        "num_requests": num,
        "wall_s": wall,
        "vision_s": vision,
        "vision_steps": int(f.get("vision_steps", 0)),
        "prefix_s": f.get("walk_prefill_seconds", 0.0),
        "prefix_steps": int(f.get("walk_prefill_steps", 0)),
        "flow_s": f.get("walk_action_gen_seconds", 0.0),
        "flow_steps": int(f.get("walk_action_gen_steps", 0)),
        "llm_s": llm,
        "llm_steps": int(steps),
        "llm_firings_per_step": f.get("llm_batched", 0.0) / steps if steps else math.nan,
        "llm_forward_s": phases.get("forward", 0.0),
        "llm_phases_s": phases,
        "pre_post_s": math.nan,  # on the event loop, in "other"
        "busy_s": vision + llm,
        "other_s": wall - vision - llm,
    }


def _openpi_breakdown(
    c: int, wall: float, num: int, num_steps: int, f: Mapping[str, float]
) -> dict[str, Any]:
    busy = sum(f.values())
    prefix, flow = f.get("prefix", 0.0), f.get("flow", 0.0)
    return {
        "concurrency": c,
        "target": "openpi",
        "num_requests": num,
        "wall_s": wall,
        "vision_s": f.get("vision", 0.0),
        "vision_steps": num,
        "prefix_s": prefix,
        "prefix_steps": num,
        "flow_s": flow,
        "flow_steps": num * num_steps,
        "llm_s": prefix + flow,
        "llm_steps": num * (1 + num_steps),
        "llm_firings_per_step": math.nan,
        "llm_forward_s": prefix + flow,
        "llm_phases_s": {},
        "pre_post_s": f.get("preprocess", 0.0) + f.get("postprocess", 0.0),
        "busy_s": busy,
        "other_s": wall - busy,
    }


async def run(settings: Settings, console: Console) -> dict[str, Any]:
    """Run every point (mstar, then openpi); print and write the results."""
    torch.set_num_threads(settings.threads)
    model = Pi05Model(settings.config)
    cfg = model.config
    # A copy of the same weights in the checkpoint's layout (the engine fuses its own products).
    weights = copy.deepcopy(model.load_weights(torch.device("cpu")))
    openpi = OpenpiServer(model, weights)
    flops = chunk_flops(
        openpi,
        [
            make_observation(settings.seed * 100_000 + i, cfg.vision.image_size)
            for i in range(min(4, settings.num_templates))
        ],
    )
    peak = measure_flops(torch.float32, rows=256, width=1024)  # the compute ceiling
    engine = await AsyncEngine.start(
        model, None, EngineConfig(devices=rank_devices(settings.device))
    )
    counters = functools.partial(engine_counters, engine, nodes=("vision", "llm"), walk_node="llm")
    bench = Run(settings, model, engine, openpi, CounterWindow(counters))
    templates = [
        BenchRequest(f"obs{i}", "", params={"seed": settings.seed * 100_000 + i})
        for i in range(settings.num_templates)
    ]
    config = _describe(settings, model)
    config["compute"] = (
        f"{flops / 1e9:.2f} GFLOP per chunk (matmuls, counted on the baseline); float32 GEMM "
        f"peak {peak / 1e9:.0f} GFLOP/s at {torch.get_num_threads()} threads"
    )
    console.print("[bold]bench_pi05[/bold]: configuration")
    for key, value in config.items():
        console.print(f"  {key}: {value}", highlight=False, markup=False)
    try:
        for c in settings.concurrency:
            await bench.point(c, templates, console)
    finally:
        await engine.shutdown()
        openpi.close()
    config["openpi_thread_torch_threads"] = openpi.thread_torch_threads
    merged = merge_results(bench.results, config)
    print_table(merged, console)
    agreement = _agreement(bench.actions)
    rows = _summary(merged, cfg.action_horizon, flops, peak, console)
    console.print(_breakdown_table(bench.breakdowns))
    verdicts = _verdicts(rows, agreement, console)
    data = result_to_dict(merged)
    data["pi05"] = json_safe(
        {
            "horizon": cfg.action_horizon,
            "flops_per_chunk": flops,
            "gemm_peak_flops_per_s": peak,
            "budget_s": BUDGET_S,
            "summary": rows,
            "breakdown": bench.breakdowns,
            "agreement": agreement,
            "verdicts": verdicts,
        }
    )
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "bench_pi05.json", out / "bench_pi05.png"
    json_path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    _plot(rows, png_path, settings)
    console.print(f"wrote {json_path} and {png_path}", highlight=False, markup=False)
    return data


def _describe(settings: Settings, model: Pi05Model) -> dict[str, Any]:
    cfg = model.config
    v, vlm, ex = cfg.vision, cfg.vlm, cfg.expert
    return {
        "model": f"{cfg.name}: SigLIP {v.image_size}px/{v.patch_size} width {v.width} depth "
        f"{v.depth}; "
        f"VLM width {vlm.width} depth {vlm.depth} MLP {vlm.mlp_dim}; action expert width "
        f"{ex.width} MLP {ex.mlp_dim}; "
        f"{vlm.num_heads}/{vlm.num_kv_heads} heads of {vlm.head_dim}; horizon "
        f"{cfg.action_horizon} x "
        f"{cfg.action_dim} ({cfg.robot_dof} to the robot), {cfg.num_steps} Euler steps; "
        "random weights, float32",
        "observations": f"DROID observations from {settings.num_templates} seeds: two uint8 "
        f"{v.image_size}x{v.image_size} "
        f"cameras, 7 joints, gripper, prompts from {len(TASKS)} tasks, noise seeded",
        "load": f"closed loop, concurrency {list(settings.concurrency)}, measured requests "
        "per point "
        f"max({settings.num_requests or 0}, 5 x c), warm-up c per target (not measured)",
        "mstar": "AsyncEngine in process (vision + llm on rank 0): prefixes in the paged KV cache, "
        "every robot's Euler step in one batch",
        "openpi": "one request at a time (asyncio lock + one-thread executor); preprocess, "
        "dense-KV "
        "sampler with batch 1 (prefix K/V cached once, 10 Euler steps), postprocess",
        "actions/s": f"action chunks/s x horizon ({cfg.action_horizon})",
        "budget": f"JCT within {1e3 * BUDGET_S:.0f} ms (DROID control budget)",
        "device": "cpu",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
        "seed": settings.seed,
    }


def _agreement(actions: Mapping[tuple[str, str], np.ndarray]) -> dict[str, Any]:
    diffs = [
        float(np.abs(a.astype(np.float64) - actions[("openpi", rid)].astype(np.float64)).max())
        for (who, rid), a in actions.items()
        if who == "mstar" and ("openpi", rid) in actions
    ]
    worst = max(diffs) if diffs else math.nan
    return {
        "num_compared": len(diffs),
        "max_abs_diff": worst,
        "atol": AGREE_ATOL,
        "agree": bool(diffs) and worst < AGREE_ATOL,
    }


def _within_budget(result: BenchResult, target: str, point: float) -> float:
    records = [r for r in result.result(target, point).records if r.is_ok]
    jcts = [
        max((e.time_s for e in r.events if e.modality == "action"), default=math.inf)
        for r in records
    ]
    return sum(t <= BUDGET_S for t in jcts) / len(jcts) if jcts else math.nan


def _summary(
    result: BenchResult, horizon: int, flops: float, peak: float, console: Console
) -> dict[str, dict[str, Any]]:
    table = Table(
        title=f"pi0.5 per concurrency (actions/s = chunks/s x {horizon}; "
        f"budget = JCT <= {1e3 * BUDGET_S:.0f} ms)"
    )
    headers = (
        "c",
        "target",
        "requests",
        "JCT p50 ms",
        "JCT p95 ms",
        "chunks/s",
        "actions/s",
        "within budget",
        "GFLOP/s (of peak)",
    )
    for header in headers:
        table.add_column(header, justify="left" if header == "target" else "right")
    ratios = Table(title="mstar / openpi")
    for header in (
        "c",
        "actions/s ratio",
        "JCT p50 ratio (mstar / openpi)",
        "ceiling (peak / openpi)",
    ):
        ratios.add_column(header, justify="right")
    rows: dict[str, dict[str, Any]] = {}
    for point in result.load_points:
        c = int(point)
        row: dict[str, Any] = {}
        for target in result.targets:
            s = result.result(target, point).summary
            row[target] = {
                "num_requests": s.num_requests,
                "num_failed": s.num_failed,
                "jct_p50_s": s.jct_s.p50 if s.jct_s else math.nan,
                "jct_p95_s": s.jct_s.p95 if s.jct_s else math.nan,
                "chunks_per_s": s.requests_per_s,
                "actions_per_s": s.requests_per_s * horizon,
                "within_budget": _within_budget(result, target, point),
                "flops_per_s": s.requests_per_s * flops,
            }
            r = row[target]
            table.add_row(
                str(c),
                target,
                f"{s.num_requests - s.num_failed}/{s.num_requests}",
                f"{1e3 * r['jct_p50_s']:.1f}",
                f"{1e3 * r['jct_p95_s']:.1f}",
                f"{r['chunks_per_s']:.2f}",
                f"{r['actions_per_s']:.1f}",
                f"{100 * r['within_budget']:.0f} %",
                f"{r['flops_per_s'] / 1e9:.0f} ({100 * r['flops_per_s'] / peak:.0f} %)",
            )
        m, o = row["mstar"], row["openpi"]
        row["actions_per_s_ratio"] = (
            m["actions_per_s"] / o["actions_per_s"] if o["actions_per_s"] else math.nan
        )
        row["jct_p50_ratio"] = m["jct_p50_s"] / o["jct_p50_s"]
        # No server does this work faster than the GEMM peak: the most any could beat openpi by.
        row["ceiling_ratio"] = peak / o["flops_per_s"] if o["flops_per_s"] else math.nan
        ratios.add_row(
            str(c),
            f"{row['actions_per_s_ratio']:.2f}x",
            f"{row['jct_p50_ratio']:.2f}x",
            f"{row['ceiling_ratio']:.2f}x",
        )
        table.add_section()
        rows[str(c)] = row
    console.print(table)
    console.print(ratios)
    return rows


def _breakdown_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="where the time goes (seconds over each point's measured requests)")
    headers = (
        "c|target|wall|vision (steps)|prefix (steps)|flow (steps)|llm "
        "(steps)|firings/step|llm forward|llm rest|pre+post|busy|other"
    )
    for header in headers.split("|"):
        table.add_column(header, justify="left" if header == "target" else "right")

    def num(value: float) -> str:
        return "-" if math.isnan(value) else f"{value:.2f}"

    for b in rows:
        table.add_row(
            str(b["concurrency"]),
            b["target"],
            num(b["wall_s"]),
            f"{num(b['vision_s'])} ({b['vision_steps']})",
            f"{num(b['prefix_s'])} ({b['prefix_steps']})",
            f"{num(b['flow_s'])} ({b['flow_steps']})",
            f"{num(b['llm_s'])} ({b['llm_steps']})",
            "-" if math.isnan(b["llm_firings_per_step"]) else f"{b['llm_firings_per_step']:.1f}",
            num(b["llm_forward_s"]),
            num(b["llm_s"] - b["llm_forward_s"]),
            num(b["pre_post_s"]),
            num(b["busy_s"]),
            num(b["other_s"]),
        )
    table.caption = (
        "mstar: the engines' step timers; vision and llm steps share rank 0's step thread, "
        "and the vision "
        "(stateless) engine times a step from handing it to that thread, so its seconds "
        "include waiting behind "
        "an llm step (busy can then exceed wall); prefix / flow = llm steps serving the "
        "prefill / action_gen "
        "walk (a mixed step counts under both); llm rest = schedule, prepare, logits, "
        "update; other = wall - "
        "busy (runtime, pre/postprocessing on the event loop, idle). openpi: its own timers "
        "around each part "
        "of infer; other = lock and executor hand-offs."
    )
    return table


def _verdicts(
    rows: Mapping[str, Mapping[str, Any]], agreement: Mapping[str, Any], console: Console
) -> dict[str, Any]:
    console.print(
        f"actions agree: max |mstar - openpi| = {agreement['max_abs_diff']:.2e} over "
        f"{agreement['num_compared']} requests (< {AGREE_ATOL:g}: "
        f"{'yes' if agreement['agree'] else 'NO'})",
        highlight=False,
        markup=False,
    )
    verdicts: dict[str, Any] = {}
    checks = (
        (
            "actions_per_s_c16",
            "16",
            "actions_per_s_ratio",
            f"at c=16 mstar actions/s >= {ACTIONS_RATIO_TARGET:g}x openpi's",
            lambda v: v >= ACTIONS_RATIO_TARGET,
        ),
        (
            "jct_p50_c1",
            "1",
            "jct_p50_ratio",
            f"at c=1 mstar JCT p50 <= {JCT_RATIO_TARGET:g}x openpi's",
            lambda v: v <= JCT_RATIO_TARGET,
        ),
    )
    console.print("targets:")
    for name, c, key, text, ok in checks:
        value = rows[c][key] if c in rows else math.nan
        met = None if math.isnan(value) else bool(ok(value))
        status = "n/a " if met is None else ("MET " if met else "MISS")
        console.print(f"  {status} {text}: {value:.2f}x", highlight=False, markup=False)
        verdicts[name] = {"value": value, "met": met}
    return verdicts


def _plot(rows: Mapping[str, Mapping[str, Any]], path: Path, settings: Settings) -> None:
    # The object API with the Agg canvas: no pyplot, the global backend is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cs = list(rows)
    xs = list(range(len(cs)))
    figure = Figure(figsize=(13, 3.8), layout="constrained")
    FigureCanvasAgg(figure)
    jct, rate, budget = figure.subplots(1, 3)
    for target, color in zip(TARGET_NAMES, ("C0", "C1"), strict=True):
        jct.plot(
            xs,
            [1e3 * rows[c][target]["jct_p50_s"] for c in cs],
            "o-",
            color=color,
            label=f"{target} p50",
        )
        jct.plot(
            xs,
            [1e3 * rows[c][target]["jct_p95_s"] for c in cs],
            "o--",
            color=color,
            label=f"{target} p95",
        )
        rate.plot(
            xs, [rows[c][target]["actions_per_s"] for c in cs], "o-", color=color, label=target
        )
        budget.plot(
            xs,
            [100 * rows[c][target]["within_budget"] for c in cs],
            "o-",
            color=color,
            label=target,
        )
    jct.axhline(
        1e3 * BUDGET_S, color="gray", linestyle=":", label=f"{1e3 * BUDGET_S:.0f} ms budget"
    )
    jct.set_title("JCT (ms)")
    rate.set_title("actions / s (chunks/s x horizon)")
    budget.set_title(f"% of requests within {1e3 * BUDGET_S:.0f} ms")
    budget.set_ylim(-5, 105)
    for axis in (jct, rate, budget):
        axis.set_xticks(xs, cs)
        axis.set_xlabel("concurrency (robots)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    jct.set_ylim(bottom=0)
    rate.set_ylim(bottom=0)
    figure.suptitle(
        f"pi0.5 ({settings.config}, CPU, {settings.threads} threads): mstar vs openpi-style server"
    )
    figure.savefig(path, dpi=100)


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """Parse the command line into `Settings`."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--config", default="pi05-small", choices=["pi05-tiny", "pi05-small"])
    p.add_argument(
        "--concurrency", default="1,4,16", help="closed-loop concurrencies, comma-separated"
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="measured requests per point (at least 5 x c)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_device_argument(p)
    p.add_argument(
        "--num-templates", type=int, default=64, help="distinct observations (seeds) to draw from"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/pi05", help="directory for the JSON and PNG")
    args = p.parse_args(argv)
    try:
        levels = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if not levels or min(levels) < 1:
        p.error("--concurrency values must be >= 1")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if args.num_templates < 1:
        p.error("--num-templates must be >= 1")
    return Settings(
        config=args.config,
        concurrency=levels,
        num_requests=args.num_requests,
        threads=args.threads,
        device=args.device,
        num_templates=args.num_templates,
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


if __name__ == "__main__":
    sys.exit(0 if main()["pi05"]["agreement"]["agree"] else 1)
