"""scripts/bench_multinode.py --quick: a local two-node Ray cluster, every figure reported."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("ray") is None:  # not imported here: the script starts the cluster
    pytest.skip("needs Ray (the dev extra installs it)", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_multinode.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("ray")  # one Ray cluster at a time (scripts/test.sh runs two workers)
def test_the_quick_run_reports_every_figure(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray on loopback
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "bench_multinode.json").read_text())
    median = data["median"]
    for key in (
        "tcp_rtt_s",
        "tcp_bytes_per_s",
        "ray nodes_step_s",
        "processes_step_s",
        "ray nodes_bytes_per_s",
        "processes_bytes_per_s",
        "ray_object_store_bytes_per_s",
        "ray_call_rtt_s",
    ):
        assert median[key] > 0, key
    assert data["mstar_over_object_store"] > 0
    assert (tmp_path / "bench_multinode.png").stat().st_size > 0
    assert "mstar tcp / Ray object store" in done.stdout
