"""Fixtures of the benchmark harness tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.bench.synthetic_server import serve


@pytest.fixture(scope="module")
def synthetic_server() -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """A real HTTP server on 127.0.0.1 streaming synthetic outputs: (base URL, bodies seen)."""
    with serve() as server:
        yield server
