"""scripts/chaos.py, short: faults injected under load lose, hang and leak nothing."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def chaos() -> ModuleType:
    return load_script("chaos")


def test_arguments_are_validated(chaos: ModuleType) -> None:
    settings = chaos.parse_args(
        ["--duration", "3", "--models", "toy-composite", "--json", "out.json"]
    )
    assert (
        settings.models == ("toy-composite",)
        and settings.duration_s == 3.0
        and settings.json_path == "out.json"
    )
    with pytest.raises(SystemExit):
        chaos.parse_args(["--duration", "0"])
    with pytest.raises(SystemExit):  # a stalled request must fail before it would count as hung
        chaos.parse_args(["--stall-s", "60", "--hang-s", "30"])


@pytest.mark.timeout(240)
def test_a_short_chaos_run_loses_hangs_and_leaks_nothing(
    chaos: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    figures = tmp_path / "chaos.json"
    args = [
        "--duration",
        "6",
        "--models",
        "toy-composite",
        "--fault-every",
        "0.3",
        "--concurrency",
        "2",
        "--stall-s",
        "3",
    ]
    code = chaos.main([*args, "--json", str(figures)])
    out = capsys.readouterr().out
    assert "lost (must be 0)" in out and "hung (must be 0)" in out
    assert code == 0, out
    toy = json.loads(figures.read_text())["models"][0]
    assert toy["is_clean"] and toy["outcomes"]["lost"] == toy["outcomes"]["hung"] == 0
    # Every kind of fault of an in-process model was injected, and did what it says.
    faults = {
        "drop_message",
        "delay_message",
        "node_raise",
        "disconnect",
        "oversized",
        "malformed",
        "long_text",
        "kv_burst",
        "fuzz",
    }
    assert set(toy["faults"]) == faults, out
    # A drop_message fault loses at most one message (how many faults fit in the run, and
    # whether a later fault replaces an armed drop before a message passes, is timing).
    assert (
        1 <= toy["messages_dropped"] <= toy["faults"]["drop_message"]
        and toy["messages_delayed"] > 0
    )
    assert toy["typed_errors_by_kind"]["WalkExecutionError"] >= 1  # the node that raised, as itself


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_worker_faults_on_replicated_orpheus(
    chaos: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    code = chaos.main(
        [
            "--duration",
            "20",
            "--models",
            "orpheus-tiny",
            "--fault-every",
            "1",
            "--concurrency",
            "2",
            "--stall-s",
            "10",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "kill_worker" in out and "stop_worker" in out
