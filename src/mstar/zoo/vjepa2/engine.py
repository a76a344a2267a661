"""The predictor node's engine: per-request frame-block KV caches, one block per step.

A `DynamicLoop` over the ``predictor`` node fires it once per rollout step. Firing ``n`` of
a request carries the newest frame (latent ``z_n``, pose ``s_n``) and the rollout's actions;
the engine runs only that frame's block against the request's cached blocks, writes the
block's keys and values, and returns the layer-normalised prediction ``z_{n+1}`` and the
integrated pose ``s_{n+1}``, which the loop feeds back. The pending firings of all requests
(any horizon, any step) run as one forward: continuous batching.

- `PredictorNode`: what ``Model.submodule`` returns. Turns node inputs into `BlockJob`s and
  results into node outputs, and builds the engine (``make_engine``).
- `PredictorEngine`: the asyncio shell (the worker's `NodeEngine`) around a
  `FrameRolloutRunner`; every runner call runs on the step executor, between steps.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from mstar.engines.step_loop import StepLoop
from mstar.engines.step_times import WalkStepTimes
from mstar.errors import EngineClosedError, RequestAbortedError
from mstar.zoo.vjepa2.predictor import ACPredictor
from mstar.zoo.vjepa2.runner import BlockJob, BlockResult, FrameKVConfig, FrameRolloutRunner

__all__ = ["EMIT_MODES", "PredictorEngine", "PredictorNode"]

EMIT_MODES = ("final", "stream", "none")
"""What a rollout emits: all frames at the end, each frame as it is predicted, or nothing."""


def _tensor(value: Any, name: str, dims: tuple[int, ...], trailing: tuple[int, ...]) -> torch.Tensor:
    """Return ``value`` as a float tensor with one of ``dims`` dimensions ending in ``trailing``."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"predictor input {name!r} must be a tensor: {exc}") from None
    if value.dim() not in dims or tuple(value.shape[value.dim() - len(trailing) :]) != trailing:
        raise ValueError(f"predictor input {name!r} must have shape [..., {', '.join(map(str, trailing))}] with {dims} dims, got {list(value.shape)}")
    if not value.is_floating_point():
        value = value.float()
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"predictor input {name!r} has non-finite values")
    return value


