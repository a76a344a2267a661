"""CUDA-only checks: FlashInfer against the torch reference, CUDA-graph decode against eager."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from mstar.engines import AttentionMask, KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.engines.attention import AttentionMetadata, TorchPagedAttention

from .conftest import make_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer (the cuda extra)"
)


def _metadata(
    q_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int, masked: bool
) -> AttentionMetadata:
    gen = np.random.default_rng(0)
    perm = gen.permutation(num_blocks)
    tables: list[list[int]] = []
    slots: list[int] = []
    limits: list[int] = []
    used = 0
    for q_len, kv_len in zip(q_lens, seq_lens, strict=True):
        n = -(-kv_len // block_size)
        table = perm[used : used + n].tolist()
        used += n
        tables.append(table)
        for p in range(kv_len - q_len, kv_len):
            slots.append(table[p // block_size] * block_size + p % block_size)
            # Block-causal in 3-token frames over the chunk when masked, else causal.
            limits.append(min((p // 3 + 1) * 3, kv_len) if masked and q_len > 1 else p + 1)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return AttentionMetadata(
        num_tokens=int(starts[-1]),
        slot_mapping=torch.tensor(slots, device="cuda"),
        query_start_loc=starts,
        seq_lens=np.array(seq_lens, dtype=np.int64),
        block_tables=tables,
        kv_limits=np.array(limits, dtype=np.int64) if masked else None,
        block_size=block_size,
    )


@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "masked"),
    [
        ([1, 1, 1, 1], [5, 17, 33, 64], False),  # decode wrapper
        ([7, 1, 12, 1], [7, 20, 30, 9], False),  # mixed prefill (with context) and decode
        ([9, 1, 6], [9, 14, 12], True),  # block-causal custom mask
    ],
    ids=["decode", "mixed-causal", "block-causal"],
)
def test_flashinfer_matches_torch_backend(
    dtype: torch.dtype, q_lens: list[int], seq_lens: list[int], masked: bool
) -> None:
    from mstar.engines.attention.flashinfer_backend import FlashInferAttention

    block_size, num_blocks, heads, kv_heads, dim = 16, 64, 8, 2, 64
    torch.manual_seed(0)
    k_cache = torch.randn(num_blocks + 1, block_size, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    meta = _metadata(q_lens, seq_lens, block_size, num_blocks, masked)
    q = torch.randn(meta.num_tokens, heads, dim, device="cuda", dtype=dtype)
    k = torch.randn(meta.num_tokens, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    outs = []
    for backend in (TorchPagedAttention("cuda"), FlashInferAttention("cuda")):
        caches = (k_cache.clone(), v_cache.clone())
        backend.plan(meta)
        outs.append(backend.forward(q, k, v, caches, dim**-0.5).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


def _generate(engine: KVCacheEngine, prompts: list[list[int]]) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams.greedy(max_tokens=32))


@pytest.mark.parametrize("batch_size", [1, 3, 16, 21])
def test_cuda_graph_decode_matches_eager_and_cpu(batch_size: int) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    prompts = [torch.randint(0, 64, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 20, (batch_size,), generator=gen)]
    cpu = make_tiny_llama()
    expected = _generate(KVCacheEngine(cpu, KVCacheEngineConfig(num_blocks=128)), prompts)
    model = make_tiny_llama().cuda()
    for graphs in (False, True):
        config = KVCacheEngineConfig(
            num_blocks=128, max_num_seqs=24, attention_backend="torch", cuda_graphs=graphs
        )
        engine = KVCacheEngine(model, config, device="cuda")
        assert (engine.runner.cuda_graphs is not None) == graphs
        assert _generate(engine, prompts) == expected


@needs_flashinfer
def test_engine_on_flashinfer_matches_cpu_reference() -> None:
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 4], [7] * 30]
    cpu = make_tiny_llama()
    expected = _generate(KVCacheEngine(cpu, KVCacheEngineConfig(num_blocks=128)), prompts)
    model = make_tiny_llama().cuda()
    engine = KVCacheEngine(
        model, KVCacheEngineConfig(num_blocks=128, attention_backend="flashinfer"), device="cuda"
    )
    assert _generate(engine, prompts) == expected
    engine.add_request("m", [5, 3, 8, 1, 9, 2], SamplingParams.greedy(4), mask=AttentionMask.full())
    while engine.has_unfinished():
        engine.step()
