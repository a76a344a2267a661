"""The step thread tells engines sharing it whether work waits (no private queue read)."""

from __future__ import annotations

import threading

import pytest

from mstar.engines.step_loop import StepExecutor


def test_it_counts_work_queued_and_not_started() -> None:
    running, release, second_started = threading.Event(), threading.Event(), threading.Event()
    with StepExecutor(thread_name_prefix="test") as executor:
        assert not executor.has_waiting_work()
        first = executor.submit(lambda: (running.set(), release.wait(30)))
        assert running.wait(30)
        assert not executor.has_waiting_work()  # started: nothing waits
        second = executor.submit(second_started.set)
        assert executor.has_waiting_work()  # queued behind the first
        release.set()
        first.result(30)
        second.result(30)
        assert second_started.is_set() and not executor.has_waiting_work()


def test_a_refused_submission_is_not_counted() -> None:
    executor = StepExecutor()
    executor.shutdown()
    with pytest.raises(RuntimeError):
        executor.submit(print)
    assert not executor.has_waiting_work()
