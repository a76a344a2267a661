"""BAGEL as an mstar model: prefills into one paged cache, then a flow loop with CFG branches, or decoding.

One partition, ``bagel``. Walks::

    prefill_text  llm                              the next text item -> every context that takes it
    prefill_vit   Sequential[vit, llm_vit]         an image's ViT tokens (understanding weights, full mask)
    prefill_vae   Sequential[vae_encoder, llm_vae] an image's VAE tokens (generation weights, full mask)
    decode        DynamicLoop(llm)                 greedy text until <|im_end|> (the engine's decode loop)
    image_gen     Sequential[
                    DynamicLoop(Sequential[
                      Parallel[denoise, denoise_cfg_text, denoise_cfg_img],   read-only queries, each
                      cfg_combine]),                                          over its own context
                    vae_decoder]                                              -> PNG

A request's walks follow its items (text: ``prefill_text``; an image: ``prefill_vae`` and/or
``prefill_vit``), then ``image_gen`` or ``decode``. The flow loop is a `DynamicLoop` because its
length (``num_timesteps - 1``) is the request's; ``cfg_combine`` raises ``done`` after the last
step and, each step, hands each branch its next query or None (a branch that step skips).

Tasks: ``image`` (``prompt``), ``edit`` (``image``, ``prompt``: the output has the input's size),
``understand`` (``image``, ``prompt``). Prompts may be ``token_ids`` instead of text. Options:
``seed`` or ``noise``, ``height``/``width`` (``image``), ``num_timesteps``, ``timestep_shift``,
``cfg_text_scale``, ``cfg_img_scale``, ``cfg_interval``, ``cfg_renorm_type``, ``cfg_renorm_min``,
``max_tokens`` (``understand``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mstar.errors import CheckpointError
from mstar.graph import (
    EMIT,
    DynamicLoop,
    Emission,
    GraphEdge,
    GraphNode,
    ModelGraph,
    Parallel,
    Section,
    Sequential,
)
from mstar.runtime.model import (
    EngineType,
    Model,
    Output,
    PreparedRequest,
    Request,
    SupportsSharedEngines,
)
from mstar.zoo.bagel.checkpoint import cached_random_checkpoint, load_bagel
from mstar.zoo.bagel.config import BagelConfig, get_bagel_config
from mstar.zoo.bagel.context import ContextState, ImageItem, Item, TextItem
from mstar.zoo.bagel.flow import BRANCHES, COND, FlowSpec
from mstar.zoo.bagel.nodes import (
    CombineNode,
    LLMNode,
    Segments,
    VaeDecoderNode,
    VaeEncoderNode,
    VitNode,
    initial_flow,
    queries,
    query_input,
    velocity_output,
)
from mstar.zoo.bagel.vae import FluxVAE
from mstar.zoo.bagel.vision import image_tensor, resize_for
from mstar.zoo.bagel.weights import BagelWeights

__all__ = ["PARTITION", "BagelModel", "BagelPlan", "denoise_node", "make_bagel_graph"]

PARTITION = "bagel"
MAX_TIMESTEPS = 1000
TASKS = ("image", "edit", "understand")
# float64 runs the parity checks where one rounding step apart would flip a pixel.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def denoise_node(branch: str) -> str:
    """Return the node of a CFG branch."""
    return "denoise" if branch == COND else f"denoise_{branch}"


LLM_NODES = ("llm", "llm_vit", "llm_vae", *(denoise_node(b) for b in BRANCHES))
_CONTEXT_READERS = (*LLM_NODES, "vit", "vae_encoder")


def make_bagel_graph(config: BagelConfig) -> ModelGraph:
    """Return the graph and walks of a BAGEL model."""
    context = [GraphEdge(dst, "context", persist=True) for dst in _CONTEXT_READERS]
    llm = GraphNode("llm", {"segments", "context"}, [*context, GraphEdge(EMIT, "token", modality="text")], signals={"stop"})
    vit = GraphNode("vit", {"segments", "context"}, [GraphEdge("llm_vit", "vit_embeds")])
    vae_encoder = GraphNode("vae_encoder", {"segments", "context"}, [GraphEdge("llm_vae", "vae_latents")])
    llm_vit = GraphNode("llm_vit", {"vit_embeds", "context"}, context)
    llm_vae = GraphNode("llm_vae", {"vae_latents", "context"}, context)
    denoise = [
        GraphNode(denoise_node(b), {query_input(b), "context"}, [GraphEdge("cfg_combine", velocity_output(b))]) for b in BRANCHES
    ]
    combine = GraphNode(
        "cfg_combine",
        {"flow", *(velocity_output(b) for b in BRANCHES)},
        [
            GraphEdge("cfg_combine", "flow"),
            GraphEdge("vae_decoder", "flow"),
            *(GraphEdge(denoise_node(b), query_input(b)) for b in BRANCHES),
            GraphEdge("vae_decoder", "latents"),
            GraphEdge(EMIT, "latents", modality="latent"),
        ],
        signals={"done"},
    )
    vae_decoder = GraphNode("vae_decoder", {"latents", "flow"}, [GraphEdge(EMIT, "image", modality="image")])
    flow = DynamicLoop(Sequential([Parallel(denoise), combine]), max_iters=MAX_TIMESTEPS - 1, stop="done")
    walks: dict[str, Section] = {
        "prefill_text": llm,
        "prefill_vit": Sequential([vit, llm_vit]),
        "prefill_vae": Sequential([vae_encoder, llm_vae]),
        "decode": DynamicLoop(llm, max_iters=config.max_text_tokens, stop="stop"),
        "image_gen": Sequential([flow, vae_decoder]),
    }
    inputs: dict[str, set[str]] = {n: {"context"} for n in _CONTEXT_READERS}
    for name in ("llm", "vit", "vae_encoder"):
        inputs[name].add("segments")
    for b in BRANCHES:
        inputs[denoise_node(b)].add(query_input(b))
    inputs["cfg_combine"] = {"flow"}
    return ModelGraph(walks=walks, partitions={PARTITION: list(walks)}, inputs=inputs, name=config.name)


@dataclass
class BagelPlan:
    """A request's walks, in order, and how far it got."""

    walks: list[str]
    index: int = 0
    task: str = "image"
    spec: FlowSpec | None = None
    items: list[Item] = field(default_factory=list)