class PredictorNode:
    """The ``predictor`` node: inputs to `BlockJob`s, results to outputs, and its engine.

    Inputs: ``latent`` ``[N, D]`` or ``[S, N, D]``, ``pose`` ``[7]`` or ``[S, 7]``, ``step``
    (int, 0 starts a rollout), ``job`` ``{"actions": [H, 7] or [S, H, 7], "emit": mode}``.
    Outputs: ``latent``, ``pose`` and ``step`` for the next step (same batching as the
    inputs), signal ``done`` after step ``H - 1``, and by ``emit`` mode: ``frame`` and
    ``frame_pose`` every step ("stream"), or ``latents`` ``[(S,) H, N, D]`` and ``poses``
    ``[(S,) H, 7]`` after the last step ("final"). Emitted tensors are on the CPU.
    """

    def __init__(self, predictor: ACPredictor, kv_config: FrameKVConfig | None = None) -> None:
        self.predictor = predictor
        self.kv_config = kv_config or FrameKVConfig()
        cfg = predictor.config
        self.latent_shape = (cfg.num_patches, cfg.embed_dim)
        self.action_dim = cfg.action_dim
        self.max_horizon = cfg.max_horizon

    def make_engine(self, node: str, executor: Executor | None, device: str) -> PredictorEngine:
        """Build this node's engine (the worker calls this)."""
        return PredictorEngine(node, self, executor, device)

    def parse(self, request_id: str, inputs: Mapping[str, Any]) -> tuple[BlockJob, bool, str]:
        """Return the job, whether the inputs were batched, and the emit mode.

        Raises:
            ValueError: An input is missing or malformed.
        """
        missing = {"latent", "pose", "step", "job"} - set(inputs)
        if missing:
            raise ValueError(f"predictor inputs {sorted(missing)} are missing")
        latent = _tensor(inputs["latent"], "latent", (2, 3), self.latent_shape)
        batched = latent.dim() == 3
        latent = latent if batched else latent[None]
        rows = latent.shape[0]
        pose = _tensor(inputs["pose"], "pose", (2,) if batched else (1,), (self.action_dim,)).reshape(-1, self.action_dim)
        job = inputs["job"]
        if not isinstance(job, Mapping) or "actions" not in job:
            raise ValueError("predictor input 'job' must be a dict with 'actions' (and optionally 'emit')")
        actions = _tensor(job["actions"], "job.actions", (3,) if batched else (2,), (self.action_dim,))
        actions = actions if batched else actions[None]
        emit = job.get("emit", "final")
        if emit not in EMIT_MODES:
            raise ValueError(f"job emit must be one of {EMIT_MODES}, got {emit!r}")
        if pose.shape[0] != rows or actions.shape[0] != rows:
            raise ValueError(f"latent, pose and actions disagree on the number of rows: {rows}, {pose.shape[0]}, {actions.shape[0]}")
        horizon = actions.shape[1]
        if not 1 <= horizon <= self.max_horizon:
            raise ValueError(f"a rollout predicts 1 to {self.max_horizon} frames, got {horizon} actions")
        step = inputs["step"]
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = int(step.item())
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < horizon:
            raise ValueError(f"predictor input 'step' must be an integer in [0, {horizon}), got {step!r}")
        block = BlockJob(request_id, latent, pose, actions[:, step], step, horizon, keep=emit == "final")
        return block, batched, str(emit)

    @staticmethod
    def outputs(job: BlockJob, result: BlockResult, batched: bool, emit: str) -> dict[str, Any]:
        """Return the node outputs (and the ``done`` signal) of one step."""

        def shape(x: torch.Tensor) -> torch.Tensor:
            return x if batched else x[0]

        out: dict[str, Any] = {
            "latent": shape(result.latent),
            "pose": shape(result.pose),
            "step": job.step + 1,
            "done": result.is_done,
        }
        if emit == "stream":
            out["frame"] = shape(result.latent).cpu()
            out["frame_pose"] = shape(result.pose).cpu()
        elif emit == "final" and result.is_done:
            assert result.latents is not None and result.poses is not None
            out["latents"] = shape(result.latents).cpu()
            out["poses"] = shape(result.poses).cpu()
        return out


@dataclass
class _Firing:
    request_id: str
    inputs: Mapping[str, Any]
    future: asyncio.Future[Mapping[str, Any]]
    walk: str = ""


