"""Benchmark tensor parallelism: decode sharded over two ranks against one rank.

Side by side in one run, each in worker processes of one torch thread:

- ``TP=1``: the LM on one rank (one process);
- ``TP=2``: the LM in a group ``{ranks: [0, 1], tensor_parallel: 2}`` (two processes: the
  leader schedules and samples, both compute their half of every layer and sum the partial
  products over shared memory).

Models: SmolLM2-135M (the ``llm`` node), and with ``--qwen3-omni`` also qwen3-omni-small's
thinker (text answers: the talker and Code2Wav idle on a rank of their own in both runs).

At each concurrency ``c``, ``c`` greedy requests of a 16-token prompt decode ``--new-tokens``
tokens each (end of sequence ignored), ``--rounds`` times; decode tokens/s counts the tokens
after each request's first over the time from the first first-token to the last token (best
round). Also reported: one all-reduce of a decode step's hidden states (``c`` x 576) between
two processes over mstar's shared memory and over gloo (``torch.distributed``), per call and
per step (two per layer and one for the embedding), and each rank's weight bytes.

    python scripts/bench_tp.py                          # c = 1 and 4, float32
    python scripts/bench_tp.py --dtype bfloat16 --concurrency 1,4,16 --qwen3-omni
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import torch

from mstar.bench.runner import cpu_model
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request

TP2 = "node_groups:\n  - {node_names: [llm], ranks: [0, 1], tensor_parallel: 2}\n"
TP1 = "node_groups:\n  - {node_names: [llm], ranks: [0]}\n"
_QWEN3_REST = "  - {node_names: [audio_encoder, vision_encoder, talker, code2wav], ranks: [RANK]}\n"
QWEN3_TP2 = (
    "node_groups:\n  - {node_names: [thinker], ranks: [0, 1], tensor_parallel: 2}\n"
    + _QWEN3_REST.replace("RANK", "2")
)
QWEN3_TP1 = "node_groups:\n  - {node_names: [thinker], ranks: [0]}\n" + _QWEN3_REST.replace(
    "RANK", "1"
)
PROMPT = [1, 504, 3458, 314, 253, 1345, 282, 28, 2191, 30, 378, 2303, 314, 5457, 30, 198]


async def _wave(
    engine: AsyncEngine, c: int, new_tokens: int, extra: dict[str, Any]
) -> tuple[float, int]:
    """Run ``c`` requests at once; return decode tokens/s and the tokens decoded."""
    firsts: list[float] = []
    lasts: list[float] = []
    decoded = 0

    async def one(seed: int) -> None:
        nonlocal decoded
        data = {
            "prompt_token_ids": [*PROMPT[:-1], PROMPT[-1] + seed],
            "max_tokens": new_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            **extra,
        }
        if "text" in extra:  # a chat model: its own prompt, one per request
            data.pop("prompt_token_ids")
            data["text"] = f"{extra['text']} {seed}"
        count = 0
        async for _ in engine.generate(Request("generate", data)):
            now = time.perf_counter()
            if count == 0:
                firsts.append(now)
            count += 1
            lasts.append(now)
        decoded += count - 1

    await asyncio.gather(*(one(i) for i in range(c)))
    return decoded / (max(lasts) - min(firsts)), decoded


async def _serve(
    spec: ModelSpec,
    placement: str,
    concurrency: list[int],
    new_tokens: int,
    rounds: int,
    extra: dict[str, Any],
) -> dict[int, float]:
    config = EngineConfig(worker_processes=True, cpu_threads=1)
    out: dict[int, float] = {}
    async with await AsyncEngine.start(spec, Placement.from_yaml(placement), config) as engine:
        await _wave(engine, 1, 8, extra)  # warm-up: first steps, layouts, greedy head
        for c in concurrency:
            out[c] = max([(await _wave(engine, c, new_tokens, extra))[0] for _ in range(rounds)])
    return out


def _all_reduce_rank(
    kind: str, rank: int, where: str, rows: int, hidden: int, calls: int, queue: Any
) -> None:
    torch.set_num_threads(1)
    if kind == "shm":
        from mstar.engines.parallel import ShmGroup

        group: Any = ShmGroup(where, rank, 2)
    else:
        from mstar.engines.parallel import GlooGroup

        group = GlooGroup(rank, 2, init_method=where)
    x = torch.randn(rows, hidden)
    for _ in range(50):
        group.all_reduce_(x)
    start = time.perf_counter()
    for _ in range(calls):
        group.all_reduce_(x)
    seconds = (time.perf_counter() - start) / calls
    group.all_reduce_(torch.zeros(1))  # both done before either leaves
    if rank == 0:
        queue.put(seconds)
    group.close()


def _time_all_reduce(kind: str, rows: int, hidden: int, calls: int) -> float:
    """Seconds per all-reduce of ``[rows, hidden]`` float32 between two processes."""
    ctx = multiprocessing.get_context("spawn")
    if kind == "shm":
        where = f"/dev/shm/mstar-bench-tp-{secrets.token_hex(6)}"
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            where = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_all_reduce_rank, args=(kind, r, where, rows, hidden, calls, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        return float(queue.get(timeout=300))
    finally:
        for p in procs:
            p.join(60)
        if kind == "shm":
            Path(where).unlink(missing_ok=True)


def _weight_bytes(checkpoint: Path, dtype: torch.dtype) -> tuple[int, list[int]]:
    """Bytes of the whole model's weights and of each of two ranks' shards (from the slices each
    reads)."""
    from mstar.engines.parallel import TensorShard
    from mstar.zoo.hf_checkpoint import load_hf_config
    from mstar.zoo.llama import LlamaCausalLM, LlamaConfig

    config = LlamaConfig.from_hf(load_hf_config(checkpoint))
    size = torch.empty(0, dtype=dtype).element_size()
    with torch.device("meta"):
        whole = LlamaCausalLM(config)
    full = sum(p.numel() for p in whole.parameters()) * size
    shards = []
    for rank in range(2):
        with torch.device("meta"):
            model = LlamaCausalLM(config)
        model.shard_(TensorShard(rank, 2))
        shards.append(sum(p.numel() for p in model.parameters()) * size)
    return full, shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--all-reduce-calls", type=int, default=2000)
    parser.add_argument("--qwen3-omni", action="store_true", help="also qwen3-omni-small's thinker")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]

    from mstar.zoo.smollm2 import smollm2_checkpoint_dir

    checkpoint = smollm2_checkpoint_dir()
    spec = ModelSpec(
        "mstar.zoo.llm:TextLLM",
        {
            "checkpoint": str(checkpoint),
            "name": "smollm2-135m",
            "dtype": args.dtype,
            "engine_config": {"max_num_seqs": max(concurrency), "kv_cache_memory": 256 << 20},
        },
    )
    print(
        f"bench_tp: SmolLM2-135M {args.dtype}, decode {args.new_tokens} tokens after a "
        f"{len(PROMPT)}-token prompt, c = {concurrency}, best of {args.rounds} rounds; every rank "
        f"a worker process of one torch thread; CPU {cpu_model()} ({os.cpu_count()} cores)"
    )
    tp1 = asyncio.run(_serve(spec, TP1, concurrency, args.new_tokens, args.rounds, {}))
    tp2 = asyncio.run(_serve(spec, TP2, concurrency, args.new_tokens, args.rounds, {}))
    thinker: dict[str, dict[int, float]] = {}
    if args.qwen3_omni:
        qwen = ModelSpec(
            "mstar.zoo.qwen3_omni.model:Qwen3OmniModel",
            {"config": "qwen3-omni-small", "dtype": args.dtype},
        )
        text = {"modalities": ["text"], "text": "Tell me about the sea, request"}
        for name, placement in (("tp1", QWEN3_TP1), ("tp2", QWEN3_TP2)):
            thinker[name] = asyncio.run(
                _serve(qwen, placement, concurrency, args.new_tokens, args.rounds, text)
            )

    hidden, layers = 576, 30
    reduce_rows = []
    for c in concurrency:
        shm = _time_all_reduce("shm", c, hidden, args.all_reduce_calls)
        gloo = _time_all_reduce("gloo", c, hidden, max(200, args.all_reduce_calls // 10))
        reduce_rows.append((c, shm, gloo))
    full, shards = _weight_bytes(checkpoint, getattr(torch, args.dtype))

    print("\n| c | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 | step's all-reduces: shm / gloo ms |")
    print("|---|---|---|---|---|")
    rows = []
    for c, shm, gloo in reduce_rows:
        per_step = 2 * layers + 1
        ratio = tp2[c] / tp1[c]
        print(
            f"| {c} | {tp1[c]:.1f} | {tp2[c]:.1f} | {ratio:.2f}x | "
            f"{per_step * shm * 1e3:.3f} / {per_step * gloo * 1e3:.3f} |"
        )
        rows.append(
            {
                "concurrency": c,
                "tp1_tokens_per_s": tp1[c],
                "tp2_tokens_per_s": tp2[c],
                "ratio": ratio,
                "all_reduce_shm_us": shm * 1e6,
                "all_reduce_gloo_us": gloo * 1e6,
                "all_reduces_per_step": per_step,
            }
        )
    if thinker:
        print("\n| c | qwen3-omni-small thinker TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 |")
        print("|---|---|---|---|")
        for c in concurrency:
            one, two = thinker["tp1"][c], thinker["tp2"][c]
            print(f"| {c} | {one:.1f} | {two:.1f} | {two / one:.2f}x |")
    print("\n| all-reduce of c x 576 float32, two processes | shm us | gloo us | gloo / shm |")
    print("|---|---|---|---|")
    for c, shm, gloo in reduce_rows:
        print(f"| c = {c} | {shm * 1e6:.1f} | {gloo * 1e6:.1f} | {gloo / shm:.1f}x |")
    mib = 2**20
    print(
        f"\nweights: whole model {full / mib:.1f} MiB; rank 0 {shards[0] / mib:.1f} MiB "
        f"({shards[0] / full:.0%}), rank 1 {shards[1] / mib:.1f} MiB ({shards[1] / full:.0%})"
    )
    first = concurrency[0]
    target = tp2[first] / tp1[first]
    verdict = "met" if target >= 1.4 else "NOT met"
    print(f"target: TP=2 >= 1.4x TP=1 tokens/s at c = {first}: {target:.2f}x ({verdict})")
    if args.json is not None:
        result = {
            "config": vars(args) | {"json": str(args.json), "cpu": cpu_model()},
            "rows": rows,
            "weights_bytes": {"whole": full, "ranks": shards},
            "qwen3_omni_small_thinker": thinker,
        }
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if not all(math.isfinite(v) for v in (*tp1.values(), *tp2.values())):
        raise SystemExit("a rate is not finite")


if __name__ == "__main__":
    main()
