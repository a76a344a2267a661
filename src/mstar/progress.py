"""One progress line for long one-off work (converting weights, writing random checkpoints,
loading a model, a one-off request), shown on standard error only when it is a terminal.

    with progress("converting SmolLM2", total=3) as update:
        update("tokenizer")                # what runs now
        ...
        update("weights", advance=1)       # one step done, the next one named

Off a terminal (logs, pipes, CI) nothing is drawn: the work logs what it does instead.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Protocol, TextIO

__all__ = ["ProgressUpdate", "is_terminal", "progress"]


class ProgressUpdate(Protocol):
    """Name what runs now and/or count finished steps."""

    def __call__(self, description: str | None = None, *, advance: int = 0) -> None: ...


def is_terminal(stream: TextIO) -> bool:
    """Return whether ``stream`` is a terminal; file-like objects without ``isatty`` are not."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty()) if callable(isatty) else False


def _quiet(description: str | None = None, *, advance: int = 0) -> None:
    """Draw nothing."""


@contextlib.contextmanager
def progress(label: str, total: int | None = None) -> Iterator[ProgressUpdate]:
    """Show ``label`` with elapsed time (and a bar of ``total`` steps) while the block runs.

    Yields ``update(description=None, *, advance=0)``; the line disappears when the block ends.
    """
    if not is_terminal(sys.stderr):
        yield _quiet
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns: list[ProgressColumn] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(label, total=total)

        def update(description: str | None = None, *, advance: int = 0) -> None:
            text = label if description is None else f"{label}: {description}"
            bar.update(task, description=text, advance=advance)

        yield update
