"""Benchmark prefill attention: mstar's native kernel over the paged cache against torch's
scaled-dot-product attention over the same keys, side by side in one run.

For each case (a mask kind, a dtype, a head layout) the same query rows attend over the same
keys: `native` is `prefill_attention` reading the keys in place through a block table (what
the engine runs for float32 and bfloat16 chunks); `torch` is what it runs without the native
kernels: the keys gathered from their blocks, then `F.scaled_dot_product_attention` with
`is_causal` or a boolean mask. Reported: the best of `--repeats` times of each and the ratio
torch / native (above 1: the kernel is faster), and the largest difference between them.

Cases: `causal` (a whole prompt), `continuation` (the last chunk of a prompt split by chunked
prefill: its rows see the cached prefix), `frames` (block-causal: each row sees its frame
and the frames before, as V-JEPA 2's predictor and BAGEL's contexts do).

    python scripts/bench_prefill.py                       # 1,536 keys, one thread
    python scripts/bench_prefill.py --keys 4096 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mstar.engines.native import cpu_kernels

BLOCK = 16


def _best(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def run_case(
    kind: str, dtype: torch.dtype, keys: int, heads: int, kv_heads: int, dim: int, repeats: int
) -> dict[str, object]:
    """Time one case both ways; return its row."""
    kernels = cpu_kernels()
    assert kernels is not None, "the native kernels did not build"
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-keys // BLOCK)
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    rows = keys // 3 if kind == "continuation" else keys
    position = torch.arange(keys - rows, keys)
    lens = ((position // 256) + 1) * 256 if kind == "frames" else position + 1
    lens = lens.clamp(max=keys).long()
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    tables, seqs = order[None].long().contiguous(), torch.zeros(rows, dtype=torch.long)

    def native() -> torch.Tensor:
        return kernels.prefill_attention(q, k_cache, v_cache, tables, seqs, lens, scale)

    mask = None if kind == "causal" else torch.arange(keys)[None, :] < lens[:, None]

    def reference() -> torch.Tensor:
        ks = k_cache.index_select(0, order).flatten(0, 1)[:keys].transpose(0, 1)
        vs = v_cache.index_select(0, order).flatten(0, 1)[:keys].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            ks[None],
            vs[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=heads != kv_heads,
        )
        return out[0].transpose(0, 1)

    native_s, got = _best(native, repeats)
    torch_s, want = _best(reference, repeats)
    return {
        "case": kind,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "keys": keys,
        "heads": f"{heads}/{kv_heads}x{dim}",
        "native_ms": 1e3 * native_s,
        "torch_ms": 1e3 * torch_s,
        "ratio": torch_s / native_s,
        "max_diff": float((got.float() - want.float()).abs().max()),
    }


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    """Run every case; print the configuration and the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, default=1536)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", default="8/4x32,9/3x64,8/2x128", help="heads/kv_heads x dim")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("bench_prefill", json.dumps({k: str(v) for k, v in vars(args).items()}))
    layouts = []
    for text in args.layouts.split(","):
        heads, rest = text.split("/")
        kv_heads, dim = rest.split("x")
        layouts.append((int(heads), int(kv_heads), int(dim)))
    rows = [
        run_case(kind, dtype, args.keys, heads, kv_heads, dim, args.repeats)
        for kind in ("causal", "continuation", "frames")
        for dtype in (torch.float32, torch.bfloat16)
        for heads, kv_heads, dim in layouts
    ]
    print(
        "\n| case | dtype | rows x keys | heads | native ms | torch ms | torch / native |", end=""
    )
    print(" max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['dtype']} | {r['rows']} x {r['keys']} | {r['heads']} | "
            f"{r['native_ms']:.1f} | {r['torch_ms']:.1f} | {r['ratio']:.2f}x | "
            f"{r['max_diff']:.1e} |"
        )
    return rows


if __name__ == "__main__":
    main()
