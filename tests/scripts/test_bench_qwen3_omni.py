"""scripts/bench_qwen3_omni.py: arguments are checked; a tiny run reports every target, point and ratio."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_qwen3_omni.py"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_qwen3_omni", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_qwen3_omni"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def test_arguments_are_validated(bench: ModuleType) -> None:
    full = bench.parse_args([])
    assert (full.config, full.concurrency, full.transformers) == (
        "qwen3-omni-small",
        (1, 4, 16),
        True,
    )
    quick = bench.parse_args(["--quick", "--concurrency", "2"])
    assert quick.concurrency == (2,) and quick.max_tokens < full.max_tokens
    assert not bench.parse_args(["--no-transformers"]).transformers
    for bad in (
        ["--concurrency", "0"],
        ["--concurrency", "x"],
        ["--max-tokens", "0"],
        ["--max-frames", "0"],
        ["--warmup", "-1"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.slow
def test_a_tiny_run_reports_every_target(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    data = bench.main(
        ["--config", "qwen3-omni-tiny", "--concurrency", "1,2", "--max-tokens", "4", "--max-frames", "8",
         "--num-requests", "2", "--warmup", "0", "--out", str(tmp_path)]
    )  # fmt: skip
    assert all(r["summary"]["num_failed"] == 0 for r in data["results"])
    summary = data["qwen3_omni"]["summary"]
    assert set(summary) == {"1", "2"}
    for row in summary.values():
        assert {"mstar", "stage", "transformers"} <= set(row) and row["mstar"]["audio_s_per_s"] > 0
        assert row["ttfa_p50_ratio"] is not None and row["rtf_p50_ratio"] is not None
    assert set(data["qwen3_omni"]["verdicts"]) == {"ttfa_p50_ratio_c1", "ttfa_p50_ratio_c2"}
    assert (
        json.loads((tmp_path / "bench_qwen3_omni.json").read_text())["qwen3_omni"]["settings"][
            "max_frames"
        ]
        == 8
    )
    assert (tmp_path / "bench_qwen3_omni.png").stat().st_size > 0
