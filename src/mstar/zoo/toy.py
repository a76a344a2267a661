"""`toy-composite`: a small composite model that exercises every walk primitive.

Three partitions, real torch compute with seeded random weights:

* ``LM``: ``prefill`` = Sequential(encoder, lm); ``decode`` = DynamicLoop(lm) until the
  end token; the last token persists from walk to walk and streams to the vocoder.
* ``Vocoder``: ``vocode`` fires per sliding window of 4 tokens (stride 2) and emits audio
  for the new tokens of each window.
* ``Image``: ``image_gen`` = Sequential(init, Loop(Sequential(Parallel(cond, uncond),
  combine)), vae): classifier-free guidance in a fixed-step flow loop; the per-step latent
  norms are accumulated and emitted once.

Tasks: ``speech`` runs LM and Vocoder; ``image`` runs Image.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mstar.engines.stateless import BatchedNode, batched
from mstar.graph import (
    EMIT,
    Connection,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    Loop,
    ModelGraph,
    NodeFn,
    Parallel,
    Sequential,
    StreamingGraphEdge,
)
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request
from mstar.streaming import Chunk, SlidingWindowChunkPolicy

__all__ = ["ToyConfig", "ToyModel", "ToyPlan", "make_toy_graph", "make_toy_inputs", "make_toy_nodes"]


@dataclass(frozen=True)
class ToyConfig:
    """Sizes of the toy model."""

    dim: int = 32
    vocab: int = 64
    eos_id: int = 0
    bos_id: int = 1
    max_new_tokens: int = 24
    samples_per_token: int = 160
    sample_rate: int = 16_000
    image_size: int = 8
    flow_steps: int = 6
    guidance: float = 3.0


def make_toy_graph(cfg: ToyConfig = ToyConfig()) -> ModelGraph:
    """Build the toy model's graph and walks."""
    encoder = GraphNode("encoder", {"text"}, [GraphEdge("lm", "hidden", persist=True)])
    lm = GraphNode(
        "lm",
        {"hidden", "token"},
        [
            GraphEdge("lm", "token", persist=True),
            GraphEdge(EMIT, "token", modality="text"),
            StreamingGraphEdge("vocoder", "token"),
        ],
        signals={"eos"},
    )
    vocoder = GraphNode("vocoder", {"token"}, [GraphEdge(EMIT, "audio", modality="audio")])
    init = GraphNode(
        "init",
        {"seed"},
        [GraphEdge("cond", "x"), GraphEdge("uncond", "x"), GraphEdge("combine", "x")],
    )
    cond = GraphNode("cond", {"x", "prompt"}, [GraphEdge("combine", "v_cond")])
    uncond = GraphNode("uncond", {"x"}, [GraphEdge("combine", "v_uncond")])
    combine = GraphNode(
        "combine",
        {"x", "v_cond", "v_uncond"},
        [
            GraphEdge("cond", "x"),
            GraphEdge("uncond", "x"),
            GraphEdge("combine", "x"),
            GraphEdge("vae", "x"),
            GraphEdge(EMIT, "norm", modality="latent"),
        ],
    )
    vae = GraphNode("vae", {"x"}, [GraphEdge(EMIT, "image", modality="image")])
    flow = Loop(Sequential([Parallel([cond, uncond]), combine]), cfg.flow_steps, accumulated_outputs={"norm"})
    return ModelGraph(
        name="toy-composite",
        walks={
            "prefill": Sequential([encoder, lm]),
            "decode": DynamicLoop(lm, max_iters=cfg.max_new_tokens - 1, stop="eos"),
            "vocode": vocoder,
            "image_gen": Sequential([init, flow, vae]),
        },
        partitions={"LM": ["prefill", "decode"], "Vocoder": ["vocode"], "Image": ["image_gen"]},
        connections=[Connection("LM", "Vocoder", "token", SlidingWindowChunkPolicy(4, 2))],
        inputs={"encoder": {"text"}, "lm": {"token"}, "init": {"seed"}, "cond": {"prompt"}},
    )


