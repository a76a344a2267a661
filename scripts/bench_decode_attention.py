"""Benchmark decode attention over long contexts against the memory-bandwidth floor.

A decode step's attention must read every cached key and value of its rows once: for `rows`
sequences of `keys` tokens, `rows x keys x kv_heads x head_dim x 2` elements at the cache's
width. `native` is `decode_attention` reading them in place through block tables (what the
engine runs for decode rows); `torch` is the engine's path without the kernel: the
rows' blocks gathered (`index_select`), then `F.scaled_dot_product_attention` with each KV
head's query heads folded into the query axis. Reported per case: the bytes of keys and values
a call reads, the best of `--repeats` times of each side, the native kernel's achieved GB/s and
its % of the memory bandwidth measured in the same run with the same threads
(`mstar.bench.machine.measure_bandwidth`, best of the run), the ratio torch / native (above 1:
the kernel is faster), and the largest difference between them.

Block tables (`--tables`): `shuffled` gives each row blocks from all over the cache, as a
long-running engine's tables become once requests have come and gone; `ordered` gives each row
consecutive blocks, as a fresh engine's prefills take them. Block sizes (`--block-sizes`): the
engine's default is 16 tokens; vLLM's CPU backend takes 128. A row's blocks are runs of
`block x kv_heads x head_dim` elements that a core reads in order: the longer the run, the
more of it the core's own prefetchers stream, and the nearer one thread comes to the
bandwidth it reaches over one long array.

The caches of a case are allocated `--pool-mib` deep and cycled through call by call, as a
model's layers are: a case whose keys fit in the CPU's caches would otherwise be timed from
them, not from memory. They are advised into huge pages as the engine's cache is
(`mstar.engines.kv_cache.advise_huge_pages`; `--small-pages` leaves them in 4 KiB pages).

Layouts: `tiny` (bench_llm's tiny Llama: 8 query heads, 4 KV heads, head_dim 32) and
`smollm2` (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64).

    python scripts/bench_decode_attention.py                  # one thread
    python scripts/bench_decode_attention.py --threads 2 --keys 8192 --rows 1
    python scripts/bench_decode_attention.py --keys 1600 --rows 16 --layouts tiny \
        --block-sizes 16,128 --tables shuffled,ordered
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mstar.bench.machine import best_seconds, measure_bandwidth
from mstar.engines.kv_cache import advise_huge_pages
from mstar.engines.native import cpu_kernels

LAYOUTS = {"tiny": (8, 4, 32), "smollm2": (9, 3, 64)}  # heads, kv_heads, head_dim


def run_case(
    layout: str,
    dtype: torch.dtype,
    keys: int,
    rows: int,
    repeats: int,
    pool_bytes: int,
    huge_pages: bool = True,
    block: int = 16,
    tables_kind: str = "shuffled",
) -> dict[str, object]:
    """Time one case both ways; return its row."""
    kernels = cpu_kernels()
    assert kernels is not None, "the native kernels did not build"
    heads, kv_heads, dim = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    per_row = -(-keys // block)
    num_blocks = rows * per_row
    element = torch.empty(0, dtype=dtype).element_size()
    kv_bytes = 2 * rows * keys * kv_heads * dim * element  # what one call must read
    cache_bytes = 2 * num_blocks * block * kv_heads * dim * element
    copies = max(1, min(4096, pool_bytes // cache_bytes))

    def cache() -> torch.Tensor:
        shape = (num_blocks, block, kv_heads, dim)
        out = torch.empty(shape, dtype=dtype)
        if huge_pages:  # as the engine allocates its cache (advised before it is touched)
            advise_huge_pages(out)
        return out.copy_(torch.randn(shape, generator=gen))

    caches = [(cache(), cache()) for _ in range(copies)]
    order = (
        torch.randperm(num_blocks, generator=gen)
        if tables_kind == "shuffled"
        else torch.arange(num_blocks)
    )
    tables = order.view(rows, per_row).contiguous()
    lens = torch.full((rows,), keys, dtype=torch.long)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    flat = tables.reshape(-1)

    def native(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale)

    def reference(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        shape = (rows, per_row * block, kv_heads, dim)
        ks = k_cache.index_select(0, flat).view(shape)[:, :keys].transpose(1, 2)
        vs = v_cache.index_select(0, flat).view(shape)[:, :keys].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.view(rows, kv_heads, heads // kv_heads, dim), ks, vs, scale=scale
        )
        return out.reshape(rows, heads, dim)

    def cycle(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for k_cache, v_cache in caches:
                fn(k_cache, v_cache)

        return run

    native_s = best_seconds(cycle(native), repeats) / copies
    torch_s = best_seconds(cycle(reference), max(1, repeats // 2)) / copies
    got, want = native(*caches[0]), reference(*caches[0])
    return {
        "layout": f"{layout} {heads}/{kv_heads}x{dim}",
        "dtype": str(dtype).removeprefix("torch."),
        "block": block,
        "tables": tables_kind,
        "rows": rows,
        "keys": keys,
        "kv_mb": kv_bytes / 1e6,
        "native_ms": 1e3 * native_s,
        "torch_ms": 1e3 * torch_s,
        "gb_s": kv_bytes / native_s / 1e9,
        "ratio": torch_s / native_s,
        "max_diff": float((got.float() - want.float()).abs().max()),
    }


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    """Run every case; print the configuration, the bandwidth and the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", default="1536,8192", help="context lengths")
    parser.add_argument("--rows", default="1,4,16", help="decode rows per call")
    parser.add_argument("--layouts", default="tiny,smollm2", help=", ".join(LAYOUTS))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--block-sizes", default="16", help="tokens per cache block")
    parser.add_argument("--tables", default="shuffled", help="shuffled, ordered (or both)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pool-mib", type=int, default=1024, help="caches cycled per case")
    parser.add_argument(
        "--small-pages", action="store_true", help="caches in 4 KiB pages, not huge pages"
    )
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    for kind in args.tables.split(","):
        if kind not in ("shuffled", "ordered"):
            raise SystemExit(f"--tables: shuffled or ordered, not {kind!r}")
    torch.set_num_threads(args.threads)
    print("bench_decode_attention", json.dumps({k: str(v) for k, v in vars(args).items()}))
    bandwidth = measure_bandwidth()
    rows = []
    cases = itertools.product(
        args.layouts.split(","),
        [getattr(torch, name) for name in args.dtypes.split(",")],
        map(int, args.keys.split(",")),
        map(int, args.rows.split(",")),
        map(int, args.block_sizes.split(",")),
        args.tables.split(","),
    )
    pool, huge = args.pool_mib << 20, not args.small_pages
    for layout, dtype, keys, count, block, kind in cases:
        rows.append(run_case(layout, dtype, keys, count, args.repeats, pool, huge, block, kind))
        # The machine's bandwidth drifts: the fastest it showed is the strictest.
        bandwidth = max(bandwidth, measure_bandwidth())
    print(
        f"\nmemory bandwidth (best of the run, {torch.get_num_threads()} torch threads): "
        f"{bandwidth / 1e9:.1f} GB/s"
    )
    print(
        "\n| layout | dtype | block | tables | rows | keys | K+V MB | native ms | GB/s "
        "| % bandwidth | torch ms | torch / native | max diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["bandwidth_pct"] = 100 * float(r["gb_s"]) * 1e9 / bandwidth  # type: ignore[arg-type]
        print(
            f"| {r['layout']} | {r['dtype']} | {r['block']} | {r['tables']} | {r['rows']} | "
            f"{r['keys']} | {r['kv_mb']:.1f} | "
            f"{r['native_ms']:.3f} | {r['gb_s']:.1f} | {r['bandwidth_pct']:.0f}% | "
            f"{r['torch_ms']:.3f} | {r['ratio']:.2f}x | {r['max_diff']:.1e} |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"bandwidth_bytes_per_s": bandwidth, "rows": rows}, out, indent=1)
    return rows


if __name__ == "__main__":
    main()
