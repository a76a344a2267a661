"""`llama`: any local Hugging Face Llama-architecture checkpoint as a one-partition model.

Graph: one KV-cache node ``llm``; walk ``prefill`` fires it once on the prompt (the first
token), walk ``decode`` is a `DynamicLoop` over it: the engine's decode loop, until a stop
token or ``max_tokens``. Every sampled token is emitted (modality ``text``) as its id, an
int; the serving layer detokenizes incrementally. The sequence's token history persists
from walk to walk, so ``decode`` may run on another rank than ``prefill`` (its cache is
rebuilt there).

Request: ``Request("generate", {"prompt": str} | {"messages": [...]} |
{"prompt_token_ids": [...]}, plus sampling keys: max_tokens, temperature, top_p, top_k,
repetition_penalty, presence_penalty, frequency_penalty, seed, logprobs, ignore_eos})``.
Sampling keys the request leaves unset take the checkpoint's ``generation_config.json``
values (temperature, top_p, top_k, repetition_penalty), as in vLLM, else `SamplingParams`'
defaults. Without ``max_tokens`` the request generates up to `DEFAULT_MAX_TOKENS`, or less where the
model's length (`max_model_len`) ends first (the OpenAI routes send the rest of the length,
as vLLM does). With ``logprobs`` (0-20 alternatives) each emitted token
is a `TokenLogprobs` dict (``token_id``, ``logprob``, ``top_token_ids``, ``top_logprobs``)
instead of a bare id. Requests sending the same ``prefix_group`` (a string) and the same
prompt at once share the prompt's KV blocks (parallel samples of one prompt; with
``prefix_group_size``, how many they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.engines.interfaces import KVTurn
from mstar.engines.kv_engine import KVCacheEngineConfig
from mstar.engines.sampler import TokenLogprobs
from mstar.engines.sampling_params import SamplingParams
from mstar.errors import KVCacheCapacityError
from mstar.graph import EMIT, DynamicLoop, GraphEdge, GraphNode, ModelGraph
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request, SupportsTextOutput
from mstar.zoo.hf_checkpoint import (
    DTYPES,
    checkpoint_dtype,
    load_generation_defaults,
    load_hf_config,
)
from mstar.zoo.llama import LlamaCausalLM, load_llama

__all__ = ["DEFAULT_MAX_TOKENS", "LlamaKVNode", "TextLLM", "history_turn", "make_llm_graph"]

DEFAULT_MAX_TOKENS = 256
"""Tokens a request without ``max_tokens`` may generate (at most: the model's length may end
first)."""


def make_llm_graph(name: str = "llama") -> ModelGraph:
    """Return the prefill/decode graph of a text LLM.

    The ``llm`` node's inputs: ``history`` (the prompt, then every token so far), ``params``
    (the request's `SamplingParams`: ``max_tokens`` its whole budget, ``prompt_len`` set) and
    ``prefix_group`` (``[name, size]`` of a shared prefix, or None).
    """
    llm = GraphNode(
        "llm",
        {"history", "params", "prefix_group"},
        [GraphEdge("llm", "history", persist=True), GraphEdge(EMIT, "tokens", modality="text")],
        signals={"stop"},
    )
    return ModelGraph(
        name=name,
        walks={"prefill": llm, "decode": DynamicLoop(llm, stop="stop")},
        partitions={"LLM": ["prefill", "decode"]},
        inputs={"llm": {"history", "params", "prefix_group"}},
    )


class LlamaKVNode:
    """The ``llm`` node: a Llama on the paged KV cache, sampling per request."""

    def __init__(self, model: LlamaCausalLM, engine_config: KVCacheEngineConfig) -> None:
        self.model = model
        self.engine_config = engine_config

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        """Generate what is left of ``max_tokens``; feed the history where the cache is empty."""
        group, size = inputs["prefix_group"] or (None, 0)
        return history_turn(inputs, is_first, prefix_group=group, prefix_group_size=int(size))

    def outputs(
        self,
        request_id: str,
        token_id: int,
        history: list[int] | None,
        *,
        logprobs: TokenLogprobs | None = None,
    ) -> Mapping[str, Any]:
        """Emit the token (with its log-probabilities if asked); on the walk's last one raise
        ``stop`` and persist the history."""
        token: Any = token_id if logprobs is None else logprobs.to_dict()
        if history is None:
            return {"tokens": token, "stop": False}
        return {"tokens": token, "stop": True, "history": torch.tensor(history)}


def history_turn(inputs: Mapping[str, Any], is_first: bool, **extra: Any) -> KVTurn:
    """Return the turn of a token LLM node whose inputs are ``history`` and ``params``.

    ``params`` is the request's `SamplingParams` (``max_tokens`` its whole budget, ``prompt_len``
    set, its stop tokens); the history is the prompt plus every token generated so far, so the
    tokens left to generate and whether the last one was a stop token follow from it, on any rank.
    """
    params: SamplingParams = inputs["params"]
    raw = inputs["history"]
    # One call for a tensor (iterating it made a tensor per token: milliseconds per prompt)
    history = raw.tolist() if isinstance(raw, torch.Tensor) else [int(t) for t in raw]
    prompt_len = params.prompt_len if params.prompt_len is not None else len(history)
    generated = len(history) - prompt_len
    left = params.max_tokens - generated
    is_done = left <= 0 or (generated > 0 and history[-1] in params.stop_token_ids)
    return KVTurn(
        history if is_first else [],
        params.replace(max_tokens=max(1, left)),
        is_done=is_done,
        **extra,
    )


class TextLLM(Model, SupportsTextOutput):
    """A Llama-architecture checkpoint directory served as a text model.

    Args:
        checkpoint: The Hugging Face directory (``config.json``, safetensors, tokenizer).
        name: The model's name.
        engine_config: `KVCacheEngineConfig` fields.
        dtype: "float32", "bfloat16" or "float16"; "auto": the checkpoint's ``torch_dtype``;
            None: float32 on a CPU, the checkpoint's on CUDA.
    """

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        name: str = "llama",
        engine_config: Mapping[str, Any] | None = None,
        dtype: str | None = None,
    ) -> None:
        if dtype not in (None, "auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        self.name = name
        self.checkpoint_dir = Path(checkpoint)
        self.hf_config = load_hf_config(self.checkpoint_dir)
        # Sampling settings a request leaves unset come from the checkpoint, as in vLLM (an
        # instruct model answers gibberish at the API's temperature 1 that its authors never use).
        self.generation_defaults = load_generation_defaults(self.checkpoint_dir)
        self.engine_config = KVCacheEngineConfig(**dict(engine_config or {}))
        if dtype == "auto":
            dtype = checkpoint_dtype(self.hf_config)
        self.dtype = getattr(torch, dtype) if dtype else None
        self._graph = make_llm_graph(name)
        self.tokenizer: Any = None
        if (self.checkpoint_dir / "tokenizer.json").exists() or (
            self.checkpoint_dir / "tokenizer_config.json"
        ).exists():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(
                str(self.checkpoint_dir), local_files_only=True
            )
        self.chat_prompts = self.tokenizer is not None and self.tokenizer.chat_template is not None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Return the checkpoint's end-of-sequence ids (config.json and the tokenizer)."""
        ids: set[int] = set()
        eos = self.hf_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    @property
    def max_model_len(self) -> int:
        """Return the longest sequence (prompt and generated tokens) the model accepts.

        The checkpoint's `max_position_embeddings`, lowered by the engine config's
        `max_model_len` and, when the config sets `num_blocks`, the cache's size. A cache
        sized by memory may hold less: the engine checks that when the request arrives.
        """
        limits = [int(self.hf_config.get("max_position_embeddings", 2048))]
        config = self.engine_config
        if config.max_model_len is not None:
            limits.append(config.max_model_len)
        if config.num_blocks is not None:
            limits.append(config.num_blocks * config.block_size)
        return min(limits)

    def graph(self) -> ModelGraph:
        """Return the prefill/decode graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return KV_CACHE for the one node."""
        return {"llm": EngineType.KV_CACHE}

    def tasks(self) -> tuple[str, ...]:
        """Return the one task."""
        return ("generate",)

    def submodule(self, node: str, device: torch.device) -> LlamaKVNode:
        """Load the checkpoint onto ``device``."""
        return LlamaKVNode(
            load_llama(self.checkpoint_dir, device=device, dtype=self.dtype), self.engine_config
        )

    def preprocess(self, request: Request) -> PreparedRequest:
        """Tokenize the prompt (or apply the chat template) and collect sampling settings."""
        if request.task not in self.tasks():
            raise ValueError(f"task must be 'generate', got {request.task!r}")
        data = request.data
        if "prompt_token_ids" in data:
            tokens = [int(t) for t in data["prompt_token_ids"]]
        elif self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: send prompt_token_ids")
        elif "messages" in data:
            text = self.tokenizer.apply_chat_template(
                data["messages"], add_generation_prompt=True, tokenize=False
            )
            tokens = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        elif isinstance(data.get("prompt"), str):
            tokens = list(self.tokenizer(data["prompt"])["input_ids"])
        else:
            raise ValueError("send one of prompt (string), messages (chat) or prompt_token_ids")
        if not tokens:
            raise ValueError("the prompt is empty")
        vocab = int(self.hf_config["vocab_size"])
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        limit = self.max_model_len
        if len(tokens) >= limit:
            raise KVCacheCapacityError(
                f"the prompt has {len(tokens)} tokens but the model's length is {limit}: shorten it"
            )
        params = request.params.with_defaults(self.generation_defaults)
        max_tokens = (
            params.max_tokens
            if params.max_tokens is not None
            else min(DEFAULT_MAX_TOKENS, limit - len(tokens))
        )
        if len(tokens) + max_tokens > limit:
            raise KVCacheCapacityError(
                f"the request needs up to {len(tokens) + max_tokens} tokens ({len(tokens)} "
                "in the prompt + "
                f"max_tokens {max_tokens}) but the model's length is {limit}: lower "
                "max_tokens to at most "
                f"{limit - len(tokens)}"
            )
        sampling = params.sampling(
            max_tokens=max_tokens, stop_token_ids=self.eos_token_ids, prompt_len=len(tokens)
        )
        group = (
            None if params.prefix_group is None else [params.prefix_group, params.prefix_group_size]
        )
        return PreparedRequest(
            {"llm": {"history": torch.tensor(tokens), "params": sampling, "prefix_group": group}}
        )

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Start with prefill."""
        return "prefill"

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Decode after prefill, then stop."""
        return "decode" if finished == "prefill" else None

    def detokenize(self, token_ids: list[int]) -> str:
        """Return the text of token ids (empty without a tokenizer)."""
        return (
            ""
            if self.tokenizer is None
            else str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
        )