class ToyPlan:
    """The toy model's per-request walk state machine; ``state`` is the task name."""

    _first: ClassVar[dict[tuple[str, str], str]] = {
        ("speech", "LM"): "prefill",
        ("speech", "Vocoder"): "vocode",
        ("image", "Image"): "image_gen",
    }
    _next: ClassVar[dict[str, str]] = {"prefill": "decode", "vocode": "vocode"}

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Return the partition's first walk for the task."""
        return self._first.get((state, partition))

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Return the next walk; ``vocode`` repeats until its stream ends."""
        return self._next.get(finished)


def make_toy_inputs(text: str, cfg: ToyConfig = ToyConfig(), seed: int = 0) -> dict[str, dict[str, Any]]:
    """Return request inputs for both tasks (each task reads the ones it needs)."""
    ids = torch.tensor(list(text.encode("utf-8"))[:256] or [0], dtype=torch.long) % cfg.vocab
    return {
        "encoder": {"text": ids},
        "lm": {"token": torch.tensor(cfg.bos_id)},
        "init": {"seed": seed},
        "cond": {"prompt": ids},
    }


def make_toy_nodes(cfg: ToyConfig = ToyConfig(), seed: int = 0) -> dict[str, NodeFn]:
    """Return the node callables, with weights drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    d, v = cfg.dim, cfg.vocab
    emb = torch.randn(v, d, generator=g)
    w_enc = torch.randn(d, d, generator=g) / math.sqrt(d)
    w_lm = torch.randn(v, d, generator=g) / math.sqrt(d)
    pixels = cfg.image_size * cfg.image_size
    w_cond = torch.randn(pixels, d, generator=g) / math.sqrt(d)
    w_vel = torch.randn(pixels, pixels, generator=g) / math.sqrt(pixels)
    dt = 1.0 / cfg.flow_steps
    t = torch.arange(cfg.samples_per_token, dtype=torch.float32) / cfg.sample_rate

    def encoder(x: Mapping[str, Any]) -> dict[str, Any]:
        return {"hidden": torch.tanh(w_enc @ emb[x["text"]].mean(0))}

    def lm(x: Mapping[str, Any]) -> dict[str, Any]:
        logits = w_lm @ torch.tanh(x["hidden"] + emb[x["token"]])
        token = logits.argmax()
        return {"token": token, "eos": bool(token == cfg.eos_id)}

    def vocoder(x: Mapping[str, Any]) -> dict[str, Any]:
        chunk: Chunk[torch.Tensor] = x["token"]
        freqs = [200.0 + 20.0 * int(tok) for tok in chunk.new_items]
        waves = [0.3 * torch.sin(2 * math.pi * f * t) for f in freqs]
        return {"audio": torch.cat(waves) if waves else torch.zeros(0)}

    def init(x: Mapping[str, Any]) -> dict[str, Any]:
        noise = torch.randn(pixels, generator=torch.Generator().manual_seed(int(x["seed"])))
        return {"x": noise}

    def cond(x: Mapping[str, Any]) -> dict[str, Any]:
        return {"v_cond": torch.tanh(w_vel @ x["x"] + w_cond @ emb[x["prompt"]].mean(0))}

    def uncond(x: Mapping[str, Any]) -> dict[str, Any]:
        return {"v_uncond": torch.tanh(w_vel @ x["x"])}

    def combine(x: Mapping[str, Any]) -> dict[str, Any]:
        v = x["v_uncond"] + cfg.guidance * (x["v_cond"] - x["v_uncond"])
        nxt = x["x"] + dt * v
        return {"x": nxt, "norm": nxt.norm()}

    def vae(x: Mapping[str, Any]) -> dict[str, Any]:
        img = torch.sigmoid(x["x"]).reshape(cfg.image_size, cfg.image_size)
        return {"image": (img * 255).to(torch.uint8)}

    return {
        "encoder": encoder,
        "lm": lm,
        "vocoder": vocoder,
        "init": init,
        "cond": cond,
        "uncond": uncond,
        "combine": combine,
        "vae": vae,
    }


class ToyModel(Model):
    """`toy-composite` as a servable model: every node stateless, weights from ``seed``.

    Request: ``Request(task="speech" | "image", data={"text": ..., "seed": ...})``. Audio
    outputs are float32 samples at `audio_sample_rate`; images are uint8 [H, W].
    """

    name = "toy-composite"
    audio_sample_rate = ToyConfig.sample_rate

    def __init__(self, seed: int = 0, **config: Any) -> None:
        self.seed = seed
        self.config = ToyConfig(**config)
        self._graph = make_toy_graph(self.config)
        self._nodes = make_toy_nodes(self.config, seed)
        self._plan = ToyPlan()

    def graph(self) -> ModelGraph:
        """Return the toy graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return STATELESS for every node."""
        return dict.fromkeys(self._graph.nodes, EngineType.STATELESS)

    def submodule(self, node: str, device: torch.device) -> BatchedNode:
        """Return the node's computation, batched by looping (the toy nodes are tiny)."""
        return batched(self._nodes[node])

    def tasks(self) -> tuple[str, ...]:
        """Return the two tasks."""
        return ("speech", "image")

    def preprocess(self, request: Request) -> PreparedRequest:
        """Check the task and text; build inputs."""
        if request.task not in self.tasks():
            raise ValueError(f"task must be one of {list(self.tasks())}, got {request.task!r}")
        text = request.data.get("text", "")
        if not isinstance(text, str) or not text:
            raise ValueError("data['text'] must be a non-empty string")
        seed = int(request.data.get("seed", 0))
        return PreparedRequest(make_toy_inputs(text, self.config, seed), request.task)

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Return the partition's first walk for the task."""
        return self._plan.first_walk(partition, state)

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Return the next walk."""
        return self._plan.next_walk(partition, state, finished)
