"""Decode step time on CUDA: the torch backend, FlashInfer, and FlashInfer replayed from CUDA
graphs.

    python scripts/bench_gpu.py                     # Llama-3-8B-shaped layers, bfloat16, c = 1 and
    16
    python scripts/bench_gpu.py --layers 4 --context 2048 --json out.json --markdown out.md

A random Llama of the given shape (default: Llama-3 8B's layer, 32 query / 8 KV heads of 128,
fewer layers) decodes `--steps` greedy tokens for `c` sequences of `--context` tokens; the
table gives the median decode step per route side by side in one run, and each route's
ratio to the torch backend's (the baseline). Also the time a CUDA tensor takes to reach
another process as IPC handles against a copy through host shared memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.zoo.llama import LlamaCausalLM, LlamaConfig

ROUTES = {  # name -> (attention backend, CUDA graphs)
    "torch": ("torch", False),
    "torch + graphs": ("torch", True),
    "flashinfer": ("flashinfer", False),
    "flashinfer + graphs": ("flashinfer", True),
}


def _model(args: argparse.Namespace) -> LlamaCausalLM:
    config = LlamaConfig(
        vocab_size=32_000,
        hidden_size=args.heads * 128,
        intermediate_size=args.heads * 448,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=128,
        max_position_embeddings=args.context + args.steps + 16,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaCausalLM(config)
    return model.to(torch.bfloat16).eval()


def _decode_steps_ms(model: LlamaCausalLM, route: str, c: int, args: argparse.Namespace) -> float:
    backend, graphs = ROUTES[route]
    config = KVCacheEngineConfig(
        max_num_seqs=max(c, 16),
        max_model_len=args.context + args.steps + 16,
        attention_backend=backend,  # type: ignore[arg-type]
        cuda_graphs=graphs,
        cuda_graph_max_len=args.context + args.steps + 16,
        num_blocks=c * (-(-(args.context + args.steps + 16) // 16)) + 8,
    )
    engine = KVCacheEngine(model, config, device="cuda")
    gen = torch.Generator().manual_seed(c)
    for i in range(c):
        prompt = torch.randint(0, 32_000, (args.context,), generator=gen).tolist()
        engine.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
        )
    times = []
    while engine.has_unfinished():
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.step()
        torch.cuda.synchronize()
        if outputs and all(len(o.new_token_ids) == 1 for o in outputs) and len(outputs) == c:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:] or times)


def _ipc_ms(nbytes: int) -> dict[str, float]:
    """One CUDA tensor sent to a child process and back: as IPC handles vs through host memory."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: dict[str, float] = {}
    for how in ("ipc", "host"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_echo, args=(child, how))
        proc.start()
        x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            parent.send(x if how == "ipc" else x.cpu())
            parent.recv()
            times.append(time.perf_counter() - start)
        parent.send(None)
        proc.join()
        results[how] = 1e3 * statistics.median(times[1:])
    return results


def _echo(conn: object, how: str) -> None:
    while True:
        x = conn.recv()  # type: ignore[attr-defined]
        if x is None:
            return
        y = x if how == "ipc" else x.cuda()
        torch.cuda.synchronize()
        conn.send(int(y.shape[0]))  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    print(f"device {device}; torch {torch.__version__}; layers {args.layers}, heads "
          f"{args.heads}/{args.kv_heads} x 128, "
          f"bf16, context {args.context}, {args.steps} decode steps")  # fmt: skip
    model = _model(args)
    rows: list[dict[str, object]] = []
    for c in map(int, args.concurrency.split(",")):
        figures: dict[str, float] = {}
        for route in ROUTES:
            try:
                figures[route] = _decode_steps_ms(model, route, c, args)
            except Exception as exc:  # a route that fails is reported, the others still measured
                print(f"c={c} {route}: {type(exc).__name__}: {exc}")
        base = figures.get("torch")
        for route, ms in figures.items():
            rows.append(
                {
                    "c": c,
                    "route": route,
                    "step_ms": round(ms, 3),
                    "vs_torch": round(base / ms, 2) if base else None,
                }
            )
    ipc = _ipc_ms(64 << 20)
    lines = ["| c | route | decode step ms | speed-up vs torch |", "|---|---|---|---|"]
    lines += [f"| {r['c']} | {r['route']} | {r['step_ms']} | {r['vs_torch']}x |" for r in rows]
    lines += ["", "| 64 MiB CUDA tensor to another process and back | ms |", "|---|---|"]
    lines += [
        f"| CUDA IPC handles | {ipc['ipc']:.2f} |",
        f"| through host memory | {ipc['host']:.2f} |",
    ]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(f"{device}, torch {torch.__version__}\n\n{table}\n")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": device,
                    "args": vars(args) | {"json": None, "markdown": None},
                    "decode": rows,
                    "ipc_ms": ipc,
                },
                indent=2,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
