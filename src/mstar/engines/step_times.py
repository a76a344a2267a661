"""`WalkStepTimes`: how long a node engine's steps took, attributed to the walks they served.

An engine step batches inputs from many requests, and those may come from different walks
(an LLM step that runs one request's ``prefill`` next to other requests' ``decode``). Each
step is recorded **in full under every walk present in its batch**: a walk's figures are
those of the steps it waited on, which is what its latency is made of. Sums over the walks
of a node can therefore exceed the node's own step totals (a mixed step counts once per
walk); the node totals stay in the engine's ``steps`` and ``step_seconds``.

    step: [decode r1, decode r2, prefill r3]   12 ms
      decode : steps +1, inputs +2, seconds +0.012, histogram bucket(0.012) +1
      prefill: steps +1, inputs +1, seconds +0.012, histogram bucket(0.012) +1

Recording costs one pass over the batch per step, on the event loop's thread.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["PHASES", "STEP_TIME_BUCKETS", "PhaseTimes", "StepTimes", "WalkStepTimes"]

STEP_TIME_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds (seconds) of the step-time histogram buckets; one more bucket catches the rest."""


@dataclass(slots=True)
class StepTimes:
    """Cumulative step figures of one walk on one node.

    Attributes:
        steps: Steps that served at least one input of the walk.
        inputs: Inputs of the walk those steps ran.
        seconds: Total duration of those steps.
        bucket_counts: Steps per duration bucket: ``bucket_counts[i]`` counts steps that took
            at most ``STEP_TIME_BUCKETS[i]`` and more than the bound before; the last entry
            counts steps longer than every bound (not cumulative).
    """

    steps: int = 0
    inputs: int = 0
    seconds: float = 0.0
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_TIME_BUCKETS) + 1))


class WalkStepTimes:
    """Step figures of one engine, per walk (see the module docstring for mixed batches)."""

    __slots__ = ("by_walk",)

    def __init__(self) -> None:
        self.by_walk: dict[str, StepTimes] = {}

    def record(self, seconds: float, walks: Iterable[str]) -> None:
        """Record one step of ``seconds`` that ran one input of each of ``walks`` (repeats
        allowed)."""
        if type(walks) is list and len(walks) == 1:  # one input: the common case at low load
            counts = {walks[0]: 1}
        else:
            counts = {}
            for walk in walks:
                counts[walk] = counts.get(walk, 0) + 1
        if not counts:
            return
        bucket = bisect_left(STEP_TIME_BUCKETS, seconds)
        for walk, num_inputs in counts.items():
            times = self.by_walk.get(walk)
            if times is None:
                times = self.by_walk[walk] = StepTimes()
            times.steps += 1
            times.inputs += num_inputs
            times.seconds += seconds
            times.bucket_counts[bucket] += 1


PHASES: tuple[str, ...] = ("schedule", "prepare", "forward", "logits", "update")
"""A KV-cache step's phases, in order: pick the batch, build its inputs, run the model,
project and sample (or slice the returned rows), apply the results to the sequences."""


class PhaseTimes:
    """Cumulative seconds a KV-cache engine spent in each phase of its steps (`PHASES`).

    Kept by the engine itself (a `perf_counter` pair per phase per step), so benchmarks
    and metrics read where a step's time goes without patching engine methods.

    Steps that only decode (one token a sequence, none of a prompt) are counted apart too, by
    their number of rows: how many, their seconds from prepare to the sampled tokens, and the
    keys their rows attended. A benchmark's decode steps at c rows, next to the bytes they
    must read, give how near decode runs to the memory bandwidth, whatever prefill chunks
    the same requests' other steps carried.
    """

    __slots__ = ("decode", "seconds")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.decode: dict[int, list[float]] = {}  # rows: [steps, seconds, keys]

    def add(self, phase: str, seconds: float) -> None:
        """Add `seconds` to `phase`."""
        self.seconds[phase] += seconds

    def add_decode(self, rows: int, keys: int, seconds: float) -> None:
        """Count a decode-only step of `rows` rows whose rows attended `keys` keys in all."""
        counts = self.decode.setdefault(rows, [0.0, 0.0, 0.0])
        counts[0] += 1
        counts[1] += seconds
        counts[2] += keys

    def snapshot(self) -> dict[str, float]:
        """Return ``{"phase_<name>_seconds": total}`` for every phase, and for the decode-only
        steps of each row count n ``decode<n>_steps``, ``decode<n>_seconds`` and
        ``decode<n>_keys``."""
        out = {f"phase_{name}_seconds": value for name, value in self.seconds.items()}
        for rows, (steps, seconds, keys) in sorted(self.decode.items()):
            out[f"decode{rows}_steps"] = steps
            out[f"decode{rows}_seconds"] = seconds
            out[f"decode{rows}_keys"] = keys
        return out
