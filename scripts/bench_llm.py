"""Benchmark KVCacheEngine decode throughput against transformers' `generate`.

For each model and concurrency c, c requests with random prompts decode `--new-tokens`
greedy tokens each (no early stop), once through mstar's `KVCacheEngine` (continuous
batching over the paged cache) and once through transformers' `generate` on the same
weights (one batch of c, same prompt length, so no padding). Reported per run:
decode throughput (generated tokens / wall time), TTFT and TPOT
(TPOT = (E2E - TTFT) / (new_tokens - 1), averaged over requests), peak memory
(CPU: peak RSS of the process during the run; CUDA: peak allocated), and the
throughput ratio mstar / transformers.

Models: `tiny` (Llama, hidden 256, 4 layers, 8 heads / 4 KV heads, intermediate 512,
vocab 32000, fp32, random weights) and `smollm2` (SmolLM2-135M-Instruct, real weights).

    python scripts/bench_llm.py                      # full default sweep
    python scripts/bench_llm.py --models tiny --concurrency 1,16 --new-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.zoo.hf_checkpoint import save_state_dict
from mstar.zoo.llama import load_llama

TINY_CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def make_tiny_checkpoint(directory: Path) -> Path:
    """Write a random-weight tiny Llama checkpoint (transformers' initialisation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY_CONFIG.items() if k != "model_type"})
    model = LlamaForCausalLM(config)
    save_state_dict(model.state_dict(), directory, config.to_dict())
    return directory


def checkpoint_for(name: str, scratch: Path) -> Path:
    """Return the checkpoint directory of a benchmark model."""
    if name == "tiny":
        return make_tiny_checkpoint(scratch / "tiny")
    if name == "smollm2":
        from mstar.zoo.smollm2 import smollm2_checkpoint_dir

        return smollm2_checkpoint_dir()
    raise SystemExit(f"unknown model {name!r} (choose tiny, smollm2)")


class PeakMemory:
    """Peak memory during a block: CUDA allocator peak, or the process's peak RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            # Linux: "5" resets the VmHWM high-water mark of this process.
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                self.peak_bytes = int(line.split()[1]) * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_mstar(
    engine: KVCacheEngine, prompts: list[list[int]], new_tokens: int, device: torch.device
) -> dict[str, float]:
    """Decode all prompts concurrently through the engine; return timings."""
    params = SamplingParams.greedy(max_tokens=new_tokens)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    count = 0
    with PeakMemory(device) as mem:
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished():
            outs = engine.step()
            _sync(device)
            now = time.perf_counter()
            for out in outs:
                count += len(out.new_token_ids)
                first.setdefault(out.request_id, now)
                if out.finished:
                    done[out.request_id] = now
        elapsed = time.perf_counter() - start
    assert count == len(prompts) * new_tokens, count
    ttft = sum(first[r] - start for r in first) / len(first)
    tpot = sum((done[r] - first[r]) / max(new_tokens - 1, 1) for r in done) / len(done)
    return {"seconds": elapsed, "tokens_per_s": count / elapsed, "ttft_s": ttft,
            "tpot_s": tpot, "peak_mib": mem.peak_bytes / 2**20}


def run_transformers(
    hf: Any, prompts: list[list[int]], new_tokens: int, device: torch.device
) -> dict[str, float]:
    """Decode the prompts as one batch with transformers' `generate`; return timings."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> torch.Tensor:
        return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        t0 = time.perf_counter()
        generate(1)
        _sync(device)
        ttft = time.perf_counter() - t0
        with PeakMemory(device) as mem:
            start = time.perf_counter()
            out = generate(new_tokens)
            _sync(device)
            elapsed = time.perf_counter() - start
    count = (out.shape[1] - ids.shape[1]) * len(prompts)
    assert count == len(prompts) * new_tokens, count
    return {"seconds": elapsed, "tokens_per_s": count / elapsed, "ttft_s": ttft,
            "tpot_s": (elapsed - ttft) / max(new_tokens - 1, 1), "peak_mib": mem.peak_bytes / 2**20}


def main(argv: list[str] | None = None) -> None:
    """Run the sweep and print a table (and write JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"])
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("bench_llm.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    levels = [int(c) for c in args.concurrency.split(",")]
    config = {
        "models": args.models, "concurrency": levels, "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len, "device": str(device), "backend": args.backend,
        "cuda_graphs": not args.no_cuda_graphs, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(),
    }
    print("bench_llm", json.dumps(config))
    results: list[dict[str, Any]] = []
    header = (f"{'model':8} {'conc':>4} | {'mstar tok/s':>11} {'TPOT ms':>8} {'peak MiB':>9} | "
              f"{'hf tok/s':>9} {'TPOT ms':>8} {'peak MiB':>9} | {'ratio':>6}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            checkpoint = checkpoint_for(name, Path(scratch))
            model = load_llama(checkpoint, device=device)
            hf: Any = None
            if not args.skip_transformers:
                from transformers import LlamaForCausalLM

                dtype = next(model.parameters()).dtype
                hf = LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).to(device).eval()
            vocab = model.config.vocab_size
            gen = torch.Generator().manual_seed(1)
            for conc in levels:
                prompts = torch.randint(0, vocab, (conc, args.prompt_len), generator=gen).tolist()
                tokens_per_seq = args.prompt_len + args.new_tokens
                engine = KVCacheEngine(model, KVCacheEngineConfig(
                    block_size=16, num_blocks=conc * (-(-tokens_per_seq // 16)) + 8,
                    max_num_seqs=max(conc, 1), max_num_batched_tokens=max(2048, args.prompt_len),
                    attention_backend=args.backend, cuda_graphs=not args.no_cuda_graphs,
                ), device=device)
                # Warm-up (allocator, kernels, graphs): a short run of the same shape.
                run_mstar(engine, prompts, min(4, args.new_tokens), device)
                ours = run_mstar(engine, prompts, args.new_tokens, device)
                theirs: dict[str, float] | None = None
                if hf is not None:
                    run_transformers(hf, prompts, min(4, args.new_tokens), device)
                    theirs = run_transformers(hf, prompts, args.new_tokens, device)
                ratio = ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs else float("nan")
                results.append({"model": name, "concurrency": conc, "mstar": ours,
                                "transformers": theirs, "ratio": ratio})
                hf_cols = (f"{theirs['tokens_per_s']:9.1f} {theirs['tpot_s'] * 1e3:8.2f} "
                           f"{theirs['peak_mib']:9.0f}" if theirs else f"{'-':>9} {'-':>8} {'-':>9}")
                print(f"{name:8} {conc:4d} | {ours['tokens_per_s']:11.1f} "
                      f"{ours['tpot_s'] * 1e3:8.2f} {ours['peak_mib']:9.0f} | {hf_cols} | "
                      f"{ratio:6.2f}", flush=True)
                del engine
            del model, hf
    args.json.write_text(json.dumps({"config": config, "results": results}, indent=2))
    print(f"wrote {args.json}")



if __name__ == "__main__":
    main()
