"""V-JEPA 2-AC as an mstar model: encode, roll out, plan.

One partition, ``world_model``; four nodes: ``encoder`` (stateless), ``predictor`` (a
KV-cache node fired by forward passes: one frame block per rollout row per firing),
``cem_sample`` and ``cem_update`` (stateless). Walks::

    encode          encoder                                        -> latents EMIT
    rollout         Sequential[encoder, DynamicLoop(predictor)]    -> latents, poses EMIT
    rollout_latent  DynamicLoop(predictor)                            (context latent given)
    plan            Sequential[encoder, DynamicLoop(Sequential[
                        cem_sample, DynamicLoop(predictor), cem_update])]   -> action EMIT
    plan_latent     the planning loop alone                           (latents given)

The rollout loop fires the predictor once per frame: each firing appends the newest frame
block to the request's cache and returns the normalised next latent, the integrated pose
and the step count, which feed the next firing; ``done`` ends the loop at the request's
horizon (at most 31 frames for the published model). With ``stream`` every predicted frame
is emitted as it comes (``frame``, ``frame_pose``), else the whole trajectory at the end.

Requests (``Request(task, data)``):

- ``encode``: ``image`` (or ``images``: a list) -> ``latents`` ``[T, N, D]``.
- ``rollout``: ``image`` or ``latent`` ``[N, D]``; ``actions`` ``[H, 7]``; ``pose`` ``[7]``
  (default zeros); ``stream`` -> ``latents`` ``[H, N, D]`` and ``poses`` ``[H, 7]``.
- ``plan``: ``image`` and ``goal_image`` (or ``latent`` and ``goal_latent``); ``pose``;
  planning settings (``rollout``, ``samples``, ``topk``, ``cem_steps``, momenta, ``maxnorm``,
  ``seed``) -> ``action`` ``[7]``, the first action of the planned trajectory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import structlog
import torch
import torch.nn.functional as F
from msgspec import Meta

from mstar.engines.interfaces import FiringRows, KVChunk, KVForward
from mstar.engines.kv_engine import KVCacheEngineConfig
from mstar.engines.masks import AttentionMask
from mstar.errors import CheckpointError, KVCacheCapacityError, RolloutStateError
from mstar.graph import EMIT, DynamicLoop, GraphEdge, GraphNode, ModelGraph, Section, Sequential
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request
from mstar.runtime.params import TaskOptions
from mstar.zoo.vjepa2.cem import (
    MAX_CEM_STEPS,
    CEMParams,
    CEMState,
    cem_sample_node,
    cem_update_node,
)
from mstar.zoo.vjepa2.checkpoint import (
    checkpoint_dtype,
    config_from_parts,
    load_encoder,
    load_predictor,
    make_random_checkpoint,
    parts_dtype,
    read_parts,
)
from mstar.zoo.vjepa2.config import VJepa2Config, get_vjepa2_config
from mstar.zoo.vjepa2.encoder import VJepa2Encoder
from mstar.zoo.vjepa2.inputs import as_actions, as_latent, as_pose, prepare_image
from mstar.zoo.vjepa2.pose import POSE_DIM, integrate_pose
from mstar.zoo.vjepa2.predictor import ACPredictor, FrameInput, PagedACPredictor

__all__ = [
    "EMIT_MODES",
    "PARTITION",
    "EncoderNode",
    "FrameKVConfig",
    "PredictorNode",
    "VJepa2Model",
    "make_vjepa2_graph",
]

EMIT_MODES = ("final", "stream", "none")
"""What a rollout emits: all frames at the end, each frame as it is predicted, or nothing."""

log = structlog.get_logger(__name__)

PARTITION = "world_model"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INPUT_KEYS = {
    "encode": frozenset({"image", "images"}),
    "rollout": frozenset({"image", "latent", "actions", "pose"}),
    "plan": frozenset({"image", "goal_image", "latent", "goal_latent", "pose", "seed"}),
}


class RolloutOptions(TaskOptions, frozen=True, kw_only=True):
    """A rollout's option: ``stream`` each predicted frame's latents as it comes (else the last)."""

    stream: bool = False


Positive = Annotated[int, Meta(ge=1)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]


class PlanOptions(TaskOptions, frozen=True, kw_only=True):
    """A plan's CEM settings; those not given are the model's (`CEMConfig`). The seed is the
    request's (`GenerationParams.seed`, 0 when not given)."""

    rollout: Positive | None = None
    samples: Annotated[int, Meta(ge=2)] | None = None
    topk: Annotated[int, Meta(ge=2)] | None = None
    cem_steps: Positive | None = None
    momentum_mean: Fraction | None = None
    momentum_std: Fraction | None = None
    momentum_mean_gripper: Fraction | None = None
    momentum_std_gripper: Fraction | None = None
    maxnorm: Annotated[float, Meta(gt=0.0)] | None = None
    gripper_clip: Annotated[float, Meta(gt=0.0)] | None = None


