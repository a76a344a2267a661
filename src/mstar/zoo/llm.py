"""`llama`: any local Hugging Face Llama-architecture checkpoint as a one-partition model.

Graph: one KV-cache node ``llm``; walk ``prefill`` fires it once on the prompt (the first
token), walk ``decode`` is a `DynamicLoop` over it: the engine's decode loop, until a stop
token or ``max_tokens``. Every sampled token is emitted (modality ``text``) as its id, an
int; the serving layer detokenizes incrementally. The sequence's token history persists
from walk to walk, so ``decode`` may run on another rank than ``prefill`` (its cache is
rebuilt there).

Request: ``Request("generate", {"prompt": str} | {"messages": [...]} |
{"prompt_token_ids": [...]}, plus sampling keys: max_tokens, temperature, top_p, top_k,
repetition_penalty, seed, ignore_eos})``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.engines.kv_engine import KVCacheEngineConfig
from mstar.engines.kv_node import KVTurn
from mstar.engines.sampling_params import SamplingParams
from mstar.graph import EMIT, DynamicLoop, GraphEdge, GraphNode, ModelGraph
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request, SupportsTextOutput
from mstar.zoo.hf_checkpoint import load_hf_config
from mstar.zoo.llama import LlamaCausalLM, load_llama

__all__ = ["LlamaKVNode", "TextLLM", "history_turn", "make_llm_graph"]

_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed")


def make_llm_graph(name: str = "llama") -> ModelGraph:
    """Return the prefill/decode graph of a text LLM."""
    llm = GraphNode(
        "llm",
        {"history", "params"},
        [GraphEdge("llm", "history", persist=True), GraphEdge(EMIT, "tokens", modality="text")],
        signals={"stop"},
    )
    return ModelGraph(
        name=name,
        walks={"prefill": llm, "decode": DynamicLoop(llm, stop="stop")},
        partitions={"LLM": ["prefill", "decode"]},
        inputs={"llm": {"history", "params"}},
    )


class LlamaKVNode:
    """The ``llm`` node: a Llama on the paged KV cache, sampling per request."""

    def __init__(
        self,
        model: LlamaCausalLM,
        engine_config: KVCacheEngineConfig,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.model = model
        self.engine_config = engine_config
        self.eos_token_ids = eos_token_ids

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        """Generate what is left of ``max_tokens``; feed the history where the cache is empty."""
        return history_turn(inputs, is_first, () if inputs["params"].get("ignore_eos") else self.eos_token_ids)

    def outputs(self, request_id: str, token_id: int, history: list[int] | None) -> Mapping[str, Any]:
        """Emit the token; on the walk's last one raise ``stop`` and persist the history."""
        if history is None:
            return {"tokens": token_id, "stop": False}
        return {"tokens": token_id, "stop": True, "history": torch.tensor(history)}


def history_turn(
    inputs: Mapping[str, Any], is_first: bool, stop_token_ids: tuple[int, ...], **extra: Any
) -> KVTurn:
    """Return the turn of a token LLM node whose inputs are ``history`` and ``params``.

    ``params`` holds the sampling settings, ``max_tokens`` and ``prompt_len``; the history is
    the prompt plus every token generated so far, so the tokens left to generate and whether
    the last one was a stop token follow from it, on any rank.
    """
    params: dict[str, Any] = inputs["params"]
    history = [int(t) for t in inputs["history"]]
    generated = len(history) - int(params["prompt_len"])
    left = int(params["max_tokens"]) - generated
    sampling = SamplingParams(
        **{k: params[k] for k in _SAMPLING_KEYS if k in params and k != "max_tokens"},
        max_tokens=max(1, left),
        stop_token_ids=stop_token_ids,
    )
    is_done = left <= 0 or (generated > 0 and history[-1] in stop_token_ids)
    return KVTurn(history if is_first else [], sampling, is_done=is_done, **extra)


class TextLLM(Model, SupportsTextOutput):
    """A Llama-architecture checkpoint directory served as a text model."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        name: str = "llama",
        engine_config: Mapping[str, Any] | None = None,
        dtype: str | None = None,
    ) -> None:
        self.name = name
        self.checkpoint_dir = Path(checkpoint_dir)
        self.hf_config = load_hf_config(self.checkpoint_dir)
        self.engine_config = KVCacheEngineConfig(**dict(engine_config or {}))
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

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Return the checkpoint's end-of-sequence ids (config.json and the tokenizer)."""
        ids: set[int] = set()
        eos = self.hf_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

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
            load_llama(self.checkpoint_dir, device=device, dtype=self.dtype),
            self.engine_config,
            self.eos_token_ids,
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
            text = self.tokenizer.apply_chat_template(data["messages"], add_generation_prompt=True, tokenize=False)
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
        params = {"max_tokens": 16, **{k: data[k] for k in (*_SAMPLING_KEYS, "ignore_eos") if k in data}}
        max_tokens = params["max_tokens"]
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        SamplingParams(**{k: params[k] for k in _SAMPLING_KEYS if k in params})  # validates
        params["prompt_len"] = len(tokens)
        return PreparedRequest({"llm": {"history": torch.tensor(tokens), "params": params}})

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
