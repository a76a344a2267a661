"""Benchmark V-JEPA 2-AC rollouts: mstar's KV-cached DynamicLoop against the native loop.

    python scripts/bench_vjepa2.py                                  # vjepa2-small, CPU
    python scripts/bench_vjepa2.py --threads 1                      # steadier on a busy host
    python scripts/bench_vjepa2.py --device cuda --dtype bfloat16   # FlashInfer on CUDA

For each horizon H (default 1, 5, 10, 20, 30), waves of ``--concurrency`` rollout requests
(default 8) are sent at once to two targets that hold the same weights, in the same run:

- ``mstar``: the model served by `AsyncEngine` (encoder node, then a `DynamicLoop` over the
  predictor whose engine computes only the newest frame block per step against each
  request's paged KV cache; concurrent requests share every step's forward);
- ``native``: the upstream loop (`native_rollout`), which re-runs the predictor over all
  frames at every step; requests that arrive together run as one batch (the most a
  recompute loop can share).

Each request encodes its context image and rolls out H seeded actions. The metric is job
completion time (JCT: from sending a request to receiving its predicted trajectory); the
speed-up is native JCT p50 / mstar JCT p50. Both targets' trajectories are compared, so the
speed-up is for identical results; the summary also gives the analytic ratio of predictor
FLOPs, which the speed-up should track. Prints the configuration and a summary (``--tables``:
the harness table of every horizon); writes JSON and a PNG plot to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mstar.baselines.vjepa2 import native_rollout
from mstar.bench import (
    BenchRequest,
    CallableTarget,
    OfflineWaves,
    OutputEvent,
    print_table,
    result_to_dict,
    run_benchmark,
)
from mstar.runtime import AsyncEngine, EngineConfig, Output, Request
from mstar.zoo.vjepa2 import VJepa2Model, load_encoder, load_predictor
from mstar.zoo.vjepa2.inputs import prepare_image

TARGET_RATIO = 12.5  # the paper's speed-up at H = 30


def make_data(request: BenchRequest, horizon: int, size: int) -> dict[str, Any]:
    """Return a request's image, pose and actions, drawn from its seed."""
    g = torch.Generator().manual_seed(int(request.params["seed"]))
    return {
        "image": (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8),
        "pose": torch.rand(7, generator=g) * 0.2,
        "actions": torch.randn(horizon, 7, generator=g) * 0.05,
    }


