"""CUDA-only checks: FlashInfer against the torch reference, CUDA-graph decode against eager."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from mstar.engines import AttentionMask, KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.engines.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention

from .conftest import make_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer (the cuda extra)"
)


def _limits(pattern: str, kv_len: int, q_len: int) -> list[int]:
    """Return the key limits of a chunk's queries (positions `kv_len - q_len .. kv_len - 1`)."""
    positions = range(kv_len - q_len, kv_len)
    if pattern == "causal":
        return [p + 1 for p in positions]
    if pattern == "full":  # every query sees all its keys
        return [kv_len] * q_len
    if pattern == "block":  # block-causal in 3-token frames
        return [min((p // 3 + 1) * 3, kv_len) for p in positions]
    if pattern == "lag":  # each query sees the keys before it, not itself
        return list(positions)
    raise ValueError(pattern)


def _metadata(
    q_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    patterns: list[str] | None,
    read_only: tuple[int, ...] = (),
    device: str = "cuda",
) -> AttentionMetadata:
    """Build a step over random blocks; `patterns=None` is plain causal (no `kv_limits`).

    Read-only chunks own blocks for their cached keys only and write into the sink
    (block `num_blocks`), as the model runner lays them out.
    """
    gen = np.random.default_rng(0)
    perm = gen.permutation(num_blocks)
    sink = num_blocks * block_size
    tables: list[list[int]] = []
    slots: list[int] = []
    limits: list[int] = []
    used = 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        is_read_only = i in read_only
        n = -(-(kv_len - q_len if is_read_only else kv_len) // block_size)
        table = perm[used : used + n].tolist()
        used += n
        tables.append(table)
        for p in range(kv_len - q_len, kv_len):
            slots.append(
                sink if is_read_only else table[p // block_size] * block_size + p % block_size
            )
        limits.extend(_limits(patterns[i] if patterns else "causal", kv_len, q_len))
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return AttentionMetadata(
        num_tokens=int(starts[-1]),
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=starts,
        seq_lens=np.array(seq_lens, dtype=np.int64),
        block_tables=tables,
        kv_limits=np.array(limits, dtype=np.int64) if patterns else None,
        block_size=block_size,
        read_only=np.isin(np.arange(len(q_lens)), read_only) if read_only else None,
    )


# (q_lens, seq_lens, patterns per chunk or None for plain causal, read-only chunks)
_STEPS = {
    "decode": ([1, 1, 1, 1], [5, 17, 33, 64], None, ()),
    "mixed-causal": ([7, 1, 12, 1], [7, 20, 30, 9], None, ()),
    "block-causal": ([9, 1, 6], [9, 14, 12], ["block", "causal", "block"], ()),
    "full": ([5, 1, 8], [5, 20, 30], ["full", "full", "full"], ()),
    "full-and-causal": ([6, 4, 1], [6, 20, 9], ["full", "causal", "causal"], ()),
    # The last chunk has fewer cached keys than queries.
    "read-only": ([4, 3, 6], [20, 35, 8], ["full", "full", "full"], (0, 1, 2)),
    "read-only-no-context": ([5, 2], [5, 2], ["full", "full"], (0, 1)),
    "read-only-block": ([6, 4], [22, 9], ["block", "causal"], (0, 1)),
    "read-only-unmasked": ([4, 1], [10, 20], None, (0,)),
    "read-only-mixed": (
        [1, 5, 1, 7, 4, 3],
        [17, 25, 40, 7, 4, 19],
        ["causal", "full", "causal", "block", "full", "full"],
        (1, 4, 5),
    ),
    "read-only-lag": ([3, 6, 1], [12, 14, 30], ["lag", "block", "causal"], (0,)),
}


def _assert_matches_torch(backend: AttentionBackend, dtype: torch.dtype, step: str) -> None:
    """Run `step` through two layers of `backend` and of the torch reference; compare."""
    q_lens, seq_lens, patterns, read_only = _STEPS[step]
    block_size, num_blocks, heads, kv_heads, dim = 16, 64, 8, 2, 64
    torch.manual_seed(0)
    meta = _metadata(q_lens, seq_lens, block_size, num_blocks, patterns, read_only)
    # Two layers, so the second reuses the step's plans.
    layers = []
    for _ in range(2):
        k_cache = torch.randn(num_blocks + 1, block_size, kv_heads, dim, device="cuda", dtype=dtype)
        q = torch.randn(meta.num_tokens, heads, dim, device="cuda", dtype=dtype)
        k = torch.randn(meta.num_tokens, kv_heads, dim, device="cuda", dtype=dtype)
        layers.append((q, k, torch.randn_like(k), k_cache, torch.randn_like(k_cache)))
    outs: list[list[torch.Tensor]] = []
    for each in (TorchPagedAttention("cuda"), backend):
        each.plan(meta)
        outs.append(
            [
                each.forward(q, k, v, (k_cache.clone(), v_cache.clone()), dim**-0.5).float()
                for q, k, v, k_cache, v_cache in layers
            ]
        )
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("step", list(_STEPS))
def test_flashinfer_matches_torch_backend(dtype: torch.dtype, step: str) -> None:
    from mstar.engines.attention.flashinfer_backend import FlashInferAttention

    _assert_matches_torch(FlashInferAttention("cuda"), dtype, step)


@needs_flashinfer
def test_flashinfer_keeps_matching_across_steps() -> None:
    # One backend for every step: a wrapper's first plan fixes its kernel backend, so an
    # unmasked step must not leave a later masked one on a kernel without masks.
    from mstar.engines.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention("cuda")
    for step in [*_STEPS, *reversed(_STEPS)]:
        _assert_matches_torch(backend, torch.bfloat16, step)


def _generate(engine: KVCacheEngine, prompts: list[list[int]]) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams.greedy(max_tokens=32))


@pytest.mark.parametrize("batch_size", [1, 3, 16, 21])
def test_cuda_graph_decode_matches_eager_and_cpu(batch_size: int) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    prompts = [
        torch.randint(0, 64, (int(n),), generator=gen).tolist()
        for n in torch.randint(1, 20, (batch_size,), generator=gen)
    ]
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
def test_engine_on_flashinfer_matches_the_torch_backend() -> None:
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 4], [7] * 30]
    results = []
    for backend in ("torch", "flashinfer"):
        config = KVCacheEngineConfig(num_blocks=128, attention_backend=backend, cuda_graphs=False)  # type: ignore[arg-type]
        results.append(
            _generate(KVCacheEngine(_flashinfer_llama(), config, device="cuda"), prompts)
        )
    assert results[1] == results[0]
    engine = KVCacheEngine(
        _flashinfer_llama(),
        KVCacheEngineConfig(num_blocks=128, attention_backend="flashinfer"),
        device="cuda",
    )
    engine.add_request("m", [5, 3, 8, 1, 9, 2], SamplingParams.greedy(4), mask=AttentionMask.full())
    while engine.has_unfinished():
        engine.step()


# --- the real models' head layouts, and CUDA graphs on FlashInfer ------------------------------

# (query heads, KV heads) of the zoo's real checkpoints at head size 128: BAGEL-7B's Qwen2.5
# (28 / 4: a GQA group of 7, which FlashInfer's CUDA-core decode kernel does not take),
# Llama-3 8B and Qwen3-Omni's thinker (32 / 8), Orpheus-3B (24 / 8), pi0.5's Gemma (8 / 1).
REAL_LAYOUTS = [(28, 4), (32, 8), (24, 8), (8, 1)]


@needs_flashinfer
@pytest.mark.parametrize(("heads", "kv_heads"), REAL_LAYOUTS)
@pytest.mark.parametrize("step", ["decode", "mixed-causal", "read-only-mixed"])
def test_flashinfer_at_real_head_layouts(heads: int, kv_heads: int, step: str) -> None:
    from mstar.engines.attention.flashinfer_backend import FlashInferAttention

    q_lens, seq_lens, patterns, read_only = _STEPS[step]
    block_size, num_blocks, dim, dtype = 16, 64, 128, torch.bfloat16
    torch.manual_seed(heads)
    meta = _metadata(q_lens, seq_lens, block_size, num_blocks, patterns, read_only)
    k_cache = torch.randn(num_blocks + 1, block_size, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(meta.num_tokens, heads, dim, device="cuda", dtype=dtype)
    k = torch.randn(meta.num_tokens, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    outs = []
    for backend in (TorchPagedAttention("cuda"), FlashInferAttention("cuda")):
        backend.plan(meta)
        outs.append(backend.forward(q, k, v, (k_cache.clone(), v_cache.clone()), dim**-0.5).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


def _flashinfer_llama(heads: int = 8, kv_heads: int = 1) -> torch.nn.Module:
    """A tiny Llama FlashInfer runs: bfloat16, head size 64 (FlashInfer has no float32 kernels)."""
    return make_tiny_llama(
        dtype=torch.bfloat16, hidden_size=heads * 64, num_heads=heads, num_kv_heads=kv_heads
    ).cuda()


@needs_flashinfer
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 1), (14, 2)])
def test_cuda_graphs_on_flashinfer_equal_eager_as_batches_change(heads: int, kv_heads: int) -> None:
    # Batch sizes change step to step (21 -> 3 -> 16 sequences), sequences cross block
    # boundaries and outgrow cuda_graph_max_len (48: those steps run eagerly).
    gen = torch.Generator().manual_seed(heads)
    waves = [
        [
            torch.randint(0, 64, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, 30, (size,), generator=gen)
        ]
        for size in (21, 3, 16)
    ]
    results = []
    for graphs in (False, True):
        config = KVCacheEngineConfig(
            num_blocks=256, block_size=8, max_num_seqs=24, attention_backend="flashinfer",
            cuda_graphs=graphs, cuda_graph_max_len=48,
        )  # fmt: skip
        engine = KVCacheEngine(_flashinfer_llama(heads, kv_heads), config, device="cuda")
        assert (engine.runner.cuda_graphs is not None) == graphs
        results.append([_generate(engine, prompts) for prompts in waves])
    assert results[1] == results[0]