_OPTIONS: dict[str, type[TaskOptions]] = {"rollout": RolloutOptions, "plan": PlanOptions}


def make_vjepa2_graph(config: VJepa2Config) -> ModelGraph:
    """Return the graph and walks of a V-JEPA 2-AC model."""
    encoder = GraphNode(
        "encoder",
        {"frames", "purpose"},
        [
            GraphEdge(EMIT, "latents", modality="latent"),
            GraphEdge("predictor", "latent"),
            GraphEdge("cem_sample", "context"),
            GraphEdge("cem_update", "goal"),
        ],
    )
    predictor = GraphNode(
        "predictor",
        {"latent", "pose", "step", "job"},
        [
            GraphEdge("predictor", "latent"),
            GraphEdge("predictor", "pose"),
            GraphEdge("predictor", "step"),
            GraphEdge("cem_update", "latent"),
            GraphEdge(EMIT, "frame", modality="latent"),
            GraphEdge(EMIT, "frame_pose", modality="latent"),
            GraphEdge(EMIT, "latents", modality="latent"),
            GraphEdge(EMIT, "poses", modality="latent"),
        ],
        signals={"done"},
    )
    cem_sample = GraphNode(
        "cem_sample",
        {"context", "pose0", "cem"},
        [
            GraphEdge("predictor", "latent"),
            GraphEdge("predictor", "pose"),
            GraphEdge("predictor", "step"),
            GraphEdge("predictor", "job"),
            GraphEdge("cem_update", "actions"),
            GraphEdge("cem_update", "cem"),
        ],
    )
    cem_update = GraphNode(
        "cem_update",
        {"latent", "goal", "actions", "cem"},
        [GraphEdge("cem_sample", "cem"), GraphEdge(EMIT, "action", modality="action")],
        signals={"planned"},
    )
    horizon = config.predictor.max_horizon
    rollout = DynamicLoop(predictor, max_iters=horizon, stop="done")
    planning = DynamicLoop(
        Sequential(
            [cem_sample, DynamicLoop(predictor, max_iters=horizon, stop="done"), cem_update]
        ),
        max_iters=MAX_CEM_STEPS,
        stop="planned",
    )
    walks: dict[str, Section] = {
        "encode": encoder,
        "rollout": Sequential([encoder, rollout]),
        "rollout_latent": rollout,
        "plan": Sequential([encoder, planning]),
        "plan_latent": planning,
    }
    return ModelGraph(
        name=config.name,
        walks=walks,
        partitions={PARTITION: list(walks)},
        inputs={
            "encoder": {"frames", "purpose"},
            "predictor": {"latent", "pose", "step", "job"},
            "cem_sample": {"context", "pose0", "cem"},
            "cem_update": {"goal"},
        },
    )


