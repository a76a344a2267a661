"""`mstar bench` / `python -m mstar.bench`: options to measurements to files."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mstar.cli.bench import add_bench_arguments, bench_command, main

Server = tuple[str, list[tuple[str, Any]]]

FUNCTIONS = """
import asyncio
from mstar.bench import OutputEvent

async def fast(request):
    for _ in range(request.max_tokens or 3):
        await asyncio.sleep(0)
        yield OutputEvent("text", num_tokens=1)

async def slow(request):
    for _ in range(request.max_tokens or 3):
        for _ in range(5):
            await asyncio.sleep(0)
        yield OutputEvent("text", num_tokens=1)
"""


def test_module_help_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mstar.bench", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "--concurrency" in done.stdout and "--baseline" in done.stdout


def test_speech_server_sweep_writes_table_json_and_png(
    synthetic_server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = synthetic_server
    argv = [
        "--url", url, "--endpoint", "speech", "--model", "orpheus", "--voice", "tara",
        "--concurrency", "1", "2", "--warmup", "1", "--prompt", "cli speech",
        "--no-progress", "--out", str(tmp_path), "--bench-name", "speech",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "speech: concurrency sweep" in out and "RTF: client E2E latency / audio duration" in out
    data = json.loads((tmp_path / "speech.json").read_text())
    assert data["config"]["url"] == url and data["config"]["endpoint"] == "speech"
    assert [r["point"] for r in data["results"]] == [1.0, 2.0]
    for entry in data["results"]:
        summary = entry["summary"]
        assert summary["num_failed"] == 0
        assert summary["num_requests"] == 5 * int(entry["point"])
        assert summary["audio_s"] == pytest.approx(summary["num_requests"] * 9600 / 24_000)
        assert summary["ttfa_s"]["count"] == summary["num_requests"]
        assert summary["viable_fraction"] is not None
    assert (tmp_path / "speech.png").read_bytes()[:4] == b"\x89PNG"


def test_function_target_with_baseline_from_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = tmp_path / "engines.py"
    module.write_text(FUNCTIONS)
    argv = [
        "--target", f"{module}:fast", "--baseline", f"loop={module}:slow",
        "--rate", "2000", "inf", "--num-requests", "6", "--max-tokens", "4", "--ignore-eos",
        "--no-progress", "--out", str(tmp_path / "res"),
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fast vs baselines" in out
    data = json.loads((tmp_path / "res" / "mstar-bench.json").read_text())
    assert (data["primary"], data["baselines"]) == ("fast", ["loop"])
    assert data["config"]["load"]["rates"] == [2000.0, "inf"]
    assert {r["point"] for r in data["results"]} == {2000.0, "inf"}
    assert all(r["summary"]["num_output_tokens"] == 24 for r in data["results"])
    assert {r["metric"] for r in data["ratios"]} >= {"output_tokens_per_s", "tpot_s.p50"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--url", "http://127.0.0.1:9", "--target", "x:y"], "exactly one of --url"),
        ([], "exactly one of --url"),
        (["--target", "no_such_module_here:f"], "cannot import"),
        (["--target", "json:no_such_function"], "no attribute"),
        (["--target", "json:loads", "--baseline", "json:dumps"], "NAME=MODULE:FUNC"),
        (["--url", "http://127.0.0.1:9", "--extra-body", "[1]"], "JSON object"),
        (["--url", "http://127.0.0.1:9", "--concurrency", "0"], "positive integer"),
    ],
)
def test_bad_options_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_every_request_failing_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--url", "http://127.0.0.1:9", "--concurrency", "1", "--warmup", "0", "--timeout", "5",
        "--no-progress", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 1
    assert "every request failed" in capsys.readouterr().err
    assert (tmp_path / "mstar-bench.json").exists()  # failures are results too


def test_wires_into_a_subcommand_parser(tmp_path: Path) -> None:
    module = tmp_path / "engines.py"
    module.write_text(FUNCTIONS)
    parser = argparse.ArgumentParser(prog="mstar")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench")
    add_bench_arguments(bench)
    bench.set_defaults(func=bench_command)
    args = parser.parse_args(
        [
            "bench",
            "--target",
            f"{module}:fast",
            "--concurrency",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.func(args) == 0
    assert (tmp_path / "mstar-bench.json").exists() and (tmp_path / "mstar-bench.png").exists()
