"""Factories for KV-cache engine tests: tiny random Llama models and a token node over them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.engines.interfaces import KVTurn
from mstar.zoo.llama import LlamaCausalLM, LlamaConfig


def make_tiny_llama(
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position: int = 256,
    std: float = 0.3,
) -> LlamaCausalLM:
    """Build a tiny Llama with peaky random weights (so greedy picks are not near-ties)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model.to(dtype).eval()


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaCausalLM:
    """Return a float32 tiny Llama (shared, read-only)."""
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_llama64() -> LlamaCausalLM:
    """Return a float64 tiny Llama: batching cannot flip its greedy choices."""
    return make_tiny_llama(dtype=torch.float64)


def run_join_leave_schedule(
    engine: KVCacheEngine,
) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Greedy requests joining at steps 0, 3, 7 and 12, one aborted at step 9; return each
    request's tokens and per-step logits (the engine must return logits)."""
    schedule = {0: ["a", "b"], 3: ["c"], 7: ["d", "e"], 12: ["f"]}
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for step in range(300):
        for name in schedule.get(step, []):
            prompt = [(ord(name) * 7 + i) % 64 for i in range(5 + ord(name) % 7)]
            engine.add_request(name, prompt, SamplingParams.greedy(14))
        if step == 9:
            engine.abort("c")
        for out in engine.step():
            assert out.logits is not None
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logits.setdefault(out.request_id, []).append(out.logits.float())
        if not engine.has_unfinished() and step > 12:
            break
    return tokens, logits


class GroupNode:
    """A token node: prompt tokens and sampling from the inputs, the group from ``group``."""

    def __init__(self, model: LlamaCausalLM, num_blocks: int = 64) -> None:
        self.model = model
        self.engine_config = KVCacheEngineConfig(block_size=4, num_blocks=num_blocks)

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        return KVTurn(
            list(inputs["prompt"]) if is_first else [],
            inputs["params"],
            prefix_group=inputs.get("group"),
        )

    def outputs(
        self, request_id: str, token_id: int, history: list[int] | None, **extra: Any
    ) -> Mapping[str, Any]:
        return {"token": token_id, "logprobs": extra.get("logprobs"), "done": history is not None}
