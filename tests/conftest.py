"""Fixtures shared across the test packages."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Tests that start a local Ray cluster keep it on loopback: Ray reads this when it is first
# imported, so it is set before any test module can import it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build (or load) the native kernels before any test runs.

    The first engine of a checkout compiles them (half a minute on an idle machine, minutes
    on a busy one): done here, that time counts against no test's timeout or server start
    deadline, and every later process loads the cached library.
    """
    from mstar.engines.native import cpu_kernels

    cpu_kernels()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's tests with one torch intra-op thread, then restore the setting.

    Models of many small ops (SNAC windows, tiny predictors) gain nothing from intra-op
    threads, and on a busy 2-core machine two OpenMP threads wait on each other at every
    op (5-20x slower). Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
