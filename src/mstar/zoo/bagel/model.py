"""BAGEL as an mstar model: prefills into one paged cache, then a flow loop with CFG branches, or
decoding.

One partition, ``bagel``. Walks::

    prefill_text  llm                              the next text item -> every context that takes it
    prefill_vit   Sequential[vit, llm_vit]         an image's ViT tokens (understanding weights,
    full mask)
    prefill_vae   Sequential[vae_encoder, llm_vae] an image's VAE tokens (generation weights, full
    mask)
    decode        DynamicLoop(llm)                 greedy text until <|im_end|> (the engine's decode
    loop)
    image_gen     Sequential[
                    DynamicLoop(Sequential[
                      Parallel[denoise, denoise_cfg_text, denoise_cfg_img],   read-only queries,
                      each
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
``max_tokens`` (``understand``), ``think`` and ``max_think_tokens``, ``skip_branches`` (false: every
CFG branch on every step, which benchmarks what skipping saves; the image is the same),
``vae_posterior`` (an edit's input image latent: ``"sample"``, upstream's draw from the VAE
posterior and the default, or ``"mean"``). A request draws its random values from one
generator seeded by ``seed`` (fresh without one), in upstream's order: each input image's
posterior sample, then the flow's initial noise (unless ``noise`` gives it).
``guidance_scale`` (the images routes' field) is the text scale, or ``[text, image]``; a
multipart edit form sends one number, the text scale (the image scale keeps its default). An
edit's ``width``/``height`` (the route's ``size``) must be the input's size after resizing, or
absent.
Answers (``understand``, ``generate``) are greedy unless ``temperature``, ``top_p``, ``top_k``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` or ``seed`` say otherwise;
with ``logprobs`` (0-20 alternatives) each answer token is emitted as a `TokenLogprobs` dict, as
the ``llama`` model emits it; ``ignore_eos`` is refused.

Think mode (``think: true``) puts the planning instruction first, as a text item. Before an
image the request then decodes a planning text (``decode``: its tokens stream as text) and
prefills it into the full context alone (``prefill_text``, over the decode's own tokens, rolled
back), as upstream's ``interleave_inference`` does; understanding just answers after it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from msgspec import Meta
from PIL import Image

from mstar.engines.parallel import TensorShard, current_shard
from mstar.errors import CheckpointError, InvalidRequestError
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
    SupportsTextOutput,
)
from mstar.runtime.params import GenerationParams, TaskOptions
from mstar.zoo.bagel.checkpoint import (
    LLM_CONFIG,
    LLM_PARTS,
    PARTS,
    VIT_PARTS,
    cached_random_checkpoint,
    check_tokens,
    config_from_checkpoint,
    load_bagel,
)
from mstar.zoo.bagel.checkpoint_files import read_json
from mstar.zoo.bagel.config import BagelConfig, get_bagel_config
from mstar.zoo.bagel.context import ContextState, ImageItem, Item, Parts, TextItem
from mstar.zoo.bagel.flow import BRANCHES, COND, FlowSpec
from mstar.zoo.bagel.llm_node import LLMNode
from mstar.zoo.bagel.nodes import (
    CombineNode,
    Segments,
    VaeDecoderNode,
    VaeEncoderNode,
    VitNode,
    initial_flow,
    parts_input,
    queries,
    query_input,
    velocity_output,
)
from mstar.zoo.bagel.tokenizer import (
    ByteTokenizer,
    has_tokenizer,
    load_tokenizer,
    special_tokens_of,
)
from mstar.zoo.bagel.vae import FluxVAE
from mstar.zoo.bagel.vision import image_tensor, resize_for
from mstar.zoo.bagel.weights import BagelWeights
from mstar.zoo.requests import initial_noise

__all__ = ["PARTITION", "BagelModel", "BagelPlan", "denoise_node", "make_bagel_graph"]

PARTITION = "bagel"
# Think mode's system prompts (upstream's planning instructions; data, not code).
GEN_THINK_PROMPT = (
    "You should first think about the planning process in the mind and then generate the image. \n"
    "The planning process is enclosed within <think> </think> tags, i.e. <think> planning "
    "process here </think> image here"
)
VLM_THINK_PROMPT = (
    "You should first think about the reasoning process in the mind and then provide the "
    "user with the answer. \n"
    "The reasoning process is enclosed within <think> </think> tags, i.e. <think> reasoning "
    "process here </think> answer here"
)
MAX_TIMESTEPS = 1000
TASKS = ("image", "image_edit", "understand", "generate")
# float64 runs the parity checks where one rounding step apart would flip a pixel.
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def denoise_node(branch: str) -> str:
    """Return the node of a CFG branch."""
    return "denoise" if branch == COND else f"denoise_{branch}"


_PREFILLS = ("llm", "llm_vit", "llm_vae")
LLM_NODES = (*_PREFILLS, *(denoise_node(b) for b in BRANCHES))
_CONTEXT_READERS = (*LLM_NODES, "vit", "vae_encoder")
NODE_PARTS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(LLM_NODES, LLM_PARTS),
    "vit": VIT_PARTS,
    "vae_encoder": ("vae",),
    "vae_decoder": ("vae",),
    "cfg_combine": (),
}
"""The weights (`mstar.zoo.bagel.checkpoint.PARTS`) each node reads."""
# Who gets which context inputs (the large values: ViT embeddings, latents): the prefills
# the full ones, to append to; each branch its own context's, to rebuild it on a rank of its own.
_PARTS_READERS = {parts_input(b): [denoise_node(b)] for b in BRANCHES}
_PARTS_READERS[parts_input(COND)] = [*_PREFILLS, denoise_node(COND)]


def make_bagel_graph(config: BagelConfig) -> ModelGraph:
    """Return the graph and walks of a BAGEL model."""
    context = [GraphEdge(dst, "context", persist=True) for dst in _CONTEXT_READERS]
    context += [
        GraphEdge(dst, name, persist=True) for name, dsts in _PARTS_READERS.items() for dst in dsts
    ]
    llm = GraphNode(
        "llm",
        {"segments", "context", "parts"},
        [*context, GraphEdge(EMIT, "token", modality="text")],
        signals={"stop"},
    )
    vit = GraphNode("vit", {"segments", "context"}, [GraphEdge("llm_vit", "vit_embeds")])
    vae_encoder = GraphNode(
        "vae_encoder", {"segments", "context"}, [GraphEdge("llm_vae", "vae_latents")]
    )
    llm_vit = GraphNode("llm_vit", {"vit_embeds", "context", "parts"}, context)
    llm_vae = GraphNode("llm_vae", {"vae_latents", "context", "parts"}, context)
    denoise = [
        GraphNode(
            denoise_node(b),
            {query_input(b), "context", parts_input(b)},
            [GraphEdge("cfg_combine", velocity_output(b))],
        )
        for b in BRANCHES
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
    vae_decoder = GraphNode(
        "vae_decoder", {"latents", "flow"}, [GraphEdge(EMIT, "image", modality="image")]
    )
    flow = DynamicLoop(
        Sequential([Parallel(denoise), combine]), max_iters=MAX_TIMESTEPS - 1, stop="done"
    )
    walks: dict[str, Section] = {
        "prefill_text": llm,
        "prefill_vit": Sequential([vit, llm_vit]),
        "prefill_vae": Sequential([vae_encoder, llm_vae]),
        "decode": DynamicLoop(llm, max_iters=config.max_text_tokens, stop="stop"),
        "image_gen": Sequential([flow, vae_decoder]),
    }
    inputs: dict[str, set[str]] = {n: {"context"} for n in _CONTEXT_READERS}
    for name, dsts in _PARTS_READERS.items():
        for dst in dsts:
            inputs[dst].add(name)
    for name in ("llm", "vit", "vae_encoder"):
        inputs[name].add("segments")
    for b in BRANCHES:
        inputs[denoise_node(b)].add(query_input(b))
    inputs["cfg_combine"] = {"flow"}
    return ModelGraph(
        walks=walks, partitions={PARTITION: list(walks)}, inputs=inputs, name=config.name
    )


@dataclass
class BagelPlan:
    """A request's walks, in order, and how far it got."""

    walks: list[str]
    index: int = 0
    task: str = "image"
    spec: FlowSpec | None = None
    items: list[Item] = field(default_factory=list)
    is_think: bool = False