class PredictorEngine(StepLoop):
    """Continuous batching of predictor firings over frame-block caches (a worker `NodeEngine`).

    Args:
        node: The node's name.
        node_impl: The node (its predictor and cache settings).
        executor: Where steps run; None runs them on the event loop's thread.
        device: Torch device of the cache.
    """

    def __init__(self, node: str, node_impl: PredictorNode, executor: Executor | None, device: str = "cpu") -> None:
        super().__init__()
        self.node = node
        self.node_impl = node_impl
        self.executor = executor
        self.runner = FrameRolloutRunner(node_impl.predictor, node_impl.kv_config, device)
        self._queue: deque[_Firing] = deque()
        self._releases: list[str] = []
        self._in_flight: list[_Firing] = []  # taken by the step that runs now
        self.num_steps = 0
        self.num_batched = 0  # firings answered, over all steps
        self.step_seconds = 0.0
        self.walk_times = WalkStepTimes()

    @property
    def num_pending(self) -> int:
        """Return how many firings wait for a step."""
        return len(self._queue)

    @property
    def num_requests(self) -> int:
        """Return how many requests hold a rollout (read between steps)."""
        return self.runner.num_requests

    def stats(self) -> dict[str, float]:
        """Return cumulative step counters and frame-cache occupancy (for metrics)."""
        pool = self.runner.pool
        return {
            "steps": self.num_steps,
            "batched": self.num_batched,
            "step_seconds": self.step_seconds,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_blocks - pool.num_free_blocks,
        }

    def _fail_pending(self, error: EngineClosedError) -> None:
        for firing in [*self._in_flight, *self._queue]:
            if not firing.future.done():
                firing.future.set_exception(error)
        self._queue.clear()
        self._in_flight = []

    async def submit(self, request_id: str, inputs: Mapping[str, Any], walk: str = "") -> Mapping[str, Any]:
        """Queue one rollout step of a request (for ``walk``, in step times); return its outputs once it ran.

        Raises:
            EngineClosedError: The engine is closed.
            RequestAbortedError: The request was aborted first.
            ValueError, RolloutStateError, KVCacheCapacityError: This request's step is invalid.
        """
        if self._closed:
            raise EngineClosedError(f"engine for node {self.node!r} is closed")
        future: asyncio.Future[Mapping[str, Any]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Firing(request_id, inputs, future, walk))
        self._wakeup.set()
        return await future

    def abort(self, request_id: str) -> None:
        """Fail the request's pending firing and free its cache (at the next step boundary)."""
        keep: deque[_Firing] = deque()
        for firing in self._queue:
            if firing.request_id == request_id:
                if not firing.future.done():
                    firing.future.set_exception(RequestAbortedError(f"request {request_id!r} was aborted"))
            else:
                keep.append(firing)
        self._queue = keep
        self._releases.append(request_id)
        self._wakeup.set()

    release = abort

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue and not self._releases:
                self._wakeup.clear()
                await self._wakeup.wait()
            # Walks woken by the last step are ready to run: let them queue their next firing
            # first, so that every request in lockstep joins this step.
            await asyncio.sleep(0)
            self._wakeup.clear()
            firings = self._in_flight = [f for f in self._queue if not f.future.done()]
            self._queue.clear()
            releases, self._releases = self._releases, []
            start = time.perf_counter()
            try:
                if self.executor is None:
                    done, deferred = self._step(firings, releases)
                else:
                    done, deferred = await loop.run_in_executor(self.executor, self._step, firings, releases)
            except Exception as exc:  # the engine itself failed: fail what it held, keep serving
                done, deferred = [(f, exc) for f in firings], []
                for firing in firings:
                    self.runner.release(firing.request_id)
            self._in_flight = []
            if done:
                seconds = time.perf_counter() - start
                self.num_steps += 1
                self.num_batched += len(done)
                self.step_seconds += seconds
                self.walk_times.record(seconds, (firing.walk for firing, _ in done))
            for firing, outcome in done:
                if firing.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    firing.future.set_exception(outcome)
                else:
                    firing.future.set_result(outcome)
            self._queue.extendleft(reversed(deferred))
            if deferred and not done:
                # Nothing could run: wait for a release (or a new firing) before retrying.
                self._wakeup.clear()
                await self._wakeup.wait()

    def _step(
        self, firings: list[_Firing], releases: list[str]
    ) -> tuple[list[tuple[_Firing, Mapping[str, Any] | BaseException]], list[_Firing]]:
        """Apply releases, admit and run what fits (on the step thread); return outcomes and the deferred."""
        runner, node = self.runner, self.node_impl
        for request_id in releases:
            runner.release(request_id)
        done: list[tuple[_Firing, Mapping[str, Any] | BaseException]] = []
        deferred: list[_Firing] = []
        ready: list[tuple[_Firing, BlockJob, bool, str]] = []
        for firing in firings:
            try:
                job, batched, emit = node.parse(firing.request_id, firing.inputs)
                if job.step > 0:
                    runner.check(job)
                elif deferred or not runner.can_admit(job):
                    deferred.append(firing)  # first come, first served: later starts wait too
                    continue
                else:
                    runner.admit(job)
            except Exception as exc:  # a bad firing fails alone
                runner.release(firing.request_id)
                done.append((firing, exc))
                continue
            ready.append((firing, job, batched, emit))
        if ready:
            done.extend(self._run_jobs(ready))
        return done, deferred

    def _run_jobs(
        self, ready: list[tuple[_Firing, BlockJob, bool, str]]
    ) -> list[tuple[_Firing, Mapping[str, Any] | BaseException]]:
        try:
            results = self.runner.step([job for _, job, _, _ in ready])
        except Exception as exc:
            if len(ready) == 1:
                self.runner.release(ready[0][0].request_id)
                return [(ready[0][0], exc)]
            # Rerun one by one so that only the request that fails is failed; the blocks the
            # failed step allocated are reused (a frame counts as cached only after its step).
            return [outcome for item in ready for outcome in self._run_jobs([item])]
        return [
            (firing, self.node_impl.outputs(job, result, batched, emit))
            for (firing, job, batched, emit), result in zip(ready, results, strict=True)
        ]
