"""scripts/bench_qwen3_omni.py: arguments are checked; a tiny run reports every target, point,
ratio and component's CPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_qwen3_omni")


def test_arguments_are_validated(bench: ModuleType) -> None:
    full = bench.parse_args([])
    assert (full.config, full.concurrency, full.transformers) == (
        "qwen3-omni-small",
        (1, 4, 16),
        False,
    )
    assert full.shapes == (("reference", 256, 960), ("short", 32, 120))
    assert (full.requests_at(1), full.requests_at(16)) == (3, 32)  # long answers: fewer
    quick = bench.parse_args(["--quick", "--concurrency", "2"])
    assert quick.concurrency == (2,) and quick.shapes == (("short", 32, 120),)
    assert quick.requests_at(2) == 10
    assert bench.parse_args(["--transformers"]).transformers
    custom = bench.parse_args(["--max-frames", "40", "--num-requests", "2"])
    assert custom.shapes == (("custom", 256, 40),) and custom.requests_at(16) == 2
    mixed = bench.parse_args(["--shapes", "mixed"])
    assert mixed.shapes == (("mixed", 256, 960),)
    varied = bench.dataclasses.replace(mixed, varied=True)
    lengths = {
        bench.request_data(varied, bench.BenchRequest(f"concurrency-4-{i}", "hi"))[
            "max_audio_frames"
        ]
        for i in range(8)
    }
    assert lengths == {240, 480, 720, 960}
    assert (
        bench.request_data(mixed, bench.BenchRequest("concurrency-4-1", "hi"))["max_tokens"] == 256
    )
    for bad in (
        ["--concurrency", "0"],
        ["--concurrency", "x"],
        ["--max-tokens", "0"],
        ["--max-frames", "0"],
        ["--warmup", "-1"],
        ["--shapes", "long"],
        ["--shapes", "short", "--max-tokens", "4"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.slow
def test_a_tiny_run_reports_every_target(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    data = bench.main(
        [
            "--config",
            "qwen3-omni-tiny",
            "--concurrency",
            "1,2",
            "--max-tokens",
            "4",
            "--max-frames",
            "8",
            "--num-requests",
            "2",
            "--warmup",
            "0",
            "--transformers",
            "--out",
            str(tmp_path),
        ]
    )
    (shape,) = data["shapes"].values()
    assert all(r["summary"]["num_failed"] == 0 for r in shape["results"])
    summary = shape["qwen3_omni"]["summary"]
    assert set(summary) == {"1", "2"}
    for row in summary.values():
        assert {"mstar", "stage", "transformers"} <= set(row) and row["mstar"]["audio_s_per_s"] > 0
        assert row["ttfa_p50_ratio"] is not None and row["rtf_p50_ratio"] is not None
    assert set(shape["qwen3_omni"]["verdicts"]) == {"ttfa_p50_ratio_c1", "ttfa_p50_ratio_c2"}
    cpu = shape["qwen3_omni"]["cpu_ms_per_audio_s"]["2"]
    assert {"thinker", "talker", "code2wav", "loop"} <= set(cpu["mstar"])
    assert cpu["mstar"]["talker"] > 0
    assert {"thinker", "talker", "code2wav"} <= set(cpu["stage"]) and cpu["stage"]["code2wav"] > 0
    assert cpu["transformers"]["generate"] > 0
    written = json.loads((tmp_path / "bench_qwen3_omni_custom.json").read_text())
    assert written["qwen3_omni"]["settings"]["max_frames"] == 8
    assert (tmp_path / "bench_qwen3_omni_custom.png").stat().st_size > 0
