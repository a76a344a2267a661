"""scripts/bench_realtime.py: a tiny run against `mstar serve` reports both paths and cancels."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_realtime.py"


def test_a_tiny_run_reports_both_paths_and_the_cancels() -> None:
    args = [
        "--quick",
        "--concurrency",
        "1,2",
        "--rounds",
        "1",
        "--cancels",
        "2",
        "--max-tokens",
        "4",
    ]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "model: qwen3-omni-tiny served by `mstar serve`" in out
    rows = re.findall(r"^\| (\d+) \| (.*?) \| (.*?) \| (.*?) \|", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2], out
    for _, realtime, sse, _ratio in rows:
        if realtime != "-":  # "-": every answer of a path said nothing (random weights)
            for cell in (realtime, sse):
                p50, p95 = (int(v) for v in cell.split(" / "))
                assert 0 < p50 <= p95
    cancel = re.search(r"over (\d+) cancels; deltas after done: (\d+)", out)
    assert cancel is None or int(cancel[2]) == 0, out