class BagelModel(Model, SupportsSharedEngines):
    """BAGEL (``bagel-7b-mot``, ``bagel-small`` or ``bagel-tiny``): text-to-image, editing, understanding.

    Args:
        config: Config name.
        checkpoint: A directory in the published layout; without one the small configs get
            random weights, written once under the mstar cache (``bagel-7b-mot`` needs one).
        dtype: "float32", "bfloat16" or "float64".
        seed: Seed of the random weights.
    """

    def __init__(self, config: str = "bagel-tiny", *, checkpoint: str | None = None, dtype: str = "float32", seed: int = 0) -> None:
        cfg = get_bagel_config(config)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if checkpoint is None:
            if config == "bagel-7b-mot":
                raise CheckpointError("bagel-7b-mot needs checkpoint= a directory in the published layout")
            checkpoint = str(cached_random_checkpoint(cfg, seed=seed))
        self.name = config
        self.config = cfg
        self.checkpoint = str(Path(checkpoint))
        self.dtype = _DTYPES[dtype]
        self._tokenizer: Any = None if config != "bagel-7b-mot" else _hf_tokenizer(self.checkpoint)
        self._graph = make_bagel_graph(cfg)
        self._loaded: dict[torch.device, tuple[BagelWeights, FluxVAE]] = {}
        self._llm_nodes: dict[torch.device, LLMNode] = {}

    # -- the contract ----------------------------------------------------------------------

    def graph(self) -> ModelGraph:
        """Return the graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return KV_CACHE for the LLM nodes, STATELESS for the rest."""
        types = dict.fromkeys(self._graph.nodes, EngineType.STATELESS)
        types.update(dict.fromkeys(LLM_NODES, EngineType.KV_CACHE))
        return types

    def engine_hosts(self) -> dict[str, str]:
        """Every LLM node runs on ``llm``'s engine: one paged cache for all contexts of a request."""
        return {n: "llm" for n in LLM_NODES if n != "llm"}

    def tasks(self) -> tuple[str, ...]:
        """Return the tasks."""
        return TASKS

    def load(self, device: torch.device) -> tuple[BagelWeights, FluxVAE]:
        """Load the weights onto ``device`` once (every node of a rank shares them)."""
        if device not in self._loaded:
            self._loaded[device] = load_bagel(self.checkpoint, self.config, device=device, dtype=self.dtype)
        return self._loaded[device]

    def submodule(self, node: str, device: torch.device) -> Any:
        """Return a node's computation on ``device``."""
        weights, vae = self.load(device)
        if node in LLM_NODES:
            if device not in self._llm_nodes:
                self._llm_nodes[device] = LLMNode(weights)
            return self._llm_nodes[device]
        if node == "vit":
            return VitNode(weights)
        if node == "vae_encoder":
            return VaeEncoderNode(weights, vae)
        if node == "cfg_combine":
            return CombineNode()
        if node == "vae_decoder":
            return VaeDecoderNode(weights, vae)
        raise KeyError(node)

    # -- requests ----------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """Return a prompt's ids (bytes for the small configs' toy vocabulary)."""
        if self._tokenizer is not None:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        return list(text.encode("utf-8"))

    def _text_item(self, data: Mapping[str, Any]) -> TextItem:
        tokens = self.config.tokens
        if "token_ids" in data:
            ids = [int(t) for t in data["token_ids"]]
            if any(not 0 <= t < self.config.llm.vocab_size for t in ids):
                raise ValueError(f"token_ids must be in [0, {self.config.llm.vocab_size})")
        elif isinstance(data.get("prompt"), str):
            ids = self.tokenize(data["prompt"])
        else:
            raise ValueError("a prompt is needed: 'prompt' (text) or 'token_ids'")
        if len(ids) > self.config.max_text_tokens:
            raise ValueError(f"the prompt has {len(ids)} tokens; at most {self.config.max_text_tokens}")
        return TextItem(torch.tensor([tokens.bos, *ids, tokens.eos], dtype=torch.long))

    def _image(self, data: Mapping[str, Any]) -> Image.Image:
        value = data.get("image")
        if isinstance(value, Image.Image):
            return value.convert("RGB")
        if isinstance(value, bytes | bytearray):
            try:
                return Image.open(BytesIO(value)).convert("RGB")
            except Exception as exc:
                raise ValueError(f"'image' is not an image: {exc}") from None
        if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3 and value.shape[2] == 3:
            return Image.fromarray(value)
        raise ValueError("'image' must be a PIL image, encoded image bytes or an H x W x 3 uint8 array")

    def preprocess(self, request: Request) -> PreparedRequest:
        """Make the request's items, its walks, its flow spec and noise.

        Raises:
            ValueError: An unknown task or a bad field (the message names it).
        """
        if request.task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {request.task!r}")
        cfg, data = self.config, request.data
        text = self._text_item(data)
        items: list[Item] = []
        if request.task == "image":
            height, width = int(data.get("height", cfg.image_size[0])), int(data.get("width", cfg.image_size[1]))
            for name, side in (("height", height), ("width", width)):
                if side % cfg.latent_downsample or not 0 < side <= cfg.max_image_side:
                    raise ValueError(f"{name} must be a multiple of {cfg.latent_downsample} in (0, {cfg.max_image_side}], got {side}")
        else:
            image = resize_for(self._image(data), cfg.vae_image)
            width, height = image.size
            vit = image_tensor(resize_for(image, cfg.vit_image))
            items.append(ImageItem(image_tensor(image) if request.task == "edit" else None, vit))
        items.append(text)
        walks = [w for item in items for w in _prefill_walks(item)]
        down = cfg.latent_downsample
        spec = None
        if request.task == "understand":
            walks.append("decode")
        else:
            spec = _flow_spec(cfg, request.task, height // down, width // down, data)
            walks.append("image_gen")
        max_tokens = int(data.get("max_tokens", cfg.max_text_tokens)) if request.task == "understand" else 0
        if not 0 <= max_tokens <= cfg.max_text_tokens:
            raise ValueError(f"max_tokens must be in [0, {cfg.max_text_tokens}], got {max_tokens}")
        segments = Segments(tuple(items), max_tokens)
        inputs: dict[str, dict[str, Any]] = {n: {"context": ContextState()} for n in _CONTEXT_READERS}
        for name in ("llm", "vit", "vae_encoder"):
            inputs[name]["segments"] = segments
        flow = initial_flow(spec, _noise(data, spec, cfg)) if spec is not None else None
        first = queries(flow) if flow is not None else dict.fromkeys(map(query_input, BRANCHES))
        for b in BRANCHES:
            inputs[denoise_node(b)][query_input(b)] = first[query_input(b)]
        inputs["cfg_combine"] = {"flow": flow}
        return PreparedRequest(inputs, BagelPlan(walks, task=request.task, spec=spec, items=items))

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Start with the first item's prefill."""
        plan: BagelPlan = state
        return plan.walks[0] if partition == PARTITION else None

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Go through the plan; after image_gen or decode the request is done."""
        plan: BagelPlan = state
        plan.index += 1
        return plan.walks[plan.index] if plan.index < len(plan.walks) else None

    def postprocess(self, request_id: str, emission: Emission) -> Output:
        """Pass values on: PNG bytes (``image``), token ids (``token``), latent tokens (``latents``)."""
        return Output(request_id, emission.modality, emission.name, emission.value, emission.node, emission.walk)


def _prefill_walks(item: Item) -> list[str]:
    if isinstance(item, TextItem):
        return ["prefill_text"]
    return (["prefill_vae"] if item.vae is not None else []) + (["prefill_vit"] if item.vit is not None else [])


_FLOAT_OPTIONS = ("timestep_shift", "cfg_text_scale", "cfg_img_scale", "cfg_renorm_min")


def _flow_spec(cfg: BagelConfig, task: str, height: int, width: int, data: Mapping[str, Any]) -> FlowSpec:
    overrides: dict[str, Any] = {}
    for name in _FLOAT_OPTIONS:
        if name in data:
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
            overrides[name] = float(value)
    if "num_timesteps" in data:
        steps = data["num_timesteps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 2 <= steps <= MAX_TIMESTEPS:
            raise ValueError(f"num_timesteps must be an integer in [2, {MAX_TIMESTEPS}], got {steps!r}")
        overrides["num_timesteps"] = steps
    if "cfg_interval" in data:
        interval = data["cfg_interval"]
        if not isinstance(interval, list | tuple) or len(interval) != 2 or not all(isinstance(v, int | float) for v in interval):
            raise ValueError(f"cfg_interval must be two numbers [low, high], got {interval!r}")
        overrides["cfg_interval"] = (float(interval[0]), float(interval[1]))
    if "cfg_renorm_type" in data:
        if data["cfg_renorm_type"] not in ("global", "channel", "text_channel"):
            raise ValueError(f"cfg_renorm_type must be 'global', 'channel' or 'text_channel', got {data['cfg_renorm_type']!r}")
        overrides["cfg_renorm_type"] = data["cfg_renorm_type"]
    return FlowSpec.of(height, width, cfg.t2i if task == "image" else cfg.edit, **overrides)


def _noise(data: Mapping[str, Any], spec: FlowSpec, cfg: BagelConfig) -> torch.Tensor:
    """Return the request's initial noise: given (``noise``), seeded (``seed``) or fresh."""
    shape = (spec.num_tokens, cfg.patch_latent_dim)
    if "noise" in data:
        noise = torch.as_tensor(np.asarray(data["noise"], dtype=np.float32))
        if tuple(noise.shape) != shape or not bool(torch.isfinite(noise).all()):
            raise ValueError(f"noise must be a finite array of shape {list(shape)}, got {list(noise.shape)}")
        return noise
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return torch.randn(shape, generator=generator)


def _hf_tokenizer(checkpoint: str) -> Any:
    """Return the checkpoint's Qwen2 tokenizer."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(checkpoint)
    except Exception as exc:
        raise CheckpointError(f"BAGEL checkpoint {checkpoint!r} has no usable tokenizer: {exc}") from None