@dataclass
class _Pending:
    data: dict[str, Any]
    future: asyncio.Future[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class NativeRollouts:
    """The upstream loop as a service: requests waiting together run as one batch."""

    model: VJepa2Model
    device: str
    # The same torch threads as the creating thread (a new thread's OpenMP pool starts at every
    # core).
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            1,
            thread_name_prefix="native",
            initializer=functools.partial(torch.set_num_threads, torch.get_num_threads()),
        )
    )

    def __post_init__(self) -> None:
        m = self.model
        self.encoder = load_encoder(m.checkpoint, m.config, self.device, m.dtype)
        self.predictor = load_predictor(m.checkpoint, m.config, self.device, m.dtype)
        self.pending: list[_Pending] = []
        self.draining = False

    async def rollout(self, data: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        future: asyncio.Future[tuple[torch.Tensor, torch.Tensor]] = (
            asyncio.get_running_loop().create_future()
        )
        self.pending.append(_Pending(data, future))
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.pending:
                batch, self.pending = self.pending, []
                horizons = sorted({p.data["actions"].shape[0] for p in batch})
                for h in horizons:
                    group = [p for p in batch if p.data["actions"].shape[0] == h]
                    try:
                        results = await loop.run_in_executor(
                            self.executor, self._run, [p.data for p in group]
                        )
                    except Exception as exc:
                        for p in group:
                            p.future.set_exception(exc)
                        continue
                    for p, r in zip(group, results, strict=True):
                        p.future.set_result(r)
        finally:
            self.draining = False

    @torch.inference_mode()
    def _run(self, batch: list[dict[str, Any]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg, dtype = self.model.config, self.model.dtype
        frames = torch.stack([prepare_image(d["image"], cfg) for d in batch]).to(self.device, dtype)
        z0 = self.encoder.encode_frames(frames, normalize=cfg.normalize_reps)
        pose0 = torch.stack([d["pose"] for d in batch]).to(self.device)
        actions = torch.stack([d["actions"] for d in batch]).to(self.device)
        latents, poses = native_rollout(self.predictor, z0, pose0.to(dtype), actions.to(dtype))
        latents, poses = latents.cpu(), poses.cpu()
        return [(latents[i], poses[i]) for i in range(len(batch))]


def flop_ratio(model: VJepa2Model, horizon: int) -> float:
    """Return native / cached predictor-block FLOPs of one rollout (analytic; encoder excluded).

    Per layer a token costs ``2 (4 d^2 + 2 d m)`` FLOPs in its linear layers and a
    query-key pair ``4 d`` in attention; the native loop runs ``F n`` tokens against
    ``F n`` keys at step n, the cached one ``F`` tokens against ``F n`` keys.
    """
    cfg = model.config.predictor
    f, d, m = cfg.frame_tokens, cfg.pred_dim, cfg.mlp_hidden
    linear, pair = 2 * (4 * d * d + 2 * d * m), 4 * d
    native = sum(f * n * linear + (f * n) ** 2 * pair for n in range(1, horizon + 1))
    cached = sum(f * linear + f * f * n * pair for n in range(1, horizon + 1))
    return native / cached


def _event(out: Any) -> list[OutputEvent]:
    return [OutputEvent("latent")]


async def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    kv = {"attention_backend": args.attention_backend}
    if args.num_blocks:
        kv["num_blocks"] = args.num_blocks
    model = VJepa2Model(args.config, checkpoint=args.checkpoint, dtype=args.dtype, kv=kv)
    size = model.config.encoder.img_size
    native = NativeRollouts(model, args.device)
    engine = await AsyncEngine.start(model, config=EngineConfig(devices={0: args.device}))
    outputs: dict[tuple[str, str], torch.Tensor] = {}
    horizon = 1

    async def mstar_fn(request: BenchRequest) -> AsyncIterator[Output]:
        async for out in engine.generate(Request("rollout", make_data(request, horizon, size))):
            if out.name == "latents":
                outputs[("mstar", request.request_id)] = out.data
            yield out

    async def native_fn(request: BenchRequest) -> AsyncIterator[torch.Tensor]:
        latents, _ = await native.rollout(make_data(request, horizon, size))
        outputs[("native", request.request_id)] = latents
        yield latents

    targets = {
        "mstar": CallableTarget(mstar_fn, name="mstar", to_events=_event),
        "native": CallableTarget(native_fn, name="native", to_events=_event),
    }
    requests = [BenchRequest(f"r{i}", "", params={"seed": i}) for i in range(64)]
    config = {
        "model": args.config,
        "device": args.device,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "torch_threads": torch.get_num_threads(),
        "frame_tokens": model.config.predictor.frame_tokens,
        "predictor": f"depth {model.config.predictor.depth}, dim {model.config.predictor.pred_dim}",
    }
    summary: list[dict[str, Any]] = []
    results = []
    try:
        # Warm-up, unmeasured: every code path of both targets once.
        horizon = 2
        for fn in (mstar_fn, native_fn):
            await asyncio.gather(*[_drain(fn(r)) for r in requests[: args.concurrency]])
        for horizon in args.horizons:
            outputs.clear()
            load = OfflineWaves((args.concurrency,), num_waves=args.waves, warmup=0)
            result = await run_benchmark(
                targets,
                requests,
                load,
                name=f"vjepa2 rollout H={horizon}",
                seed=horizon,
                progress=False,
                console=console,
                config={**config, "horizon": horizon},
            )
            if args.tables:
                print_table(result, console)
            results.append(result)
            point = result.load_points[0]
            m = result.result("mstar", point).summary
            n = result.result("native", point).summary
            assert m.jct_s is not None and n.jct_s is not None
            diffs = [
                (outputs[("mstar", rid)].float() - outputs[("native", rid)].float())
                .abs()
                .max()
                .item()
                for (who, rid) in list(outputs)
                if who == "mstar" and ("native", rid) in outputs
            ]
            summary.append(
                {
                    "horizon": horizon,
                    "mstar_jct_p50_s": m.jct_s.p50,
                    "native_jct_p50_s": n.jct_s.p50,
                    "mstar_jct_mean_s": m.jct_s.mean,
                    "native_jct_mean_s": n.jct_s.mean,
                    "speedup": n.jct_s.p50 / m.jct_s.p50,
                    "tokens_ratio": (horizon + 1) / 2,
                    "flop_ratio": flop_ratio(model, horizon),
                    "max_abs_diff": max(diffs) if diffs else None,
                    "num_compared": len(diffs),
                }
            )
            console.print(
                f"H={horizon}: mstar {m.jct_s.p50:.3f} s, native {n.jct_s.p50:.3f} s, "
                f"speed-up {summary[-1]['speedup']:.2f}x (max |diff| "
                f"{summary[-1]['max_abs_diff']:.2e})"
            )
    finally:
        await engine.shutdown()
        native.executor.shutdown()
    _report(console, summary, args)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": {**config, **{k: str(v) for k, v in vars(args).items()}},
        "summary": summary,
        "results": [result_to_dict(r) for r in results],
    }
    (args.out / "bench_vjepa2.json").write_text(json.dumps(payload, indent=2, default=str))
    _plot(summary, args.out / "bench_vjepa2.png", args)
    console.print(f"wrote {args.out / 'bench_vjepa2.json'} and {args.out / 'bench_vjepa2.png'}")
    return 0


async def _drain(outputs: AsyncIterator[Any]) -> None:
    async for _ in outputs:
        pass


def _report(console: Console, summary: list[dict[str, Any]], args: argparse.Namespace) -> None:
    table = Table(
        title=f"V-JEPA 2-AC rollout JCT, {args.concurrency} concurrent ({args.config}, "
        f"{args.device})"
    )
    for col in (
        "H",
        "mstar p50 (s)",
        "native p50 (s)",
        "speed-up",
        "tokens (H+1)/2",
        "FLOPs",
        "max |diff|",
    ):
        table.add_column(col, justify="right")
    for s in summary:
        table.add_row(
            str(s["horizon"]),
            f"{s['mstar_jct_p50_s']:.3f}",
            f"{s['native_jct_p50_s']:.3f}",
            f"{s['speedup']:.2f}x",
            f"{s['tokens_ratio']:.1f}x",
            f"{s['flop_ratio']:.1f}x",
            f"{s['max_abs_diff']:.1e}",
        )
    console.print(table)
    ratios = [s["speedup"] for s in summary]
    growing = all(b > a for a, b in itertools.pairwise(ratios))
    at_30 = next((s["speedup"] for s in summary if s["horizon"] == 30), None)
    if at_30 is not None:
        met = at_30 >= TARGET_RATIO and growing
        console.print(
            f"target: >= {TARGET_RATIO}x at H=30 and growing with H -> {at_30:.2f}x, "
            f"{'growing' if growing else 'not growing'}: {'MET' if met else 'NOT MET'}"
        )


def _plot(summary: list[dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hs = [s["horizon"] for s in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(
        hs, [s["mstar_jct_p50_s"] for s in summary], "o-", label="mstar (KV-cached DynamicLoop)"
    )
    left.plot(
        hs, [s["native_jct_p50_s"] for s in summary], "s-", label="native (recompute all frames)"
    )
    left.set_xlabel("horizon H (frames)")
    left.set_ylabel("JCT p50 (s)")
    left.set_yscale("log")
    left.legend()
    right.plot(hs, [s["speedup"] for s in summary], "o-", label="measured")
    right.plot(hs, [s["tokens_ratio"] for s in summary], "--", label="predictor tokens (H+1)/2")
    right.plot(hs, [s["flop_ratio"] for s in summary], ":", label="predictor FLOPs")
    right.axhline(TARGET_RATIO, color="gray", linestyle=":", label=f"{TARGET_RATIO}x")
    right.set_xlabel("horizon H (frames)")
    right.set_ylabel("speed-up (native / mstar)")
    right.legend()
    fig.suptitle(
        f"V-JEPA 2-AC rollouts, {args.concurrency} concurrent, {args.config} on {args.device}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run the benchmark."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        default="vjepa2-small",
        choices=["vjepa2-tiny", "vjepa2-small", "vjepa2-ac-vitg"],
    )
    parser.add_argument(
        "--checkpoint", default=None, help="the .pt checkpoint (default: cached random weights)"
    )
    parser.add_argument("--horizons", type=int, nargs="+", default=[1, 5, 10, 20, 30])
    parser.add_argument("--concurrency", type=int, default=8, help="rollouts sent at once")
    parser.add_argument("--waves", type=int, default=1, help="measured waves per horizon")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"]
    )
    parser.add_argument("--num-blocks", type=int, default=None, help="frame blocks in the KV pool")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument(
        "--tables", action="store_true", help="print the harness table of every horizon"
    )
    parser.add_argument("--out", type=Path, default=Path("results/vjepa2"))
    args = parser.parse_args(argv)
    if any(not 1 <= h <= 31 for h in args.horizons):
        parser.error("horizons must be in 1..31")
    start = time.perf_counter()
    code = asyncio.run(run(args))
    print(f"total {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
