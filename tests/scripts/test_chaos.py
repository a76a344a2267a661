"""scripts/chaos.py, short: faults injected under load lose, hang and leak nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


@pytest.fixture(scope="module")
def chaos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chaos", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def test_arguments_are_validated(chaos: ModuleType) -> None:
    settings = chaos.parse_args(["--duration", "3", "--models", "toy-composite"])
    assert settings.models == ("toy-composite",) and settings.duration_s == 3.0
    with pytest.raises(SystemExit):
        chaos.parse_args(["--duration", "0"])


@pytest.mark.timeout(240)
def test_a_short_chaos_run_loses_hangs_and_leaks_nothing(chaos: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    code = chaos.main(["--duration", "5", "--models", "toy-composite", "--fault-every", "0.5", "--concurrency", "2"])
    out = capsys.readouterr().out
    assert "lost (must be 0)" in out and "hung (must be 0)" in out
    assert code == 0, out
    # Every kind of fault of an in-process model was injected.
    for fault in ("disconnect", "oversized", "malformed", "long_text", "kv_burst", "fuzz"):
        assert fault in out, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_worker_faults_on_replicated_orpheus(chaos: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    code = chaos.main(["--duration", "8", "--models", "orpheus-tiny", "--fault-every", "1", "--concurrency", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "kill_worker" in out and "stop_worker" in out
