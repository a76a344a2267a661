"""`toy-composite`: a small composite model that exercises every walk primitive.

Three partitions, real torch compute with seeded random weights:

* ``LM``: ``prefill`` = Sequential(encoder, lm); ``decode`` = DynamicLoop(lm) until the
  end token; the last token persists from walk to walk and streams to the vocoder.
* ``Vocoder``: ``vocode`` fires per sliding window of 4 tokens (stride 2) and emits audio
  for the new tokens of each window.
* ``Image``: ``image_gen`` = Sequential(init, Loop(Sequential(Parallel(cond, uncond),
  combine)), vae): classifier-free guidance in a fixed-step flow loop; the per-step latent
  norms are accumulated and emitted once. ``image_edit`` = Sequential(image_encoder, the same
  flow loop, vae): the flow starts from the input image's latent (the VAE's inverse) mixed
  with noise, as SDEdit does, instead of from pure noise.

Tasks: ``speech`` runs LM and Vocoder; ``image`` runs Image from noise; ``image_edit`` runs
Image from one or more input images (their latents averaged).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

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
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request, SupportsAudioOutput
from mstar.streaming import Chunk, SlidingWindowChunkPolicy
from mstar.zoo.requests import speech_text

__all__ = [
    "ToyConfig",
    "ToyModel",
    "ToyPlan",
    "make_toy_graph",
    "make_toy_inputs",
    "make_toy_nodes",
    "prepare_toy_images",
]


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
    edit_strength: float = 0.5  # share of noise in the latent an edit starts from
    max_edit_images: int = 16


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
    image_encoder = GraphNode(
        "image_encoder",
        {"image", "seed"},
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
    flow = Loop(
        Sequential([Parallel([cond, uncond]), combine]),
        cfg.flow_steps,
        accumulated_outputs={"norm"},
    )
    return ModelGraph(
        name="toy-composite",
        walks={
            "prefill": Sequential([encoder, lm]),
            "decode": DynamicLoop(lm, max_iters=cfg.max_new_tokens - 1, stop="eos"),
            "vocode": vocoder,
            "image_gen": Sequential([init, flow, vae]),
            "image_edit": Sequential([image_encoder, flow, vae]),
        },
        partitions={
            "LM": ["prefill", "decode"],
            "Vocoder": ["vocode"],
            "Image": ["image_gen", "image_edit"],
        },
        connections=[Connection("LM", "Vocoder", "token", SlidingWindowChunkPolicy(4, 2))],
        inputs={
            "encoder": {"text"},
            "lm": {"token"},
            "init": {"seed"},
            "image_encoder": {"image", "seed"},
            "cond": {"prompt"},
        },
    )


class ToyPlan:
    """The toy model's per-request walk state machine; ``state`` is the task name."""

    _first: ClassVar[dict[tuple[str, str], str]] = {
        ("speech", "LM"): "prefill",
        ("speech", "Vocoder"): "vocode",
        ("image", "Image"): "image_gen",
        ("image_edit", "Image"): "image_edit",
    }
    _next: ClassVar[dict[str, str]] = {"prefill": "decode", "vocode": "vocode"}

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Return the partition's first walk for the task."""
        return self._first.get((state, partition))

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Return the next walk; ``vocode`` repeats until its stream ends."""
        return self._next.get(finished)


def make_toy_inputs(
    text: str, cfg: ToyConfig = ToyConfig(), seed: int = 0, images: torch.Tensor | None = None
) -> dict[str, dict[str, Any]]:
    """Return request inputs for every task (each task reads the ones it needs).

    Args:
        text: The prompt.
        cfg: Sizes.
        seed: Seed of the image noise.
        images: Edit inputs from `prepare_toy_images` (needed by ``image_edit`` only).
    """
    ids = torch.tensor(list(text.encode("utf-8"))[:256] or [0], dtype=torch.long) % cfg.vocab
    inputs: dict[str, dict[str, Any]] = {
        "encoder": {"text": ids},
        "lm": {"token": torch.tensor(cfg.bos_id)},
        "init": {"seed": seed},
        "cond": {"prompt": ids},
    }
    if images is not None:
        inputs["image_encoder"] = {"image": images, "seed": seed}
    return inputs


def prepare_toy_images(images: Sequence[Any], cfg: ToyConfig = ToyConfig()) -> torch.Tensor:
    """Turn edit inputs into what ``image_encoder`` reads: grey uint8 ``[N, size, size]``.

    Args:
        images: Each a uint8 tensor or array (or integers in 0..255), ``[H, W]`` (grey),
            ``[H, W, 3]`` (RGB) or ``[H, W, 4]`` (RGBA, alpha ignored), any size (resized,
            area-averaged).

    Raises:
        ValueError: No images, too many, or one is not a uint8 image of those shapes.
    """
    if not 1 <= len(images) <= cfg.max_edit_images:
        raise ValueError(f"an edit takes 1 to {cfg.max_edit_images} images, got {len(images)}")
    out = []
    for i, image in enumerate(images):
        try:
            pixels = (
                image if isinstance(image, torch.Tensor) else torch.as_tensor(np.asarray(image))
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"image {i} is not an array of pixels: {exc}") from None
        if pixels.dim() not in (2, 3) or (pixels.dim() == 3 and pixels.shape[2] not in (1, 3, 4)):
            raise ValueError(
                f"image {i} must be [H, W], [H, W, 3] or [H, W, 4], got shape {list(pixels.shape)}"
            )
        if min(pixels.shape[:2]) < 1:
            raise ValueError(f"image {i} is empty")
        if pixels.dtype != torch.uint8:
            # integer pixels (from JSON, say) are accepted when they fit in a byte
            is_bytes = (
                not pixels.is_floating_point()
                and not pixels.is_complex()
                and pixels.dtype != torch.bool
            )
            if not is_bytes or int(pixels.min()) < 0 or int(pixels.max()) > 255:
                raise ValueError(f"image {i} must hold uint8 pixels (0 to 255), got {pixels.dtype}")
        grey = pixels.float() if pixels.dim() == 2 else pixels[..., :3].float().mean(-1)
        size = (cfg.image_size, cfg.image_size)
        resized = F.interpolate(grey[None, None], size=size, mode="area")[0, 0]
        out.append(resized.round().clamp(0, 255).to(torch.uint8))
    return torch.stack(out)


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

    def image_encoder(x: Mapping[str, Any]) -> dict[str, Any]:
        # The VAE's inverse (logit of the pixels, kept finite), averaged over the images.
        p = (x["image"].reshape(-1, pixels).float() + 0.5) / 256.0
        latent = torch.log(p / (1 - p)).mean(0)
        noise = torch.randn(pixels, generator=torch.Generator().manual_seed(int(x["seed"])))
        return {"x": (1 - cfg.edit_strength) * latent + cfg.edit_strength * noise}

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
        "image_encoder": image_encoder,
        "cond": cond,
        "uncond": uncond,
        "combine": combine,
        "vae": vae,
    }


class ToyModel(Model, SupportsAudioOutput):
    """`toy-composite` as a servable model: every node stateless, weights from ``seed``.

    Request: ``Request(task="speech" | "image" | "image_edit", data={"text": ..., "seed": ...})``;
    an edit also takes ``data["images"]``, a list of uint8 images (see `prepare_toy_images`),
    or one as ``data["image"]``.
    Audio outputs are float32 samples at `audio_sample_rate`; images are uint8 [H, W].
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
        """Return the three tasks."""
        return ("speech", "image", "image_edit")

    def preprocess(self, request: Request) -> PreparedRequest:
        """Check the task and text; build inputs."""
        if request.task not in self.tasks():
            raise ValueError(f"task must be one of {list(self.tasks())}, got {request.task!r}")
        if request.task == "speech":  # it speaks text, or the last user turn of messages
            text = speech_text(request.data)
        else:
            text = request.data.get("text", "")
            if not isinstance(text, str) or not text:
                raise ValueError("data['text'] must be a non-empty string")
        seed = request.params.seed or 0
        images = None
        if request.task == "image_edit":
            data = request.data
            given = data.get("images", [data["image"]] if "image" in data else None)
            if not isinstance(given, list | tuple):
                raise ValueError("an edit needs data['images'] (a list of images) or data['image']")
            images = prepare_toy_images(given, self.config)
        return PreparedRequest(make_toy_inputs(text, self.config, seed, images), request.task)

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Return the partition's first walk for the task."""
        return self._plan.first_walk(partition, state)

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Return the next walk."""
        return self._plan.next_walk(partition, state, finished)
