"""scripts/bench_prefill.py: a tiny run compares both ways on every case, and they agree."""

from __future__ import annotations

import pytest

from mstar.engines.native import cpu_kernels
from tests.scripts import load_script


@pytest.mark.skipif(cpu_kernels() is None, reason="needs the native CPU kernels")
def test_a_tiny_run_times_every_case_and_the_outputs_agree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_script("bench_prefill")
    rows = bench.main(["--keys", "300", "--repeats", "1", "--layouts", "4/2x16,2/2x64"])
    assert {(r["case"], r["dtype"]) for r in rows} == {
        (case, dtype)
        for case in ("causal", "continuation", "frames")
        for dtype in ("float32", "bfloat16")
    }
    for r in rows:
        assert r["native_ms"] > 0 and r["torch_ms"] > 0
        assert r["max_diff"] < (1e-5 if r["dtype"] == "float32" else 5e-2), r
    assert "| case | dtype |" in capsys.readouterr().out