class EncoderNode:
    """The ``encoder`` node: every request's frames through the ViT in one batch.

    Inputs: ``frames`` ``[T, 3, S, S]`` (normalised) and ``purpose``: "encode" emits
    ``latents``; "rollout" sends frame 0 to the predictor; "plan" sends frame 0 as the
    planning context and frame 1 as the goal.
    """

    def __init__(self, encoder: VJepa2Encoder, normalize: bool = True) -> None:
        self.encoder = encoder
        self.normalize = normalize
        self.device = next(encoder.parameters()).device
        self.dtype = next(encoder.parameters()).dtype

    @torch.inference_mode()
    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Encode all frames of the batch at once; route each request's latents by purpose."""
        frames = [torch.as_tensor(x["frames"]) for x in batch]
        latents = self.encoder.encode_frames(
            torch.cat(frames).to(self.device, self.dtype), normalize=self.normalize
        )
        out: list[Mapping[str, Any]] = []
        start = 0
        for x, f in zip(batch, frames, strict=True):
            mine = latents[start : start + f.shape[0]]
            start += f.shape[0]
            purpose = x["purpose"]
            if purpose == "encode":
                out.append({"latents": mine.float().cpu()})
            elif purpose == "rollout":
                out.append({"latent": mine[0]})
            elif purpose == "plan":
                out.append({"context": mine[0], "goal": mine[1]})
            else:
                raise ValueError(
                    f"encoder purpose must be encode, rollout or plan, got {purpose!r}"
                )
        return out


@dataclass(frozen=True)
class FrameKVConfig:
    """Sizing and attention backend of the predictor's KV cache (one block per frame block).

    Attributes:
        num_blocks: Blocks in the cache (one per rollout row per cached frame); None sizes
            it from ``kv_budget``.
        kv_budget: Bytes (int), or a fraction in (0, 1] of the device's free memory.
        attention_backend: "auto", "torch" or "flashinfer" (the engines' backends).
        max_rows: Rollout rows one step may run (frames of all requests at once).
    """

    num_blocks: int | None = None
    kv_budget: int | float = 1 << 30
    attention_backend: str = "auto"
    max_rows: int = 1024

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise KVCacheCapacityError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(
                "attention_backend must be auto, torch or flashinfer, got "
                f"{self.attention_backend!r}"
            )
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")

    def engine_config(self, frame_tokens: int) -> KVCacheEngineConfig:
        """Return the engine config: blocks of one frame block, whole frames per step."""
        return KVCacheEngineConfig(
            block_size=frame_tokens,
            num_blocks=self.num_blocks,
            kv_cache_memory=self.kv_budget,
            max_num_seqs=self.max_rows,
            max_num_batched_tokens=self.max_rows * frame_tokens,
            enable_prefix_caching=False,  # a frame's keys depend on the row's whole history
            attention_backend=self.attention_backend,  # type: ignore[arg-type]
            cuda_graphs=False,  # frame steps run eagerly (graphs serve token decode)
        )


def _tensor(
    value: Any, name: str, dims: tuple[int, ...], trailing: tuple[int, ...]
) -> torch.Tensor:
    """Return ``value`` as a float tensor with one of ``dims`` dimensions ending in ``trailing``."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"predictor input {name!r} must be a tensor: {exc}") from None
    if value.dim() not in dims or tuple(value.shape[value.dim() - len(trailing) :]) != trailing:
        raise ValueError(
            f"predictor input {name!r} must have shape [..., "
            f"{', '.join(map(str, trailing))}] with {dims} dims, got {list(value.shape)}"
        )
    if not value.is_floating_point():
        value = value.float()
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"predictor input {name!r} has non-finite values")
    return value


@dataclass
class _Rollout:
    """What the node keeps of a request's rollout between firings."""

    num_rows: int
    horizon: int
    emit: str
    num_frames: int = 0
    latents: list[torch.Tensor] = field(default_factory=list)
    poses: list[torch.Tensor] = field(default_factory=list)


