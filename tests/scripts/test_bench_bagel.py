"""scripts/bench_bagel.py on bagel-tiny: the three targets return the same images, and it writes its
figures."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from rich.console import Console

from tests.scripts import load_script

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_bagel")


def test_arguments(bench: ModuleType) -> None:
    settings = bench.parse_args([])
    assert (
        settings.config == "bagel-small"
        and settings.concurrency == (1, 2, 4, 8)
        and settings.timesteps is None
    )
    assert bench.parse_args(["--timesteps", "10", "--concurrency", "1,2"]).concurrency == (1, 2)


@pytest.mark.slow
async def test_a_tiny_run_agrees_and_writes_its_figures(bench: ModuleType, tmp_path: Path) -> None:
    settings = bench.parse_args(
        [
            "--config",
            "bagel-tiny",
            "--timesteps",
            "4",
            "--concurrency",
            "1,2",
            "--num-requests",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    summary = await bench.run(settings, Console(quiet=True))
    assert [(r["task"], r["c"]) for r in summary["rows"]] == [
        ("image", 1),
        ("image", 2),
        ("image_edit", 1),
        ("image_edit", 2),
    ]
    for row in summary["rows"]:
        assert all(row[t]["failed"] == 0 and row[t]["images_per_s"] > 0 for t in bench.TARGET_NAMES)
    # the same image from every target, up to fp32 rounding (a pixel level at most): the
    # products' summation order depends on how many branch rows a step batches, so skipping
    # a branch may move a boundary pixel by one level (float64 runs agree exactly elsewhere)
    assert max(max(a.values()) for a in summary["agreement"].values()) <= 1
    assert json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert (tmp_path / "image.png").is_file() and (tmp_path / "image_edit_c2.json").is_file()
