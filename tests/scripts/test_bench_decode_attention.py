"""scripts/bench_decode_attention.py: a tiny run times every case, and the kernel agrees with
torch's attention through every block size and table order."""

from __future__ import annotations

import pytest

from mstar.engines.native import cpu_kernels
from tests.scripts import load_script


@pytest.mark.skipif(cpu_kernels() is None, reason="needs the native CPU kernels")
def test_a_tiny_run_covers_every_block_size_and_table_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_script("bench_decode_attention")
    args = "--keys 100 --rows 2 --block-sizes 16,64 --tables shuffled,ordered --repeats 1"
    rows = bench.main([*args.split(), "--pool-mib", "4"])
    assert [(r["layout"].split()[0], r["dtype"], r["block"], r["tables"]) for r in rows] == [
        (layout, dtype, block, tables)
        for layout in ("tiny", "smollm2")
        for dtype in ("float32", "bfloat16")
        for block in (16, 64)
        for tables in ("shuffled", "ordered")
    ]
    for r in rows:
        assert r["native_ms"] > 0 and r["torch_ms"] > 0
        per_key = (128 if "tiny" in r["layout"] else 192) * (4 if r["dtype"] == "float32" else 2)
        assert r["kv_mb"] == pytest.approx(2 * 2 * 100 * per_key / 1e6)  # rows x (K, V) x keys
        assert r["max_diff"] < (1e-5 if r["dtype"] == "float32" else 2e-2), r
    assert "| block | tables |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="shuffled or ordered"):
        bench.main(["--keys", "16", "--rows", "1", "--tables", "random", "--layouts", "tiny"])