class PredictorNode:
    """The ``predictor`` node (`ForwardKVNode`): each firing appends one frame block per row.

    Inputs: ``latent`` ``[N, D]`` or ``[S, N, D]``, ``pose`` ``[7]`` or ``[S, 7]``, ``step``
    (int, 0 starts a rollout), ``job`` ``{"actions": [H, 7] or [S, H, 7], "emit": mode}``.
    Outputs: ``latent``, ``pose`` and ``step`` for the next step (same batching as the
    inputs), signal ``done`` after step ``H - 1``, and by ``emit`` mode: ``frame`` and
    ``frame_pose`` every step ("stream"), or ``latents`` ``[(S,) H, N, D]`` and ``poses``
    ``[(S,) H, 7]`` after the last step ("final"). Emitted tensors are on the CPU.

    Row ``r`` of a request is the engine sequence ``row{r}``: step 0 resets it and reserves
    blocks for its whole horizon (an admitted rollout never stalls), every step appends its
    frame block with a full mask (the block sees itself and the row's earlier frames), the
    last step releases it (its frames are never attended again).
    """

    forward_walks = True

    def __init__(self, predictor: ACPredictor, kv_config: FrameKVConfig | None = None) -> None:
        self.predictor = predictor
        self.kv_config = kv_config or FrameKVConfig()
        cfg = predictor.config
        self.model = PagedACPredictor(predictor)
        self.engine_config = self.kv_config.engine_config(cfg.frame_tokens)
        self.latent_shape = (cfg.num_patches, cfg.embed_dim)
        self.action_dim = cfg.action_dim
        self.max_horizon = cfg.max_horizon
        self.frame_tokens = cfg.frame_tokens
        self.cond_tokens = cfg.cond_tokens
        self._rollouts: dict[str, _Rollout] = {}
        self._mask = AttentionMask.full()

    def forward(self, request_id: str, inputs: Mapping[str, Any]) -> KVForward:
        """Check one rollout step's inputs; return a frame-block chunk per row.

        Raises:
            ValueError: An input is missing or malformed.
            RolloutStateError: A step that does not continue the request's rollout.
        """
        missing = {"latent", "pose", "step", "job"} - set(inputs)
        if missing:
            raise ValueError(f"predictor inputs {sorted(missing)} are missing")
        latent = _tensor(inputs["latent"], "latent", (2, 3), self.latent_shape)
        batched = latent.dim() == 3
        latent = latent if batched else latent[None]
        rows = latent.shape[0]
        pose = _tensor(
            inputs["pose"], "pose", (2,) if batched else (1,), (self.action_dim,)
        ).reshape(-1, self.action_dim)
        job = inputs["job"]
        if not isinstance(job, Mapping) or "actions" not in job:
            raise ValueError(
                "predictor input 'job' must be a dict with 'actions' (and optionally 'emit')"
            )
        actions = _tensor(
            job["actions"], "job.actions", (3,) if batched else (2,), (self.action_dim,)
        )
        actions = actions if batched else actions[None]
        emit = job.get("emit", "final")
        if emit not in EMIT_MODES:
            raise ValueError(f"job emit must be one of {EMIT_MODES}, got {emit!r}")
        if pose.shape[0] != rows or actions.shape[0] != rows:
            raise ValueError(
                f"latent, pose and actions disagree on the number of rows: {rows}, "
                f"{pose.shape[0]}, {actions.shape[0]}"
            )
        horizon = actions.shape[1]
        if not 1 <= horizon <= self.max_horizon:
            raise ValueError(
                f"a rollout predicts 1 to {self.max_horizon} frames, got {horizon} actions"
            )
        step = inputs["step"]
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = int(step.item())
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < horizon:
            raise ValueError(
                f"predictor input 'step' must be an integer in [0, {horizon}), got {step!r}"
            )
        held = self._rollouts.get(request_id)
        if step == 0:
            held = self._rollouts[request_id] = _Rollout(rows, horizon, str(emit))
        elif held is None:
            raise RolloutStateError(
                f"step {step} of request {request_id!r} arrived, but no rollout is cached for it "
                "(a rollout starts at step 0 and continues on the engine that holds it)"
            )
        elif held.num_frames != step or held.num_rows != rows or held.horizon != horizon:
            raise RolloutStateError(
                f"step {step} ({rows} rows, horizon {horizon}) of request {request_id!r} "
                "does not continue "
                f"its cached rollout ({held.num_frames} frames, {held.num_rows} rows, "
                f"horizon {held.horizon})"
            )
        f = self.frame_tokens
        return KVForward(
            [
                KVChunk(
                    seq=f"row{r}",
                    payload=FrameInput(latent[r], actions[r, step], pose[r], step),
                    num_tokens=f,
                    mask=self._mask,
                    reset=step == 0,
                    reserve_tokens=horizon * f if step == 0 else 0,
                    release=step == horizon - 1,
                )
                for r in range(rows)
            ]
        )

    def forward_outputs(self, firings: list[FiringRows]) -> list[Mapping[str, Any] | BaseException]:
        """Layer-normalise every row's predicted patches and integrate every pose, in one batch.

        Each firing then keeps (``final``) or emits (``stream``) its frame and feeds it back.
        """
        results: list[Mapping[str, Any] | BaseException] = []
        live: list[tuple[int, _Rollout, bool, int]] = []  # (result index, rollout, batched, rows)
        preds: list[torch.Tensor] = []
        poses_in: list[torch.Tensor] = []
        actions_in: list[torch.Tensor] = []
        for firing in firings:
            rollout = self._rollouts.get(firing.request_id)
            if rollout is None:  # released while its step ran
                results.append(RolloutStateError(f"request {firing.request_id!r} holds no rollout"))
                continue
            inputs = firing.inputs
            batched = torch.as_tensor(inputs["latent"]).dim() == 3
            actions = torch.as_tensor(inputs["job"]["actions"])
            preds.extend(r[self.cond_tokens :] for r in firing.rows if r is not None)
            poses_in.append(torch.as_tensor(inputs["pose"]).reshape(-1, self.action_dim))
            actions_in.append((actions if batched else actions[None])[:, rollout.num_frames])
            live.append((len(results), rollout, batched, rollout.num_rows))
            results.append(RolloutStateError("unreachable"))  # replaced below
        if not live:
            return results
        pred = torch.stack(preds)
        latents = F.layer_norm(pred, (pred.shape[-1],))
        device = latents.device
        poses = integrate_pose(
            torch.cat(poses_in).to(device, torch.float32),
            torch.cat(actions_in).to(device, torch.float32),
        )
        start = 0
        for index, rollout, batched, num_rows in live:
            latent, pose = latents[start : start + num_rows], poses[start : start + num_rows]
            start += num_rows
            results[index] = self._advance(
                firings[index].request_id, rollout, batched, latent, pose
            )
        return results

    def _advance(
        self,
        request_id: str,
        rollout: _Rollout,
        batched: bool,
        latent: torch.Tensor,
        pose: torch.Tensor,
    ) -> dict[str, Any]:
        """Record one predicted frame of a rollout; return the firing's outputs."""
        step = rollout.num_frames
        rollout.num_frames += 1
        if rollout.emit == "final":
            rollout.latents.append(latent)
            rollout.poses.append(pose)
        is_done = rollout.num_frames == rollout.horizon

        def shape(x: torch.Tensor) -> torch.Tensor:
            return x if batched else x[0]

        out: dict[str, Any] = {
            "latent": shape(latent),
            "pose": shape(pose),
            "step": step + 1,
            "done": is_done,
        }
        if rollout.emit == "stream":
            out["frame"] = shape(latent).cpu()
            out["frame_pose"] = shape(pose).cpu()
        elif rollout.emit == "final" and is_done:
            out["latents"] = shape(torch.stack(rollout.latents, dim=1)).cpu()
            out["poses"] = shape(torch.stack(rollout.poses, dim=1)).cpu()
        if is_done:
            del self._rollouts[request_id]
        return out

    def release(self, request_id: str) -> None:
        """Forget the request's rollout (the engine drops its rows)."""
        self._rollouts.pop(request_id, None)

    @property
    def num_rollouts(self) -> int:
        """Count the rollouts in progress."""
        return len(self._rollouts)


