"""scripts/bench_pi05.py on pi05-tiny: arguments, and both targets return the same actions."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.scripts import load_script

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_pi05")


def test_arguments_are_validated(bench: ModuleType) -> None:
    settings = bench.parse_args(["--concurrency", "1,4"])
    assert (
        settings.concurrency == (1, 4) and settings.config == "pi05-small" and settings.threads == 1
    )
    assert settings.out == "results/pi05"
    for bad in (
        ["--concurrency", "0"],
        ["--concurrency", "x"],
        ["--threads", "0"],
        ["--num-requests", "0"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_tiny_run_compares_equal_actions(bench: ModuleType, tmp_path: Path) -> None:
    data = bench.main(
        [
            "--config",
            "pi05-tiny",
            "--concurrency",
            "1,2",
            "--num-templates",
            "8",
            "--out",
            str(tmp_path),
        ]
    )
    assert json.loads((tmp_path / "bench_pi05.json").read_text()) == data
    assert (tmp_path / "bench_pi05.png").stat().st_size > 0
    assert {(r["target"], r["point"]) for r in data["results"]} == {
        (t, c) for t in ("mstar", "openpi") for c in (1.0, 2.0)
    }
    report = data["pi05"]
    horizon = report["horizon"]
    assert horizon == 10 and report["flops_per_chunk"] > 0 and report["gemm_peak_flops_per_s"] > 0
    # Every request of both targets (5 x c measured and c warm-up per point) compared.
    agreement = report["agreement"]
    assert agreement["agree"] and agreement["num_compared"] == (5 + 1) + (10 + 2)
    assert agreement["max_abs_diff"] < 1e-3
    for c, num in (("1", 5), ("2", 10)):
        row = report["summary"][c]
        for target in ("mstar", "openpi"):
            r = row[target]
            assert (r["num_requests"], r["num_failed"]) == (num, 0)
            assert 0 < r["jct_p50_s"] <= r["jct_p95_s"] < 10
            assert (
                r["actions_per_s"] == pytest.approx(r["chunks_per_s"] * horizon)
                and r["chunks_per_s"] > 0
            )
            assert 0 <= r["within_budget"] <= 1
        assert (
            row["actions_per_s_ratio"] > 0 and row["jct_p50_ratio"] > 0 and row["ceiling_ratio"] > 0
        )
    rows = {(b["target"], b["concurrency"]): b for b in report["breakdown"]}
    assert set(rows) == {(t, c) for t in ("mstar", "openpi") for c in (1, 2)}
    for (_target, c), b in rows.items():
        assert (
            b["num_requests"] == 5 * c and b["busy_s"] > 0 and b["vision_s"] > 0 and b["flow_s"] > 0
        )
    # mstar's measured window: one prefix and ten Euler steps per request, rows batched.
    mstar = rows[("mstar", 2)]
    assert mstar["vision_steps"] <= 10 and mstar["flow_steps"] <= 10 * 10
    assert 1 <= mstar["llm_firings_per_step"] <= 2 and mstar["llm_forward_s"] <= mstar["llm_s"]
    verdicts = report["verdicts"]
    assert verdicts["actions_per_s_c16"]["met"] is None  # no c = 16 point in this run
    assert isinstance(verdicts["jct_p50_c1"]["met"], bool)
    assert np.isfinite(verdicts["jct_p50_c1"]["value"])