class BagelModel(Model, SupportsSharedEngines, SupportsTextOutput):
    """BAGEL (``bagel-7b-mot``, ``bagel-small``, ``bagel-tiny``, or a checkpoint's own sizes).

    Args:
        config: A config name, a `BagelConfig` (custom sizes), or None: the config of
            ``checkpoint``'s own files (`config_from_checkpoint`), named after it.
        checkpoint: A directory in the published layout; without one a config gets random
            weights, written once under the mstar cache (``bagel-7b-mot`` needs one). Its
            Qwen2 tokenizer files, where it has them, are the tokenizer; else the toy one.
        dtype: "float32", "bfloat16", "float16", "float64", or "auto": the checkpoint's
            ``torch_dtype`` (``llm_config.json``), else float32. None: float32.
        seed: Seed of the random weights.

    Raises:
        CheckpointError: ``config`` None without a checkpoint; a checkpoint that does not
            fit its config, or whose tokenizer's special ids disagree with it.
    """

    def __init__(
        self,
        config: str | BagelConfig | None = "bagel-tiny",
        *,
        checkpoint: str | None = None,
        dtype: str | None = "float32",
        seed: int = 0,
    ) -> None:
        if dtype is not None and dtype != "auto" and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
        if config is None:
            if checkpoint is None:
                raise CheckpointError(
                    "BAGEL with config=None reads its config from checkpoint=, a directory "
                    "in the published layout"
                )
            cfg = config_from_checkpoint(checkpoint)
        else:
            cfg = get_bagel_config(config) if isinstance(config, str) else config
        if checkpoint is None:
            if cfg.name == "bagel-7b-mot":
                raise CheckpointError(
                    "bagel-7b-mot needs checkpoint= a directory in the published layout"
                )
            checkpoint = str(cached_random_checkpoint(cfg, seed=seed))
        self.name = cfg.name
        self.config = cfg
        self.checkpoint = str(Path(checkpoint))
        if dtype == "auto":  # the checkpoint's own dtype, where it names one mstar runs
            raw = read_json(Path(checkpoint), LLM_CONFIG)
            named = raw.get("torch_dtype") or raw.get("dtype") or cfg.llm.torch_dtype
            dtype = named if named in _DTYPES else None
        self.dtype = _DTYPES[dtype or "float32"]
        self.tokenizer: Any = self._tokenizer()
        # The byte tokenizer of random checkpoints takes raw prompts.
        self.chat_prompts = (
            not isinstance(self.tokenizer, ByteTokenizer)
            and self.tokenizer.chat_template is not None
        )
        self._graph = make_bagel_graph(cfg)
        # by device and tensor-parallel shard (`sharded`): each rank of a group its own
        self._loaded: dict[
            tuple[torch.device, TensorShard | None], tuple[BagelWeights, FluxVAE]
        ] = {}
        self._loading = threading.Lock()

    def _tokenizer(self) -> Any:
        """Return the checkpoint's Qwen2 tokenizer (its special ids checked against the config), or
        the toy one."""
        cfg = self.config
        if not has_tokenizer(self.checkpoint):
            if cfg.name == "bagel-7b-mot":
                raise CheckpointError(
                    f"BAGEL checkpoint {self.checkpoint!r} has no tokenizer: bagel-7b-mot "
                    "needs Qwen2's "
                    "vocab.json + merges.txt (+ tokenizer_config.json), or tokenizer.json"
                )
            return ByteTokenizer(cfg.tokens)
        tokenizer = load_tokenizer(self.checkpoint)
        tokens = special_tokens_of(tokenizer)
        check_tokens(Path(self.checkpoint), tokens, cfg.llm.vocab_size)
        if tokens != cfg.tokens:
            raise CheckpointError(
                f"BAGEL checkpoint {self.checkpoint!r}: its tokenizer's special ids {tokens} "
                "differ from config "
                f"{cfg.name!r}'s {cfg.tokens} (serve it with config=None to read them from "
                "the tokenizer)"
            )
        return tokenizer

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
        """Every LLM node runs on ``llm``'s engine: one paged cache for all contexts of a
        request."""
        return {n: "llm" for n in LLM_NODES if n != "llm"}

    def tasks(self) -> tuple[str, ...]:
        """Return the tasks."""
        return TASKS

    def task_options(self, task: str) -> type[BagelOptions]:
        """Every task takes `BagelOptions` (the flow's only where an image is drawn)."""
        return BagelOptions

    def load(
        self, device: torch.device, nodes: Iterable[str] | None = None
    ) -> tuple[BagelWeights, FluxVAE]:
        """Load the weights ``nodes`` read onto ``device`` (default: every node's).

        Every node of a rank shares one copy; each call reads only the parts not loaded there
        yet (`NODE_PARTS`), and what no node there reads stays on the meta device. Under
        `mstar.engines.parallel.sharded` (a tensor-parallel rank's LLM) the copy is that shard's
        own: ranks of one process keep weights of their own.
        """
        parts = (
            PARTS
            if nodes is None
            else tuple(dict.fromkeys(p for n in nodes for p in NODE_PARTS[n]))
        )
        key = (device, current_shard())
        with self._loading:  # ranks in one process build their engines on threads of their own
            loaded = self._loaded.get(key)
            needs_llm = loaded is None or loaded[0].vae2llm.weight.is_meta
            weights, vae = load_bagel(
                self.checkpoint,
                self.config,
                device=device,
                dtype=self.dtype,
                parts=parts,
                into=loaded,
            )
            if needs_llm and "language_model" in parts:
                weights.fuse_for_inference()
            self._loaded[key] = weights, vae
            return weights, vae

    def submodule(self, node: str, device: torch.device) -> Any:
        """Return a node's computation on ``device``.

        A CFG branch node asked for here runs on an engine of its own (it is placed away
        from ``llm``): that engine builds the branch's context itself.
        """
        if node not in NODE_PARTS:
            raise KeyError(node)
        weights, vae = self.load(device, [node])
        if node in LLM_NODES:
            branch = next((b for b in BRANCHES if denoise_node(b) == node), None)
            return LLMNode(weights, branch=branch)
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

    # -- text output (SupportsTextOutput) ----------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Return ``<|im_end|>``, which ends an answer."""
        return (self.config.tokens.eos,)

    def detokenize(self, token_ids: list[int]) -> str:
        """Return the text of token ids."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    # -- requests ----------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """Return a prompt's ids (bytes for the small configs' toy vocabulary)."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _wrap(self, ids: list[int]) -> TextItem:
        tokens = self.config.tokens
        return TextItem(torch.tensor([tokens.bos, *ids, tokens.eos], dtype=torch.long))

    def _ids(self, value: Any, name: str) -> list[int]:
        vocab = self.config.llm.vocab_size
        if not isinstance(value, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise ValueError(f"{name} must be a list of token ids")
        if any(not 0 <= t < vocab for t in value):
            raise ValueError(f"{name} must be in [0, {vocab})")
        return [int(t) for t in value]

    def _text_item(self, data: Mapping[str, Any]) -> TextItem:
        if "token_ids" in data:
            ids = self._ids(data["token_ids"], "token_ids")
        elif isinstance(data.get("prompt", data.get("text")), str):
            ids = self.tokenize(data.get("prompt", data.get("text")))
        else:
            raise ValueError("a prompt is needed: 'prompt' (text) or 'token_ids'")
        if len(ids) > self.config.max_text_tokens:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; at most {self.config.max_text_tokens}"
            )
        return self._wrap(ids)

    def _image(self, data: Mapping[str, Any]) -> Image.Image:
        if "images" in data and "image" not in data:
            images = data["images"]
            if not isinstance(images, list | tuple) or len(images) != 1:
                count = len(images) if isinstance(images, list | tuple) else "no list of"
                raise ValueError(f"images: BAGEL edits one image at a time, got {count} images")
            return _as_image(images[0], "images[0]")
        if "image" not in data:
            raise ValueError("image is required: the image to edit or to answer about")
        return _as_image(data["image"], "image")

    def _chat_items(self, data: Mapping[str, Any]) -> list[Item]:
        """Return the items of a chat (``generate``): each message's images and text, in order.

        ``prompt_token_ids`` (a chat rendered by the tokenizer's template) are one text item as they
        are.
        """
        cfg = self.config
        if "messages" not in data:
            if "prompt_token_ids" not in data:
                return [self._text_item(data)]
            return [
                TextItem(
                    torch.tensor(
                        self._ids(data["prompt_token_ids"], "prompt_token_ids"), dtype=torch.long
                    )
                )
            ]
        items: list[Item] = []
        messages = data["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, Mapping) else None
            parts = (
                [{"type": "text", "text": content}]
                if isinstance(content, str) or content is None
                else content
            )
            texts: list[str] = []
            for j, part in enumerate(parts):
                if part.get("type") == "image":
                    image = resize_for(
                        _as_image(part.get("image"), f"messages.{i}.content.{j}"), cfg.vae_image
                    )
                    items.append(ImageItem(None, image_tensor(resize_for(image, cfg.vit_image))))
                elif isinstance(part.get("text"), str):
                    texts.append(part["text"])
            if any(texts):
                items.append(self._wrap(self.tokenize("".join(texts))))
        if not items:
            raise ValueError("messages hold no text and no image")
        return items

    def preprocess(self, request: Request) -> PreparedRequest:
        """Make the request's items, its walks, its flow spec and noise.

        Raises:
            ValueError: An unknown task or a bad field (the message names it).
        """
        if request.task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {request.task!r}")
        cfg, data, options = self.config, request.data, request.options_as(BagelOptions)
        answers = request.task in ("understand", "generate")
        generator = _generator(request.params.seed)
        items: list[Item] = []
        # the planning instruction comes first, as a text item of every context that takes text
        if options.think:
            items.append(
                self._wrap(self.tokenize(VLM_THINK_PROMPT if answers else GEN_THINK_PROMPT))
            )
        if request.task == "generate":
            items.extend(self._chat_items(data))
            return self._prepare(request, items, None, answers=True)
        text = self._text_item(data)
        if request.task == "image":
            height = cfg.image_size[0] if options.height is None else options.height
            width = cfg.image_size[1] if options.width is None else options.width
            for name, side in (("height", height), ("width", width)):
                if side % cfg.latent_downsample or not 0 < side <= cfg.max_image_side:
                    raise ValueError(
                        f"{name} must be a multiple of {cfg.latent_downsample} in (0, "
                        f"{cfg.max_image_side}], got {side}"
                    )
        else:
            image = resize_for(self._image(data), cfg.vae_image)
            width, height = image.size
            if request.task == "image_edit" and (
                options.width is not None or options.height is not None
            ):
                asked = options.width or width, options.height or height
                if asked != (width, height):
                    raise ValueError(
                        f"size: an edit keeps the input's size, {width}x{height} here (after "
                        "resizing), "
                        f"not {asked[0]}x{asked[1]}: omit size or send 'auto'"
                    )
            vit = image_tensor(resize_for(image, cfg.vit_image))
            if request.task == "image_edit":
                vae = image_tensor(image)
                noise = None
                # upstream draws it as it encodes the image, before the flow's noise
                if options.vae_posterior == "sample":
                    latent = (
                        cfg.vae.z_channels,
                        height // cfg.vae.downsample,
                        width // cfg.vae.downsample,
                    )
                    noise = torch.randn(latent, generator=generator)
                items.append(ImageItem(vae, vit, noise))
            else:
                items.append(ImageItem(None, vit))
        items.append(text)
        down = cfg.latent_downsample
        spec = (
            None
            if answers
            else _flow_spec(cfg, request.task, height // down, width // down, options)
        )
        return self._prepare(request, items, spec, answers=answers, generator=generator)

    def _prepare(
        self,
        request: Request,
        items: list[Item],
        spec: FlowSpec | None,
        *,
        answers: bool,
        generator: torch.Generator | None = None,
    ) -> PreparedRequest:
        """Make a request's walks and inputs from its items (and the flow of an image)."""
        cfg, data, params = self.config, request.data, request.params
        options = request.options_as(BagelOptions)
        walks = [w for item in items for w in _prefill_walks(item)]
        walks.append("decode" if answers else "image_gen")
        max_tokens = 0
        # a chat: as long as the route allows, up to the model's limit
        if request.task == "generate":
            max_tokens = min(params.max_tokens or cfg.max_text_tokens, cfg.max_text_tokens)
        elif answers:
            max_tokens = _at_most(params.max_tokens, cfg.max_text_tokens, "max_tokens")
        is_think = options.think and not answers
        if is_think:  # the planning text is decoded before the image
            max_tokens = _at_most(options.max_think_tokens, cfg.max_text_tokens, "max_think_tokens")
            walks[-1:] = ["decode", "prefill_text", "image_gen"]
        sampling = _sampling(params) if answers else ()
        segments = Segments(tuple(items), max_tokens, is_think, sampling)
        inputs: dict[str, dict[str, Any]] = {
            n: {"context": ContextState()} for n in _CONTEXT_READERS
        }
        for name, dsts in _PARTS_READERS.items():
            for dst in dsts:
                inputs[dst][name] = Parts()
        for name in ("llm", "vit", "vae_encoder"):
            inputs[name]["segments"] = segments
        flow = None
        if spec is not None:
            shape = (spec.num_tokens, cfg.patch_latent_dim)
            noise = (
                initial_noise(data, shape, params.seed)
                if "noise" in data or generator is None
                else torch.randn(shape, generator=generator)
            )
            flow = initial_flow(spec, noise)
        first = queries(flow) if flow is not None else dict.fromkeys(map(query_input, BRANCHES))
        for b in BRANCHES:
            inputs[denoise_node(b)][query_input(b)] = first[query_input(b)]
        inputs["cfg_combine"] = {"flow": flow}
        return PreparedRequest(
            inputs, BagelPlan(walks, task=request.task, spec=spec, items=items, is_think=is_think)
        )

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
        """Pass values on: PNG bytes (``image``), token ids (``token``), latent tokens
        (``latents``)."""
        return Output(
            request_id,
            emission.modality,
            emission.name,
            emission.value,
            emission.node,
            emission.walk,
        )


def _as_image(value: Any, name: str) -> Image.Image:
    """Return an input image as RGB: a PIL image, encoded bytes, or a uint8 array (grey, RGB or
    RGBA)."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, bytes | bytearray):
        try:
            return Image.open(BytesIO(value)).convert("RGB")
        except Exception as exc:
            raise ValueError(f"{name} is not an image: {exc}") from None
    if isinstance(value, torch.Tensor):
        value = value.numpy()
    if (
        isinstance(value, np.ndarray)
        and value.dtype == np.uint8
        and (value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (1, 3, 4)))
    ):
        return Image.fromarray(
            value[:, :, 0] if value.ndim == 3 and value.shape[2] == 1 else value
        ).convert("RGB")
    raise ValueError(
        f"{name} must be a PIL image, encoded image bytes or an H x W (x 3 or 4) uint8 array"
    )


def _generator(seed: int | None) -> torch.Generator:
    """Return the request's generator: seeded by ``seed`` (as `initial_noise` reads it), else
    fresh."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def _at_most(value: int | None, high: int, name: str) -> int:
    """Return ``value`` (``high`` when not given), refusing one above ``high`` (the model's text
    limit)."""
    if value is None:
        return high
    if value > high:
        raise InvalidRequestError(
            f"{name}: at most {high} with this model, got {value}", param=name
        )
    return value


_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
)


def _sampling(params: GenerationParams) -> tuple[tuple[str, float | int], ...]:
    """Return an answer's sampling settings (none given: greedy)."""
    if params.ignore_eos:
        raise InvalidRequestError(
            "ignore_eos: BAGEL's answers do not support it (omit ignore_eos)", param="ignore_eos"
        )
    return tuple(
        (name, value) for name in _SAMPLING if (value := getattr(params, name)) is not None
    )


def _prefill_walks(item: Item) -> list[str]:
    if isinstance(item, TextItem):
        return ["prefill_text"]
    return (["prefill_vae"] if item.vae is not None else []) + (
        ["prefill_vit"] if item.vit is not None else []
    )


Scale = Annotated[float, Meta(ge=0.0)]


class BagelOptions(TaskOptions, frozen=True, kw_only=True):
    """What a BAGEL request takes beyond `GenerationParams` (the flow's options where it draws).

    Attributes:
        think: Plan in text first (decoded before the image, or before the answer).
        max_think_tokens: The plan's length at most (default: the model's text limit).
        height: A drawn image's height (a multiple of the latent downsampling).
        width: Its width.
        vae_posterior: An edit's input latent: upstream's draw from the VAE posterior
            (``"sample"``, seeded by the request), or its ``"mean"``.
        timestep_shift: The flow schedule's shift.
        cfg_text_scale: Text guidance.
        cfg_img_scale: Image guidance.
        cfg_renorm_min: The guidance renormalization's floor.
        guidance_scale: The images routes' name for the scales: the text's, or [text, image].
        num_timesteps: Flow steps.
        cfg_interval: The part [low, high] of the schedule that guidance applies to.
        skip_branches: False runs every CFG branch on every step (what skipping saves).
        cfg_renorm_type: How guidance is renormalized.
    """

    think: bool = False
    max_think_tokens: Annotated[int, Meta(ge=1)] | None = None
    height: Annotated[int, Meta(gt=0)] | None = None
    width: Annotated[int, Meta(gt=0)] | None = None
    vae_posterior: Literal["sample", "mean"] = "sample"
    timestep_shift: Scale | None = None
    cfg_text_scale: Scale | None = None
    cfg_img_scale: Scale | None = None
    cfg_renorm_min: Scale | None = None
    guidance_scale: Scale | Annotated[list[Scale], Meta(min_length=1, max_length=2)] | None = None
    num_timesteps: Annotated[int, Meta(ge=2, le=MAX_TIMESTEPS)] | None = None
    cfg_interval: tuple[float, float] | None = None
    skip_branches: bool | None = None
    cfg_renorm_type: Literal["global", "channel", "text_channel"] | None = None

    def __post_init__(self) -> None:
        given = (
            self.guidance_scale if isinstance(self.guidance_scale, list) else [self.guidance_scale]
        )
        others = [
            getattr(self, name)
            for name in ("timestep_shift", "cfg_text_scale", "cfg_img_scale", "cfg_renorm_min")
        ]
        if any(
            v is not None and not math.isfinite(v)
            for v in [*given, *others, *(self.cfg_interval or ())]
        ):
            raise ValueError("scales, shifts and intervals must be finite numbers")


_FLOW_FIELDS = (
    "timestep_shift",
    "cfg_text_scale",
    "cfg_img_scale",
    "cfg_renorm_min",
    "num_timesteps",
    "cfg_renorm_type",
)


def _flow_spec(
    cfg: BagelConfig, task: str, height: int, width: int, options: BagelOptions
) -> FlowSpec:
    overrides: dict[str, Any] = {
        name: value for name in _FLOW_FIELDS if (value := getattr(options, name)) is not None
    }
    # the images routes' field: the text scale, or [text, image]
    if options.guidance_scale is not None:
        scales = (
            options.guidance_scale
            if isinstance(options.guidance_scale, list)
            else [options.guidance_scale]
        )
        overrides |= dict(zip(("cfg_text_scale", "cfg_img_scale"), scales, strict=False))
    if options.cfg_interval is not None:
        overrides["cfg_interval"] = options.cfg_interval
    # False: every branch on every step (benchmarks what skipping saves)
    if options.skip_branches is not None:
        overrides["run_all_branches"] = not options.skip_branches
    return FlowSpec.of(height, width, cfg.t2i if task == "image" else cfg.edit, **overrides)
