"""scripts/bench_orpheus.py on orpheus-tiny: the three systems do the same work; the report is
complete."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_orpheus")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_arguments_are_validated(bench: ModuleType) -> None:
    settings = bench.parse_args(["--concurrency", "1,4", "--max-tokens", "56"])
    assert settings.concurrency == (1, 4) and settings.num_frames == 8
    assert settings.samples_per_request == 8 * 2048
    for bad in (
        ["--max-tokens", "30"],
        ["--max-tokens", "0"],
        ["--concurrency", "0"],
        ["--concurrency", "x"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_tiny_run_compares_equal_work(bench: ModuleType, tmp_path: Path) -> None:
    data = bench.main(
        [
            "--config",
            "orpheus-tiny",
            "--concurrency",
            "1",
            "--max-tokens",
            "28",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    assert json.loads((tmp_path / "bench_orpheus.json").read_text()) == data
    assert (tmp_path / "bench_orpheus.png").stat().st_size > 0
    results = {r["target"]: r["summary"] for r in data["results"]}
    assert set(results) == {"mstar", "transformers"}
    # 5 requests (5 x c) of 4 frames, 2048 samples each, from every system.
    audio_s = 5 * 4 * 2048 / 24000
    for summary in results.values():
        assert (summary["num_requests"], summary["num_failed"]) == (5, 0)
        assert summary["audio_s"] == pytest.approx(audio_s)
        assert summary["ttfa_s"]["p50"] > 0 and summary["rtf"]["p95"] > 0
    (floor,) = data["orpheus"]["floor"]
    assert floor["num_requests"] == 5 and floor["audio_s"] == pytest.approx(audio_s)
    # Four frames: the first window emits frames 0-1, the end of the stream re-decodes it for 2-3.
    rows = {b["target"]: b for b in data["orpheus"]["breakdown"]}
    assert set(rows) == {"mstar", "transformers", "floor"}
    for row in rows.values():
        assert row["num_windows"] == 5 * 2 and row["codec_s"] > 0 and row["llm_s"] > 0
    assert rows["mstar"]["num_steps"] == rows["floor"]["num_steps"] == 5 * 28
    assert 0 < rows["mstar"]["llm_forward_s"] < rows["mstar"]["llm_s"]
    assert rows["transformers"]["num_steps"] == 5 * 28  # tokens generated
    verdicts = data["orpheus"]["targets"]["verdicts"]
    assert set(verdicts) == {"audio_s_per_s", "ttfa_p50", "floor_efficiency"}
    assert all(v["value"] is not None and v["value"] > 0 for v in verdicts.values())
