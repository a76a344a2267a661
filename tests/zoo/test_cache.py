"""`written_once`: a cached folder appears whole, is written once, and a failure leaves nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from mstar.zoo.cache import written_once


def test_a_folder_is_written_once_and_then_reused(tmp_path: Path) -> None:
    calls: list[Path] = []

    def write(folder: Path) -> None:
        calls.append(folder)
        (folder / "weights.bin").write_bytes(b"w")

    root = tmp_path / "model"
    assert written_once(root, write, label="weights") == root
    assert written_once(root, write, label="weights") == root
    assert len(calls) == 1 and calls[0] != root  # written aside, then renamed into place
    assert (root / "weights.bin").read_bytes() == b"w"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_write_leaves_nothing_that_passes_for_complete(tmp_path: Path) -> None:
    def fail(folder: Path) -> None:
        (folder / "half.bin").write_bytes(b"h")
        raise OSError("disk full")

    root = tmp_path / "model"
    with pytest.raises(OSError, match="disk full"):
        written_once(root, fail, label="weights")
    assert list(tmp_path.iterdir()) == []
    # An incomplete folder (an older format, a crash before the marker) is replaced.
    root.mkdir()
    (root / "stale.bin").write_bytes(b"s")
    written_once(root, lambda folder: (folder / "weights.bin").write_bytes(b"w"), label="weights")
    assert sorted(p.name for p in root.iterdir()) == [".complete", "weights.bin"]
