"""scripts/bench_products.py: a tiny run times every layout the CPU offers, and they agree."""

from __future__ import annotations

import pytest

from mstar.engines.native import cpu_kernels
from tests.scripts import load_script


@pytest.mark.skipif(cpu_kernels() is None, reason="needs the native CPU kernels")
def test_a_tiny_run_times_every_layout_and_the_products_agree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_script("bench_products")
    rows = bench.main(["--shapes", "40x64,16x32", "--rows", "1,7", "--repeats", "1"])
    assert [(r["out"], r["in"], r["dtype"], r["rows"]) for r in rows] == [
        (o, i, dtype, n)
        for dtype in ("float32", "bfloat16")
        for o, i in ((40, 64), (16, 32))
        for n in (1, 7)
    ]
    for r in rows:
        rates = r["gflop_per_s"]
        assert {"out_in", "in_out", "tiled"} <= set(rates) and all(v > 0 for v in rates.values())
        assert r["chosen"] in rates
        assert r["ratio_to_f_linear"] == pytest.approx(rates[r["chosen"]] / rates["out_in"])
        assert r["max_diff"] < (1e-5 if r["dtype"] == "float32" else 2e-2), r
    assert "÷F.linear" in capsys.readouterr().out
