"""scripts/bench_llm.py: a missing peer environment, tiny runs, rounds combined."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_llm")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_missing_peer_environment_says_how_to_make_it(bench: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"setup_vllm_peer\.sh"):
        bench.main(
            [
                "--models",
                "tiny",
                "--concurrency",
                "1",
                "--new-tokens",
                "2",
                "--waves",
                "1",
                "--peer",
                "vllm",
                "--peer-python",
                str(tmp_path / "none" / "python"),
                "--out",
                str(tmp_path),
            ]
        )


def test_tiny_run_reports_throughput_ratio_and_floor(bench: ModuleType, tmp_path: Path) -> None:
    bench.main(
        [
            "--models",
            "tiny",
            "--concurrency",
            "1,2",
            "--new-tokens",
            "4",
            "--prompt-len",
            "8",
            "--waves",
            "1",
            "--block-size",
            "4",
            "--out",
            str(tmp_path),
        ]
    )
    rows = json.loads((tmp_path / "bench_llm_summary.json").read_text())
    assert [(r["model"], r["dtype"], r["concurrency"], r["block_size"]) for r in rows] == [
        ("tiny", "float32", 1, 4),
        ("tiny", "float32", 2, 4),
    ]
    for row in rows:
        assert row["failed"] == 0 and row["mstar_tokens_per_s"] > 0 and row["ratio"] > 0
        assert row["floor_ms"] > 0 and row["floor_pct"] > 0 and row["flop_ms"] > 0
        assert row["floor_ms"] == pytest.approx(
            row["step_bytes"] / row["bandwidth_bytes_per_s"] * 1e3
        )
        assert row["roofline_ms"] == max(row["floor_ms"], row["flop_ms"])
        assert row["roofline_pct"] >= row["floor_pct"]
        # Its decode-only steps of c rows: each row attends its prompt and the tokens after
        # (8 + 1 to 8 + 3 keys), more bytes than a step at no context.
        assert row["decode_step_ms"] > 0 and 9 <= row["decode_context"] <= 11
        no_context = bench.decode_step_cost(bench.TINY_CONFIG, 4, row["concurrency"], 0)[0]
        assert row["decode_step_bytes"] > no_context
        floor_ms = row["decode_step_bytes"] / row["bandwidth_bytes_per_s"] * 1e3
        assert row["decode_floor_pct"] == pytest.approx(100 * floor_ms / row["decode_step_ms"])
        assert row["kv_floor_ms"] < row["floor_ms"] and 0 < row["kv_share_pct"] < 100
        assert "vllm_tokens_per_s" not in row
    assert (tmp_path / "bench_llm_tiny_float32.json").exists()


def test_rounds_combine_as_medians_with_the_ratios_range(bench: ModuleType) -> None:
    rows = [
        {
            "model": "tiny",
            "concurrency": 4,
            "mstar_tokens_per_s": t,
            "ratio": r,
            "vllm_ratio": v,
            "failed": f,
            "mstar_peak_mib": m,
            "hf_peak_mib": 1.0,
        }
        for t, r, v, f, m in [
            (100.0, 1.2, 0.9, 0, 5.0),
            (300.0, 1.6, 1.4, 1, 7.0),
            (200.0, 1.3, 1.1, 0, 6.0),
        ]
    ]
    combined = bench.combine_rounds(rows)
    assert (
        combined["mstar_tokens_per_s"] == 200.0
        and combined["ratio"] == 1.3
        and combined["vllm_ratio"] == 1.1
    )
    assert (combined["ratio_min"], combined["ratio_max"]) == (1.2, 1.6)
    assert (combined["vllm_ratio_min"], combined["vllm_ratio_max"]) == (0.9, 1.4)
    assert combined["failed"] == 1 and combined["mstar_peak_mib"] == 7.0 and combined["rounds"] == 3
    assert bench._ratio_cell(combined, "vllm_ratio") == "1.10x (0.90-1.40)"


def test_rounds_measure_every_point_again(bench: ModuleType, tmp_path: Path) -> None:
    bench.main(
        [
            "--models",
            "tiny",
            "--concurrency",
            "1",
            "--new-tokens",
            "3",
            "--prompt-len",
            "8",
            "--waves",
            "1",
            "--rounds",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    (row,) = json.loads((tmp_path / "bench_llm_summary.json").read_text())
    assert row["rounds"] == 2 and row["failed"] == 0
    assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    for index in (1, 2):
        result = json.loads((tmp_path / f"bench_llm_tiny_float32_round{index}.json").read_text())
        assert result["config"]["rounds"] == 2
    with pytest.raises(SystemExit):
        bench.main(["--models", "tiny", "--rounds", "0", "--out", str(tmp_path)])
