"""scripts/bench_assistant.py: arguments are checked; a tiny run reports every point and metric."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script

TARGETS = ("mstar", "pipeline")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_assistant")


def test_arguments_are_validated(bench: ModuleType) -> None:
    full = bench.parse_args([])
    assert (full.concurrency, full.max_tokens, full.threads, full.voice_threads) == (
        (1, 4, 16),
        128,
        1,
        1,
    )
    assert full.out == "results/assistant" and full.questions == bench.QUESTIONS
    quick = bench.parse_args(["--quick"])
    assert (quick.concurrency, quick.max_tokens) == ((1, 2), 64)
    explicit = bench.parse_args(["--quick", "--concurrency", "1", "--max-tokens", "24"])
    assert (explicit.concurrency, explicit.max_tokens) == ((1,), 24)  # flags win over --quick
    assert bench.parse_args(["--num-questions", "2"]).questions == bench.QUESTIONS[:2]
    assert not full.prefix_caching and bench.parse_args(["--prefix-caching"]).prefix_caching
    for bad in (
        ["--concurrency", "0"],
        ["--concurrency", "x"],
        ["--max-tokens", "0"],
        ["--num-requests", "0"],
        ["--num-questions", "0"],
        ["--num-questions", str(len(bench.QUESTIONS) + 1)],
        ["--warmup", "-1"],
        ["--threads", "0"],
        ["--voice-threads", "0"],
        ["--chunk-max-tokens", "0"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.slow  # real weights: SmolLM2 twice and the voice twice, a dozen short answers
@pytest.mark.timeout(180)
def test_tiny_run_reports_every_point_and_metric(bench: ModuleType, tmp_path: Path) -> None:
    data = bench.main(
        ["--concurrency", "1", "--max-tokens", "24", "--num-questions", "2", "--out", str(tmp_path)]
    )
    assert json.loads((tmp_path / "bench_assistant.json").read_text()) == data
    assert (tmp_path / "bench_assistant.png").stat().st_size > 0
    assert {(r["target"], r["point"]) for r in data["results"]} == {(t, 1.0) for t in TARGETS}
    for result in data["results"]:
        summary = result["summary"]
        assert (summary["num_requests"], summary["num_failed"]) == (5, 0)  # 5 x c measured
        for key in ("ttft_s", "ttfa_s", "rtf", "e2e_s"):
            assert summary[key]["count"] == 5, (result["target"], key)
        assert summary["audio_s"] > 0 and summary["audio_s_per_s"] > 0
        for request in result["requests"]:  # text streams, then speech
            modalities = [e["modality"] for e in request["events"]]
            assert modalities[0] == "text" and "audio" in modalities
    report = data["assistant"]
    row = report["summary"]["1"]
    for target in TARGETS:
        r = row[target]
        assert (r["num_requests"], r["num_failed"]) == (5, 0)
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] and 0 < r["ttfa_p50_s"] <= r["ttfa_p95_s"]
        assert r["rtf_p50"] > 0 and r["audio_s_per_s"] > 0
    for key in ("ttfa_p50_ratio", "ttft_p50_ratio", "e2e_p50_ratio", "audio_s_per_s_ratio"):
        assert row[key] > 0 and math.isfinite(row[key])
    assert row["pipeline_generate_s_mean"] > 0 and row["pipeline_speak_s_mean"] > 0
    # Greedy on both sides, the same prompt, the same deterministic voice: the same answers.
    agreement = report["agreement"]
    assert agreement["num_compared"] == 5 + 1  # measured and warm-up requests
    assert agreement["num_text_mismatches"] == 0, agreement["mismatches"]
    assert (
        0.9 < agreement["audio_duration_ratio_min"] <= agreement["audio_duration_ratio_max"] < 1.1
    )
    verdict = report["verdicts"]["ttfa_p50_c1"]
    assert isinstance(verdict["met"], bool) and verdict["value"] == row["ttfa_p50_ratio"]