class VJepa2Model(Model):
    """V-JEPA 2-AC (``vjepa2-ac-vitg``, ``vjepa2-small``, ``vjepa2-tiny``, or any checkpoint's
    sizes).

    Args:
        config: A config name, a `VJepa2Config` (custom sizes), or None: the sizes read from
            ``checkpoint`` (`config_from_checkpoint`; the model is named after the file).
        checkpoint: The ``.pt`` checkpoint (``encoder`` and ``predictor`` state dicts). Without
            one a named or given config gets random weights, written once in the published
            layout under the mstar cache; ``vjepa2-ac-vitg`` needs the file.
        dtype: "float32", "bfloat16", "float16", or "auto": the dtype the checkpoint's weights
            are stored in (upstream's ``.pt`` names none), float32 if they differ.
        kv: `FrameKVConfig` fields of the predictor's cache (``num_blocks``, ``kv_budget``,
            ``attention_backend``).
        seed: Seed of the random weights.

    Rollout and planning integrate 7-D DROID poses (`integrate_pose`, upstream's
    ``compute_new_pose``); a checkpoint whose actions have another width serves ``encode`` only.

    Raises:
        CheckpointError: No config and no checkpoint, a missing checkpoint file, or (with
            ``config=None``) a file whose sizes cannot be read.
    """

    def __init__(
        self,
        config: str | VJepa2Config | None = "vjepa2-tiny",
        *,
        checkpoint: str | Path | None = None,
        dtype: str = "float32",
        kv: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        if dtype != "auto" and dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {dtype!r}"
            )
        if config is None:
            if checkpoint is None:
                raise CheckpointError(
                    "V-JEPA 2 needs config= (a name or a VJepa2Config) or checkpoint= the "
                    "upstream .pt to read the sizes from"
                )
            parts = read_parts(checkpoint)  # one memory-mapped load for the sizes and the dtype
            cfg = config_from_parts(parts, checkpoint)
            torch_dtype = parts_dtype(parts) if dtype == "auto" else _DTYPES[dtype]
        else:
            if isinstance(config, str):
                cfg = get_vjepa2_config(config)
            elif isinstance(config, VJepa2Config):
                cfg = config
            else:
                raise TypeError(
                    f"config must be a name, a VJepa2Config or None, got {type(config).__name__}"
                )
            if checkpoint is None:
                if cfg.name == "vjepa2-ac-vitg":
                    raise CheckpointError(
                        "vjepa2-ac-vitg needs checkpoint= the path of vjepa2-ac-vitg.pt"
                    )
                checkpoint = _cached_random_checkpoint(cfg, seed)
            elif not Path(checkpoint).is_file():
                raise CheckpointError(f"V-JEPA 2 checkpoint {str(checkpoint)!r} does not exist")
            torch_dtype = checkpoint_dtype(checkpoint) if dtype == "auto" else _DTYPES[dtype]
        self.name = cfg.name
        self.config = cfg
        self.checkpoint = str(checkpoint)
        self.dtype = torch_dtype
        self.kv_config = FrameKVConfig(**dict(kv or {}))
        self._graph = make_vjepa2_graph(cfg)

    def graph(self) -> ModelGraph:
        """Return the world-model graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return KV_CACHE for the predictor (frame blocks over its paged cache), STATELESS
        otherwise."""
        types = dict.fromkeys(self._graph.nodes, EngineType.STATELESS)
        types["predictor"] = EngineType.KV_CACHE
        return types

    def tasks(self) -> tuple[str, ...]:
        """Return encode, rollout and plan (encode alone when actions are not 7-D poses)."""
        if self.config.predictor.action_dim != POSE_DIM:
            return ("encode",)
        return ("encode", "rollout", "plan")

    def task_options(self, task: str) -> type[TaskOptions] | None:
        """A rollout's `RolloutOptions`, a plan's `PlanOptions`."""
        return _OPTIONS.get(task)

    def submodule(self, node: str, device: torch.device) -> Any:
        """Load the encoder or predictor onto ``device``, or return a planning node."""
        if node == "encoder":
            return EncoderNode(
                load_encoder(self.checkpoint, self.config, device, self.dtype),
                self.config.normalize_reps,
            )
        if node == "predictor":
            return PredictorNode(
                load_predictor(self.checkpoint, self.config, device, self.dtype), self.kv_config
            )
        if node == "cem_sample":
            return cem_sample_node
        if node == "cem_update":
            return cem_update_node
        raise KeyError(node)

    def preprocess(self, request: Request) -> PreparedRequest:
        """Check the task's fields; build node inputs and pick the walk."""
        data = request.data
        if request.task not in _INPUT_KEYS:
            raise ValueError(f"task must be one of {list(self.tasks())}, got {request.task!r}")
        if request.task not in self.tasks():
            raise ValueError(
                f"{request.task} integrates 7-D poses [x, y, z, roll, pitch, yaw, gripper] "
                f"but {self.name}'s "
                f"actions are {self.config.predictor.action_dim}-D: this model serves encode only"
            )
        options = _OPTIONS.get(request.task)
        known = _INPUT_KEYS[request.task] | frozenset(options.__struct_fields__ if options else ())
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown {request.task} fields {sorted(unknown)}; known: {sorted(known)}"
            )
        if request.task == "encode":
            images = data.get("images", [data["image"]] if "image" in data else None)
            if not isinstance(images, list | tuple) or not images:
                raise ValueError("encode needs image (or images: a non-empty list)")
            frames = torch.stack([prepare_image(im, self.config, "images") for im in images])
            return PreparedRequest({"encoder": {"frames": frames, "purpose": "encode"}}, "encode")
        if request.task == "rollout":
            return self._rollout(data, request.options_as(RolloutOptions).stream)
        return self._plan(data, request.options_as(PlanOptions), request.params.seed or 0)

    def _rollout(self, data: Mapping[str, Any], stream: bool) -> PreparedRequest:
        actions = as_actions(data.get("actions"), self.config)
        predictor = {
            "pose": as_pose(data.get("pose"), self.config),
            "step": 0,
            "job": {"actions": actions, "emit": "stream" if stream else "final"},
        }
        if "latent" in data:
            predictor["latent"] = as_latent(data["latent"], self.config)
            return PreparedRequest({"predictor": predictor}, "rollout_latent")
        if "image" not in data:
            raise ValueError("rollout needs the context frame: image (or latent)")
        frames = prepare_image(data["image"], self.config)[None]
        return PreparedRequest(
            {"encoder": {"frames": frames, "purpose": "rollout"}, "predictor": predictor}, "rollout"
        )

    def _plan(self, data: Mapping[str, Any], options: PlanOptions, seed: int) -> PreparedRequest:
        given = {k: v for k in options.__struct_fields__ if (v := getattr(options, k)) is not None}
        params = CEMParams.make(self.config.cem, {**given, "seed": seed})
        if params.rollout > self.config.predictor.max_horizon:
            raise ValueError(
                f"rollout must be at most {self.config.predictor.max_horizon}, got {params.rollout}"
            )
        sample: dict[str, Any] = {
            "pose0": as_pose(data.get("pose"), self.config),
            "cem": CEMState.initial(params).to_value(),
        }
        if "latent" in data or "goal_latent" in data:
            sample["context"] = as_latent(data.get("latent"), self.config, "latent")
            goal = as_latent(data.get("goal_latent"), self.config, "goal_latent")
            return PreparedRequest(
                {"cem_sample": sample, "cem_update": {"goal": goal}}, "plan_latent"
            )
        if "image" not in data or "goal_image" not in data:
            raise ValueError("plan needs image and goal_image (or latent and goal_latent)")
        frames = torch.stack(
            [
                prepare_image(data["image"], self.config),
                prepare_image(data["goal_image"], self.config, "goal_image"),
            ]
        )
        return PreparedRequest(
            {"encoder": {"frames": frames, "purpose": "plan"}, "cem_sample": sample}, "plan"
        )

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Return the walk preprocessing chose."""
        return str(state) if partition == PARTITION else None

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Every task is one walk."""
        return None


def _cached_random_checkpoint(cfg: VJepa2Config, seed: int) -> Path:
    """Return the cached random checkpoint of ``cfg``, writing it once (atomically).

    The file is keyed by the sizes too, so two configs of one name never share weights.
    """
    from mstar.zoo.cache import mstar_cache_dir

    digest = hashlib.sha256(repr((cfg.encoder, cfg.predictor)).encode()).hexdigest()[:12]
    path = mstar_cache_dir() / "vjepa2" / f"{cfg.name}-{digest}-seed{seed}.pt"
    if not path.is_file():
        log.info("writing_random_checkpoint", config=cfg.name, path=str(path))
        make_random_checkpoint(cfg, path, seed=seed)  # written aside, renamed into place
    return path
