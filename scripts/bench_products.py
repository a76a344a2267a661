"""Benchmark the linear products: each weight layout mstar can store against torch's `F.linear`
on the checkpoint's `[out, in]` weight, side by side in one run.

For each weight shape, dtype and row count, `x @ W.T` runs through `FusedLinear` in every
layout this CPU offers (`mstar.engines.layers`): `out_in` (torch's `F.linear`, the baseline),
`in_out` (`torch.mm` over the transposed weight), `packed` (oneDNN's blocked layout, where
oneDNN can pack the dtype) and `tiled` (mstar's native tiles: float32 multiply-adds, or
bfloat16 weights widened on load without AVX-512 BF16). Reported: the best of `--repeats`
times of each as GFLOP/s, which layout `choose_layout` picks for those rows, the ratio of the
picked layout's rate to `F.linear`'s (above 1: faster than torch), and the largest difference
of any layout's outputs from `F.linear`'s, relative to its largest output. Decode steps take
1-16 rows; a prompt's prefill takes hundreds.

Shapes (`--shapes`, `OUTxIN` each): by default SmolLM2-135M's q/o (576x576), k/v (192x576),
gate/up (1536x576) and down (576x1536) products.

    python scripts/bench_products.py           # 1, 16 and 512 rows; float32 and bfloat16
    python scripts/bench_products.py --rows 1536 --dtypes bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mstar.engines.layers import IN_OUT, OUT_IN, PACKED, TILED, FusedLinear, choose_layout

LAYOUTS = (OUT_IN, IN_OUT, PACKED, TILED)
SMOLLM2_SHAPES = "576x576,192x576,1536x576,576x1536"


def layout_rates(weight: torch.Tensor, rows: int, repeats: int) -> tuple[dict[str, float], float]:
    """Return GFLOP/s of `x @ W.T` for `rows` rows in each layout this CPU offers, and the
    largest difference of a layout's outputs from `F.linear`'s (relative to its largest)."""
    out_features, in_features = weight.shape
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).to(weight.dtype)
    rates: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for layout in LAYOUTS:
            try:
                fused = FusedLinear.in_layout(weight, layout)
                outputs[layout] = fused(x).float()
            except RuntimeError:
                continue  # not offered here (oneDNN cannot pack the dtype, no native kernels)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                fused(x)
                best = min(best, time.perf_counter() - start)
            rates[layout] = 2 * rows * out_features * in_features / best / 1e9
    want = outputs[OUT_IN]
    diff = max(float((y - want).abs().max()) for y in outputs.values())
    return rates, diff / float(want.abs().max())


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SMOLLM2_SHAPES, help="OUTxIN,... weight shapes")
    parser.add_argument("--rows", default="1,16,512", help="row counts, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",") if s]
    row_counts = [int(r) for r in args.rows.split(",") if r]
    print(
        "bench_products",
        json.dumps(
            {
                "shapes": args.shapes,
                "rows": row_counts,
                "dtypes": args.dtypes,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
            }
        ),
    )
    header = f"{'weight':>10} {'dtype':>9} {'rows':>5} " + " ".join(f"{n:>8}" for n in LAYOUTS)
    print(header + f" {'chosen':>8} {'÷F.linear':>10} {'max diff':>9}  (GFLOP/s)")
    results: list[dict[str, object]] = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for out_features, in_features in shapes:
            weight = torch.randn(
                out_features, in_features, generator=torch.Generator().manual_seed(0)
            ).to(dtype)
            for rows in row_counts:
                rates, diff = layout_rates(weight, rows, args.repeats)
                chosen = choose_layout(weight, (rows,))
                ratio = rates[chosen] / rates[OUT_IN]
                cells = " ".join(f"{rates[n]:8.1f}" if n in rates else f"{'-':>8}" for n in LAYOUTS)
                print(
                    f"{out_features:>4}x{in_features:<5} {dtype_name:>9} {rows:>5} {cells}"
                    f" {chosen:>8} {ratio:>9.2f}x {diff:9.1e}"
                )
                results.append(
                    {
                        "out": out_features,
                        "in": in_features,
                        "dtype": dtype_name,
                        "rows": rows,
                        "gflop_per_s": rates,
                        "chosen": chosen,
                        "ratio_to_f_linear": ratio,
                        "max_diff": diff,
                    }
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
