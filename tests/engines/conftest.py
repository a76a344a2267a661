"""Factories for KV-cache engine tests: tiny random Llama models."""

from __future__ import annotations

import pytest
import torch

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
