"""Progress lines for long one-off work: drawn on a terminal, silent anywhere else."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from mstar.progress import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_nothing_is_drawn_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with progress("converting", total=3) as update:
        update("step one")
        update(advance=1)
    assert capsys.readouterr() == ("", "")


def test_a_terminal_sees_the_label_the_steps_and_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress("converting", total=3) as update:
        update("weights", advance=2)
    drawn = terminal.getvalue()
    assert "converting: weights" in drawn and "2/3" in drawn


def test_writing_a_random_checkpoint_shows_progress(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mstar.zoo.pi05.checkpoint import cached_random_checkpoint
    from mstar.zoo.pi05.config import PI05_CONFIGS

    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    cached_random_checkpoint(PI05_CONFIGS["pi05-tiny"])
    assert "writing random pi05-tiny weights" in terminal.getvalue()
    terminal.truncate(0)
    cached_random_checkpoint(PI05_CONFIGS["pi05-tiny"])  # cached: nothing to do, nothing drawn
    assert terminal.getvalue().strip("\x00") == ""
