"""pi0.5 as an mstar model: a prefix into the paged KV cache, then a 10-step flow-matching loop.

One partition, ``policy``; two nodes, ``vision`` (stateless SigLIP) and ``llm`` (both Gemma
experts on one paged cache, fired by forward passes). Walks::

    prefill     Sequential[vision, llm]       images -> image tokens; prefix written (bidirectional)
    action_gen  Loop(llm, num_steps)          each step: action tokens query the prefix read-only,
                                              x <- x + dt * v; after the last one -> actions EMIT

Requests (``Request("act", observation)``) take the observation dict of the model's robot, as
openpi's policy for that robot reads it (`mstar.zoo.pi05.robots`: DROID, LIBERO or ALOHA; DROID's
is ``observation/exterior_image_1_left`` and ``observation/wrist_image_left`` (uint8 H x W x 3),
``observation/joint_position`` (7), ``observation/gripper_position`` (1) and ``prompt``),
optionally with ``noise`` ``[horizon, action_dim]`` or ``seed``. Preprocessing
quantile-normalizes the state with the checkpoint's norm stats, bins it into the prompt
``Task: ..., State: ...;\nAction: `` (where the robot's config does) and prepares the images;
postprocessing un-normalizes the actions, cuts them to the robot's dimensions and maps them to
its convention: ``actions`` ``[horizon, 8]`` for DROID.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.engines.parallel import TensorShard, current_shard
from mstar.errors import CheckpointError
from mstar.graph import EMIT, Emission, GraphEdge, GraphNode, Loop, ModelGraph, Sequential
from mstar.runtime.model import (
    EngineType,
    Model,
    Output,
    PreparedRequest,
    Request,
    SupportsActionPolicy,
)
from mstar.zoo.pi05.checkpoint import cached_random_checkpoint, load_pi05
from mstar.zoo.pi05.checkpoint_config import checkpoint_dtype_name, config_from_checkpoint
from mstar.zoo.pi05.config import Pi05Config, get_pi05_config
from mstar.zoo.pi05.modules import Pi05Weights
from mstar.zoo.pi05.nodes import LLMNode, VisionNode
from mstar.zoo.pi05.norm_stats import find_norm_stats
from mstar.zoo.pi05.policy import prompt_state, quantile_shift, robot_actions
from mstar.zoo.pi05.prompt import PromptTokenizer
from mstar.zoo.pi05.robots import get_robot_layout
from mstar.zoo.requests import initial_noise

__all__ = ["PARTITION", "Pi05Model", "make_pi05_graph"]

PARTITION = "policy"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_pi05_graph(config: Pi05Config) -> ModelGraph:
    """Return the graph and walks of a pi0.5 model."""
    vision = GraphNode(
        "vision", {"images", "image_mask", "token_ids"}, [GraphEdge("llm", "prefix")]
    )
    llm = GraphNode(
        "llm",
        {"prefix", "flow"},
        [
            GraphEdge("llm", "prefix", persist=True),
            GraphEdge("llm", "flow", persist=True),
            GraphEdge(EMIT, "actions", modality="action"),
        ],
    )
    return ModelGraph(
        name=config.name,
        walks={
            "prefill": Sequential([vision, llm]),
            "action_gen": Loop(llm, max_iters=config.num_steps),
        },
        partitions={PARTITION: ["prefill", "action_gen"]},
        inputs={"vision": {"images", "image_mask", "token_ids"}, "llm": {"flow"}},
    )


class Pi05Model(Model, SupportsActionPolicy):
    """pi0.5, an action policy for DROID, LIBERO or ALOHA robots.

    Args:
        config: A preset (``pi05-droid``, ``pi05-small`` or ``pi05-tiny``), or None: the sizes,
            the robot and the action dim and horizon are read from ``checkpoint``
            (`mstar.zoo.pi05.checkpoint_config`).
        checkpoint: A directory in openpi's PyTorch layout (``model.safetensors``, ``config.json``,
            ``assets/<asset_id>/norm_stats.json``) or LeRobot's (``config.json`` with ``"type":
            "pi05"``, its normalizer ``.safetensors``). Without one the small presets get random
            weights and norm stats, written once under the mstar cache; ``pi05-droid`` needs it.
        tokenizer: PaliGemma's SentencePiece ``tokenizer.model``; by default the checkpoint's own
            (``tokenizer.model`` or ``paligemma_tokenizer.model`` beside the weights); the small
            presets train a tiny one once, locally.
        robot: Whose observations requests carry (``droid``, ``libero``, ``aloha``); by default
            the checkpoint's (its ``assets/`` folder, its config), else DROID.
        asset_id: Which ``assets/`` entry holds the norm stats (default: the robot's openpi id);
            naming one means only that one is used.
        norm_stats: A stats file to use instead: openpi's ``norm_stats.json`` or a LeRobot
            normalizer ``.safetensors``.
        dtype: "float32", "bfloat16" or "auto" (the checkpoint's).
        seed: Seed of the random weights.
    """

    def __init__(
        self,
        config: str | None = "pi05-tiny",
        *,
        checkpoint: str | None = None,
        tokenizer: str | None = None,
        robot: str | None = None,
        asset_id: str | None = None,
        norm_stats: str | None = None,
        dtype: str = "float32",
        seed: int = 0,
    ) -> None:
        if dtype not in (*_DTYPES, "auto"):
            raise ValueError(
                f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}, got {dtype!r}"
            )
        if config is None:
            if checkpoint is None:
                raise CheckpointError(
                    "pi0.5 needs config= a preset or checkpoint= a directory to read it from"
                )
            cfg = config_from_checkpoint(checkpoint, robot=robot)
        else:
            cfg = get_pi05_config(config)
            if robot is not None and robot != cfg.robot:
                cfg = dataclasses.replace(
                    cfg, robot=robot, robot_dof=get_robot_layout(robot).action_dim
                )
        if checkpoint is None:
            if config == "pi05-droid":
                raise CheckpointError(
                    "pi05-droid needs checkpoint= a directory in openpi's PyTorch layout"
                )
            checkpoint = str(cached_random_checkpoint(cfg, seed=seed))
        path = Path(checkpoint)
        if not (path / "model.safetensors").is_file():
            raise CheckpointError(f"pi0.5 checkpoint {checkpoint!r} has no model.safetensors")
        self.layout = get_robot_layout(cfg.robot)
        self.name = cfg.name
        self.config = cfg
        self.checkpoint = str(path)
        self.dtype = _DTYPES[checkpoint_dtype_name(path) if dtype == "auto" else dtype]
        self.norm_stats, self.norm_stats_source = find_norm_stats(
            path,
            self.layout.asset_id if asset_id is None else asset_id,
            path=norm_stats,
            is_asset_id_given=asset_id is not None,
        )
        if self.norm_stats.state.num_dims < self.layout.state_dim:
            raise CheckpointError(
                f"norm stats {self.norm_stats_source} cover {self.norm_stats.state.num_dims} "
                "state dims, "
                f"but a {self.layout.label} robot sends {self.layout.state_dim}"
            )
        self.tokenizer = PromptTokenizer.from_config(
            cfg, tokenizer if tokenizer is not None else _shipped_tokenizer(path)
        )
        self._graph = make_pi05_graph(cfg)
        # by device and tensor-parallel shard (rank, world)
        self._weights: dict[tuple[torch.device, TensorShard | None], Pi05Weights] = {}
        self._loading: dict[Any, threading.Lock] = {}  # ranks load on worker threads
        self._loading_lock = threading.Lock()

    policy_task = "act"
    policy_output = "actions"

    def policy_metadata(self) -> dict[str, Any]:
        """Return what a robot client gets on connecting: the model and its chunk's shape."""
        cfg = self.config
        return {
            "model": self.name,
            "robot": cfg.robot,
            "action_horizon": cfg.action_horizon,
            "action_dim": cfg.robot_dof,
        }

    def graph(self) -> ModelGraph:
        """Return the policy graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return STATELESS for ``vision``, KV_CACHE for ``llm``."""
        return {"vision": EngineType.STATELESS, "llm": EngineType.KV_CACHE}

    def tasks(self) -> tuple[str, ...]:
        """Return the one task: an action chunk for an observation."""
        return ("act",)

    def load_weights(self, device: torch.device, nodes: Iterable[str] | None = None) -> Pi05Weights:
        """Load the weights ``nodes`` read onto ``device`` (default: every node's).

        One `Pi05Weights` per device, shared by the nodes there: each call reads only the
        parameters not loaded there yet (`mstar.zoo.pi05.checkpoint.NODE_WEIGHTS`); the rest
        stay on the meta device. A tensor-parallel rank's ``llm`` is its shard (`sharded`):
        ranks of one process on one device keep weights of their own.
        """
        with self._lock(device):
            return self._load(device, nodes)

    def _lock(self, device: torch.device) -> threading.Lock:
        with self._loading_lock:
            return self._loading.setdefault(self._key(device), threading.Lock())

    @staticmethod
    def _key(device: torch.device) -> tuple[torch.device, TensorShard | None]:
        # the shard with its group: two replicas' rank 0s are two models (each sums over its own)
        return device, current_shard()

    def _load(self, device: torch.device, nodes: Iterable[str] | None) -> Pi05Weights:
        key = self._key(device)
        weights = load_pi05(
            self.checkpoint, self.config, device=device, dtype=self.dtype, nodes=nodes,
            into=self._weights.get(key),
        )  # fmt: skip
        self._weights[key] = weights
        return weights

    def submodule(self, node: str, device: torch.device) -> Any:
        """Load the node's weights onto ``device`` (once) and return the node."""
        if node == "vision":
            return VisionNode(self.load_weights(device, ["vision"]))
        if node == "llm":
            with self._lock(device):
                weights = self._load(device, ["llm"])
                if weights.modulation is None:  # fused once (another node may share them)
                    cfg = self.config
                    robots = (1, 16)
                    weights.fuse_for_inference(
                        prefix_rows=tuple(r * cfg.prefix_len for r in robots),
                        action_rows=tuple(r * cfg.action_horizon for r in robots),
                    )
            return LLMNode(weights)
        raise KeyError(node)

    def preprocess(self, request: Request) -> PreparedRequest:
        """Parse the robot's observation; normalize and bin the state into the prompt; draw the
        noise."""
        if request.task != "act":
            raise ValueError(f"task must be 'act', got {request.task!r}")
        data = request.data
        if "prompt" not in data and "text" in data:  # the native route's name for a prompt
            data = {**data, "prompt": data["text"]}
        obs = self.layout.parse(data)
        cfg = self.config
        state = (
            prompt_state(obs, self.norm_stats, cfg.prompt_state_dim)
            if cfg.discrete_state_input
            else None
        )
        images, mask = obs.camera_images(cfg.cameras, cfg.vision.image_size)
        token_ids = torch.tensor(self.tokenizer.token_ids(obs.prompt, state), dtype=torch.long)
        noise = initial_noise(data, (cfg.action_horizon, cfg.action_dim), request.params.seed)
        flow: dict[str, Any] = {"x": noise, "step": 0}
        offset = self.layout.delta_offset(obs.state, cfg.action_dim)
        if offset is not None:  # the model's delta actions made absolute, in its normalized units
            flow["offset"] = torch.from_numpy(quantile_shift(offset, self.norm_stats.actions)).to(
                torch.float32
            )
        return PreparedRequest(
            {
                "vision": {"images": images, "image_mask": mask, "token_ids": token_ids},
                "llm": {"flow": flow},
            },
            None,
        )

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Start with the prefix."""
        return "prefill" if partition == PARTITION else None

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """The flow loop follows the prefix; then the request is done."""
        return "action_gen" if finished == "prefill" else None

    def postprocess(self, request_id: str, emission: Emission) -> Output:
        """Un-normalize the actions, cut them to the robot's dimensions, in its convention (float32
        numpy)."""
        value = emission.value
        if emission.name == "actions":
            value = robot_actions(torch.as_tensor(value), self.norm_stats, self.layout).astype(
                np.float32
            )
        return Output(
            request_id, emission.modality, emission.name, value, emission.node, emission.walk
        )


def _shipped_tokenizer(checkpoint: Path) -> str | None:
    """Return the SentencePiece model a checkpoint directory ships beside its weights, if any."""
    for name in ("tokenizer.model", "paligemma_tokenizer.model"):
        if (checkpoint / name).is_file():
            return str(checkpoint / name)
    return None
