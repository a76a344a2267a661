"""V-JEPA 2-AC as an mstar model: encode, roll out, plan.

One partition, ``world_model``; four nodes: ``encoder`` (stateless), ``predictor`` (its own
frame-block KV engine), ``cem_sample`` and ``cem_update`` (stateless). Walks::

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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from mstar.errors import CheckpointError
from mstar.graph import EMIT, DynamicLoop, GraphEdge, GraphNode, ModelGraph, Section, Sequential
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request
from mstar.zoo.vjepa2.cem import (
    MAX_CEM_STEPS,
    CEMParams,
    CEMState,
    cem_sample_node,
    cem_update_node,
)
from mstar.zoo.vjepa2.checkpoint import load_encoder, load_predictor, make_random_checkpoint
from mstar.zoo.vjepa2.config import VJepa2Config, get_vjepa2_config
from mstar.zoo.vjepa2.encoder import VJepa2Encoder
from mstar.zoo.vjepa2.engine import PredictorNode
from mstar.zoo.vjepa2.inputs import as_actions, as_latent, as_pose, prepare_image
from mstar.zoo.vjepa2.runner import FrameKVConfig

__all__ = ["PARTITION", "EncoderNode", "VJepa2Model", "make_vjepa2_graph"]

log = structlog.get_logger(__name__)

PARTITION = "world_model"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INPUT_KEYS = {
    "encode": frozenset({"image", "images"}),
    "rollout": frozenset({"image", "latent", "actions", "pose", "stream"}),
    "plan": frozenset({"image", "goal_image", "latent", "goal_latent", "pose"}),
}
_PLAN_KEYS = ("rollout", "samples", "topk", "cem_steps", "momentum_mean", "momentum_std",
              "momentum_mean_gripper", "momentum_std_gripper", "maxnorm", "gripper_clip", "seed")


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
        Sequential([cem_sample, DynamicLoop(predictor, max_iters=horizon, stop="done"), cem_update]),
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
        latents = self.encoder.encode_frames(torch.cat(frames).to(self.device, self.dtype), normalize=self.normalize)
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
                raise ValueError(f"encoder purpose must be encode, rollout or plan, got {purpose!r}")
        return out


class VJepa2Model(Model):
    """V-JEPA 2-AC (``vjepa2-ac-vitg``, ``vjepa2-small`` or ``vjepa2-tiny``).

    Args:
        config: Config name.
        checkpoint: The ``.pt`` checkpoint (``encoder`` and ``predictor`` state dicts). Without
            one the small configs get random weights, written once in the published layout
            under the mstar cache; ``vjepa2-ac-vitg`` needs the file.
        dtype: "float32", "bfloat16" or "float16".
        kv: `FrameKVConfig` fields of the predictor's cache (``num_blocks``, ``kv_budget``,
            ``attention_backend``).
        seed: Seed of the random weights.
    """

    def __init__(
        self,
        config: str = "vjepa2-tiny",
        *,
        checkpoint: str | None = None,
        dtype: str = "float32",
        kv: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        cfg = get_vjepa2_config(config)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if checkpoint is None:
            if config == "vjepa2-ac-vitg":
                raise CheckpointError("vjepa2-ac-vitg needs checkpoint= the path of vjepa2-ac-vitg.pt")
            checkpoint = str(_cached_random_checkpoint(cfg, seed))
        elif not Path(checkpoint).is_file():
            raise CheckpointError(f"V-JEPA 2 checkpoint {checkpoint!r} does not exist")
        self.name = config
        self.config = cfg
        self.checkpoint = checkpoint
        self.dtype = _DTYPES[dtype]
        self.kv_config = FrameKVConfig(**dict(kv or {}))
        self._graph = make_vjepa2_graph(cfg)

    def graph(self) -> ModelGraph:
        """Return the world-model graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return KV_CACHE for the predictor (its own frame-block engine), STATELESS otherwise."""
        types = dict.fromkeys(self._graph.nodes, EngineType.STATELESS)
        types["predictor"] = EngineType.KV_CACHE
        return types

    def tasks(self) -> tuple[str, ...]:
        """Return the three tasks."""
        return ("encode", "rollout", "plan")

    def submodule(self, node: str, device: torch.device) -> Any:
        """Load the encoder or predictor onto ``device``, or return a planning node."""
        if node == "encoder":
            return EncoderNode(load_encoder(self.checkpoint, self.config, device, self.dtype), self.config.normalize_reps)
        if node == "predictor":
            return PredictorNode(load_predictor(self.checkpoint, self.config, device, self.dtype), self.kv_config)
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
        known = _INPUT_KEYS[request.task] | (frozenset(_PLAN_KEYS) if request.task == "plan" else frozenset())
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown {request.task} fields {sorted(unknown)}; known: {sorted(known)}")
        if request.task == "encode":
            images = data.get("images", [data["image"]] if "image" in data else None)
            if not isinstance(images, list | tuple) or not images:
                raise ValueError("encode needs image (or images: a non-empty list)")
            frames = torch.stack([prepare_image(im, self.config, "images") for im in images])
            return PreparedRequest({"encoder": {"frames": frames, "purpose": "encode"}}, "encode")
        if request.task == "rollout":
            return self._rollout(data)
        return self._plan(data)

    def _rollout(self, data: Mapping[str, Any]) -> PreparedRequest:
        actions = as_actions(data.get("actions"), self.config)
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise ValueError(f"stream must be true or false, got {stream!r}")
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
        return PreparedRequest({"encoder": {"frames": frames, "purpose": "rollout"}, "predictor": predictor}, "rollout")

    def _plan(self, data: Mapping[str, Any]) -> PreparedRequest:
        overrides = {k: data[k] for k in _PLAN_KEYS if k in data}
        params = CEMParams.make(self.config.cem, overrides)
        if params.rollout > self.config.predictor.max_horizon:
            raise ValueError(f"rollout must be at most {self.config.predictor.max_horizon}, got {params.rollout}")
        sample: dict[str, Any] = {"pose0": as_pose(data.get("pose"), self.config), "cem": CEMState.initial(params).to_value()}
        if "latent" in data or "goal_latent" in data:
            sample["context"] = as_latent(data.get("latent"), self.config, "latent")
            goal = as_latent(data.get("goal_latent"), self.config, "goal_latent")
            return PreparedRequest({"cem_sample": sample, "cem_update": {"goal": goal}}, "plan_latent")
        if "image" not in data or "goal_image" not in data:
            raise ValueError("plan needs image and goal_image (or latent and goal_latent)")
        frames = torch.stack([prepare_image(data["image"], self.config), prepare_image(data["goal_image"], self.config, "goal_image")])
        return PreparedRequest({"encoder": {"frames": frames, "purpose": "plan"}, "cem_sample": sample}, "plan")

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Return the walk preprocessing chose."""
        return str(state) if partition == PARTITION else None

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Every task is one walk."""
        return None


def _cached_random_checkpoint(cfg: VJepa2Config, seed: int) -> Path:
    """Return the cached random checkpoint of ``cfg``, writing it once (atomically)."""
    from mstar.zoo.smollm2 import mstar_cache_dir

    path = mstar_cache_dir() / "vjepa2" / f"{cfg.name}-seed{seed}.pt"
    if not path.is_file():
        log.info("writing_random_checkpoint", config=cfg.name, path=str(path))
        make_random_checkpoint(cfg, path, seed=seed)  # written aside, renamed into place
    return path
