"""The native CPU kernels: decode attention (what attention over the gathered keys gives, read
in place from the paged cache) and the layers' small ops (what the torch ops give, rounding
included), their errors, and engines and layers that run through them."""

from __future__ import annotations

import copy
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, layers, native
from mstar.engines.attention import TorchPagedAttention
from mstar.engines.layers import GatedMLP, RMSNorm, apply_rotary_signed, signed_sin
from mstar.engines.native import cpu_kernels
from mstar.engines.sampler import argmax_rows

from .conftest import make_tiny_llama, run_join_leave_schedule

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None, reason="no C++ compiler to build the kernels"
)


@pytest.fixture(scope="module")
def kernels():  # type: ignore[no-untyped-def]
    built = cpu_kernels()
    assert built is not None, "the native CPU kernels failed to build (see the warning logged)"
    return built


def _cpu_has(*flags: str) -> bool:
    words = next(
        (
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        [],
    )
    return set(flags) <= set(words)


# Each vector path the kernels have, built for a CPU that takes it (and run where this one can):
# this machine's own; AVX-512 without BF16 (bfloat16 widened on load); AVX2 only (two halves).
ISAS = [
    pytest.param(None, id="native"),
    pytest.param(
        "skylake-avx512",
        id="avx512",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(
                not _cpu_has("avx512f", "avx512bw", "avx512vl"), reason="no AVX-512 here"
            ),
        ],
    ),
    pytest.param(
        "haswell",
        id="avx2",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(not _cpu_has("avx2", "fma"), reason="no AVX2 here"),
        ],
    ),
]


@pytest.fixture(scope="module", params=ISAS)
def isa_kernels(request: pytest.FixtureRequest, kernels):  # type: ignore[no-untyped-def]
    """The kernels built for each vector path (`ISAS`)."""
    if request.param is None:
        return kernels
    built = native.build_for(request.param)
    assert built.__name__ != kernels.__name__
    return built


def _paged(
    lens: list[int], kv_heads: int, dim: int, block_size: int, dtype: torch.dtype, seed: int
):  # type: ignore[no-untyped-def]
    """Random keys and values of each row scattered over shuffled blocks; return the caches,
    tables, lengths and each row's keys and values in order `[kv_heads, len, dim]`."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(per_row), dtype=torch.long)
    rows = []
    for r, (n, count) in enumerate(zip(lens, per_row, strict=True)):
        blocks = [order.pop() for _ in range(count)]
        tables[r, :count] = torch.tensor(blocks)
        keys = k_cache[blocks].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
        values = v_cache[blocks].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
        rows.append((keys.float(), values.float()))
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long), rows


def _reference(q: torch.Tensor, rows, kv_heads: int, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = []
    for r, (keys, values) in enumerate(rows):
        heads, dim = q.shape[1], q.shape[2]
        qr = q[r].float().view(kv_heads, heads // kv_heads, dim)
        out.append(
            F.scaled_dot_product_attention(qr, keys, values, scale=scale).reshape(heads, dim)
        )
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [
        (8, 4, 32, 16),
        (9, 3, 64, 16),
        (4, 4, 16, 8),
        (8, 1, 128, 32),
        (2, 2, 256, 16),
        (16, 2, 64, 4),
        (12, 6, 64, 16),  # KV heads scored four at a time (AMX): a group of four, then two
    ],
)
def test_kernel_equals_attention_over_the_gathered_keys(
    isa_kernels, dtype, heads, kv_heads, dim, block_size
) -> None:  # type: ignore[no-untyped-def]
    """Rows of many lengths (one key, partial blocks and tiles, several chunks), strided query
    rows."""
    lens = [1, 5, 16, 17, 64, 100, 257]
    k_cache, v_cache, tables, lengths, rows = _paged(
        lens, kv_heads, dim, block_size, dtype, seed=dim + heads
    )
    # The queries as the layers hand them over: a view into a wider row (q and k side by side).
    qk = torch.randn(
        len(lens), heads + kv_heads, dim, generator=torch.Generator().manual_seed(1)
    ).to(dtype)
    q = qk[:, :heads]
    scale = dim**-0.5
    out = isa_kernels.decode_attention(q, k_cache, v_cache, tables, lengths, scale)
    assert out.dtype == dtype and out.shape == (len(lens), heads, dim) and out.is_contiguous()
    expected = _reference(q, rows, kv_heads, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # float32 arithmetic, rounded once to bfloat16
        torch.testing.assert_close(out, expected.to(dtype), rtol=1.6e-2, atol=1e-2)
    # Each row alone gives what it gives in the batch: no state leaks between work items.
    alone = isa_kernels.decode_attention(
        q[3:4].contiguous(), k_cache, v_cache, tables[3:4].contiguous(), lengths[3:4], scale
    )
    torch.testing.assert_close(alone, out[3:4], rtol=0, atol=0)


def test_a_dominant_key_takes_all_the_weight(isa_kernels) -> None:  # type: ignore[no-untyped-def]
    """Large score gaps (exp underflow) give exactly the one value, and NaN-free output."""
    k_cache = torch.zeros(2, 16, 1, 16)
    v_cache = torch.arange(2 * 16 * 16, dtype=torch.float32).view(2, 16, 1, 16)
    k_cache[1, 3, 0] = 1.0
    q = torch.full((1, 1, 16), 400.0)
    out = isa_kernels.decode_attention(
        q, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([32]), 1.0
    )
    torch.testing.assert_close(out[0, 0], v_cache[1, 3, 0])


def test_kernel_refuses_bad_input(isa_kernels) -> None:  # type: ignore[no-untyped-def]
    k_cache = torch.zeros(4, 16, 2, 32)
    q = torch.zeros(2, 4, 32)
    tables = torch.tensor([[0, 1], [2, 3]])
    lens = torch.tensor([20, 3])
    isa_kernels.decode_attention(q, k_cache, k_cache, tables, lens, 1.0)  # valid
    with pytest.raises(RuntimeError, match="outside its table"):
        isa_kernels.decode_attention(q, k_cache, k_cache, tables, torch.tensor([33, 3]), 1.0)
    with pytest.raises(RuntimeError, match="outside its table"):
        isa_kernels.decode_attention(q, k_cache, k_cache, tables, torch.tensor([0, 3]), 1.0)
    with pytest.raises(RuntimeError, match="names block 9"):
        isa_kernels.decode_attention(q, k_cache, k_cache, torch.tensor([[0, 9], [2, 3]]), lens, 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        isa_kernels.decode_attention(q.bfloat16(), k_cache, k_cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be"):
        isa_kernels.decode_attention(
            torch.zeros(2, 4, 8),
            torch.zeros(4, 16, 2, 8),
            torch.zeros(4, 16, 2, 8),
            tables,
            lens,
            1.0,
        )
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        isa_kernels.decode_attention(
            q.double(), k_cache.double(), k_cache.double(), tables, lens, 1.0
        )
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        isa_kernels.decode_attention(q.transpose(0, 1), k_cache, k_cache, tables, lens, 1.0)


def _forked_tables(lens: list[int], kv_heads: int, dim: int, block_size: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """Caches and tables as forks and truncation leave them: row 1 shares row 0's first half
    of blocks then goes its own way, row 2 is row 0 cut short (its table runs on past its
    length into blocks it must not read), the rest have blocks of their own; every table is
    padded with blocks of other rows. Return the caches, tables, lengths and each row's keys
    and values in order `[kv_heads, len, dim]`."""
    gen = torch.Generator().manual_seed(len(lens) + dim)
    per_row = [-(-n // block_size) for n in lens]
    width = max(per_row)
    num_blocks = sum(per_row) + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.tensor(free[:width] * len(lens)).view(len(lens), width)  # padding
    for r, count in enumerate(per_row):
        if r == 1:
            shared = per_row[0] // 2
            tables[1, :shared] = tables[0, :shared]
            tables[1, shared:count] = torch.tensor([free.pop() for _ in range(count - shared)])
        elif r == 2:
            tables[2] = tables[0]
        else:
            tables[r, :count] = torch.tensor([free.pop() for _ in range(count)])
    rows = []
    for r, n in enumerate(lens):
        blocks = tables[r, : per_row[r]]
        keys = k_cache[blocks].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
        values = v_cache[blocks].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
        rows.append((keys.float(), values.float()))
    return k_cache, v_cache, tables.contiguous(), torch.tensor(lens), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(8, 4, 32, 16), (9, 3, 64, 16), (4, 1, 128, 32), (4, 2, 16, 8)],
)
def test_long_rows_split_into_ranges_equal_the_reference(
    isa_kernels, dtype, heads, kv_heads, dim, block_size
) -> None:  # type: ignore[no-untyped-def]
    """Rows longer than a range (256 keys) are scored range by range, on several threads, and
    their ranges merged: ragged lengths up to 8k, forked and truncated tables; the result
    does not depend on the threads or on the rows beside a row."""
    lens = [3000, 8192, 1000, 1, 256, 257, 511, 4099]
    k_cache, v_cache, tables, lengths, rows = _forked_tables(lens, kv_heads, dim, block_size, dtype)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    scale = dim**-0.5
    expected = _reference(q, rows, kv_heads, scale)
    threads = torch.get_num_threads()
    try:
        results = {}
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results[n] = isa_kernels.decode_attention(q, k_cache, v_cache, tables, lengths, scale)
        alone = isa_kernels.decode_attention(
            q[1:2].contiguous(), k_cache, v_cache, tables[1:2].contiguous(), lengths[1:2], scale
        )
    finally:
        torch.set_num_threads(threads)
    out = results[1]
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # float32 arithmetic, rounded once to bfloat16
        torch.testing.assert_close(out, expected.to(dtype), rtol=1.6e-2, atol=1e-2)
    for n in (2, 3):  # ranges and their merge are the same however the work is spread
        torch.testing.assert_close(results[n], out, rtol=0, atol=0)
    torch.testing.assert_close(alone, out[1:2], rtol=0, atol=0)


def test_a_dominant_key_in_a_late_range_takes_all_the_weight(isa_kernels) -> None:  # type: ignore[no-untyped-def]
    """Merging ranges whose maxima lie far apart: the earlier ranges' weights underflow to
    nothing, no NaN, exactly the one value."""
    k_cache = torch.zeros(64, 16, 1, 16)
    v_cache = torch.randn(64, 16, 1, 16, generator=torch.Generator().manual_seed(3))
    k_cache[50, 7, 0] = 1.0  # key 807 of the row below, in its fourth range
    tables = torch.arange(64).view(1, 64)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = isa_kernels.decode_attention(
                torch.full((1, 2, 16), 1e3), k_cache, v_cache, tables, torch.tensor([1000]), 1.0
            )
            assert torch.equal(out, v_cache[50, 7, 0].expand(1, 2, 16))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("dtype", "dim", "heads", "kv_heads", "block_size"),
    [
        (torch.float32, 16, 4, 2, 4),
        (torch.float32, 32, 8, 4, 16),
        (torch.float32, 64, 9, 3, 16),
        (torch.float32, 128, 8, 2, 16),
        (torch.float32, 256, 2, 1, 8),
        (torch.bfloat16, 32, 8, 4, 16),
        (torch.bfloat16, 64, 9, 3, 4),
        (torch.bfloat16, 128, 4, 4, 16),
        (torch.bfloat16, 256, 2, 1, 32),
    ],
)
def test_prefill_attention_equals_the_reference_for_every_mask(
    isa_kernels,
    dtype: torch.dtype,
    dim: int,
    heads: int,
    kv_heads: int,
    block_size: int,  # type: ignore[no-untyped-def]
) -> None:
    """Chunks of three sequences in one call (shuffled blocks): causal rows that continue a
    cached prefix, block-causal frames, a full chunk and a one-row chunk. Each row equals
    attention over its first `lens[row]` keys, within 1e-5 (float32) or bfloat16's rounding."""
    seq_lens = [150, 97, 64]
    k_cache, v_cache, tables, _, per_seq = _paged(seq_lens, kv_heads, dim, block_size, dtype, 3)
    row_lens = [
        torch.arange(150 - 70, 150) + 1,  # the last 70 positions of a prompt, causal
        ((torch.arange(97) // 16) + 1).clamp(max=97 // 16 + 1) * 16,  # frames of 16
        torch.full((64,), 64),  # bidirectional
    ]
    row_lens[1] = row_lens[1].clamp(max=97)
    lens = torch.cat(row_lens).long()
    seqs = torch.cat([torch.full((len(r),), i) for i, r in enumerate(row_lens)]).long()
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    out = isa_kernels.prefill_attention(q, k_cache, v_cache, tables, seqs, lens, scale)
    group = heads // kv_heads
    for row in range(len(lens)):
        n, s = int(lens[row]), int(seqs[row])
        k = per_seq[s][0][:, :n].double().repeat_interleave(group, 0)
        v = per_seq[s][1][:, :n].double().repeat_interleave(group, 0)
        weights = torch.softmax((q[row].double()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale, -1)
        want = (weights[:, None, :] @ v)[:, 0]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[row].double(), want, atol=tol, rtol=tol)


def test_prefill_attention_rejects_bad_tables(kernels) -> None:  # type: ignore[no-untyped-def]
    k_cache = torch.zeros(4, 16, 2, 32)
    q = torch.zeros(2, 4, 32)
    tables = torch.tensor([[0, 1], [2, 3]])
    seqs, lens = torch.tensor([0, 1]), torch.tensor([20, 3])
    kernels.prefill_attention(q, k_cache, k_cache, tables, seqs, lens, 1.0)  # valid
    with pytest.raises(RuntimeError, match="outside its table"):
        kernels.prefill_attention(q, k_cache, k_cache, tables, seqs, torch.tensor([33, 3]), 1.0)
    with pytest.raises(RuntimeError, match="names sequence 2"):
        kernels.prefill_attention(q, k_cache, k_cache, tables, torch.tensor([0, 2]), lens, 1.0)
    with pytest.raises(RuntimeError, match="names block 9"):
        kernels.prefill_attention(
            q, k_cache, k_cache, torch.tensor([[0, 9], [2, 3]]), seqs, lens, 1.0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engines_decode_through_the_kernel_as_through_gathers(kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """Requests joining, leaving and preempted (a small cache): the same logits and tokens
    whether decode rows go through the kernel or gather their blocks."""
    model = make_tiny_llama(dtype=dtype, hidden_size=64, num_heads=4, num_kv_heads=2)  # head_dim 16

    def run(
        native: bool,
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], TorchPagedAttention]:
        engine = KVCacheEngine(
            model, KVCacheEngineConfig(block_size=4, num_blocks=12, max_num_batched_tokens=16)
        )
        backend = TorchPagedAttention(decode_staging=False, native=native)
        engine.runner.backend = backend
        engine.runner.ctx.backend = backend
        engine.return_logits = True
        tokens, logits = run_join_leave_schedule(engine)
        assert engine.scheduler.num_preemptions > 0
        return tokens, {k: torch.stack(v) for k, v in logits.items()}, backend

    (native_tokens, native, backend), (gathered_tokens, gathered, _) = run(True), run(False)
    assert backend._native_used
    assert native.keys() == gathered.keys()
    if dtype == torch.float32:
        assert native_tokens == gathered_tokens
        for name in native:
            torch.testing.assert_close(native[name], gathered[name], rtol=1e-4, atol=1e-4)
    else:
        # bfloat16 activations: the attention output rounds once either way, so a near-tie
        # may pick another token; up to and including the first such step, logits agree.
        compared = 0
        for name in native:
            a, b = native_tokens[name], gathered_tokens[name]
            same = (
                next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a) - 1)
                + 1
            )
            compared += same
            torch.testing.assert_close(
                native[name][:same], gathered[name][:same], rtol=0.05, atol=0.1
            )
        assert compared >= len(native) * 8


class _CountingKernels:
    """The kernels, counting the rows `prefill_attention` attends."""

    def __init__(self, kernels) -> None:  # type: ignore[no-untyped-def]
        self._kernels = kernels
        self.prefill_rows = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._kernels, name)

    def prefill_attention(self, q, *args):  # type: ignore[no-untyped-def]
        self.prefill_rows += q.shape[0]
        return self._kernels.prefill_attention(q, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_attend_through_the_kernel_as_through_torch(kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """float32 and bfloat16 (tile products on AMX, widened elsewhere): every writing prefill
    chunk, whole causal prompts included, goes through the native kernel; tokens and logits
    match torch's attention (to the first near-tie, as in the decode test above)."""
    assert not kernels.prefill_uses_amx(torch.zeros(1, 1, 32))
    assert not kernels.prefill_uses_amx(torch.zeros(1, 1, 16, dtype=torch.bfloat16))
    model = make_tiny_llama(dtype=dtype, hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=2)

    def run(
        model: torch.nn.Module, native: bool
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], int]:
        engine = KVCacheEngine(
            model, KVCacheEngineConfig(block_size=4, num_blocks=40, max_num_batched_tokens=16)
        )
        backend = TorchPagedAttention(decode_staging=False, native=native)
        counting = _CountingKernels(backend._kernels) if native else None
        backend._kernels = counting  # type: ignore[assignment]
        engine.runner.backend = backend
        engine.runner.ctx.backend = backend
        engine.return_logits = True
        tokens, logits = run_join_leave_schedule(engine)
        rows = counting.prefill_rows if counting is not None else 0
        return tokens, {k: torch.stack(v) for k, v in logits.items()}, rows

    (native_tokens, native_logits, rows), (torch_tokens, torch_logits, _) = (
        run(model, True),
        run(model, False),
    )
    prompt_rows = sum(5 + ord(name) % 7 for name in "abcdef")
    # every prompt row in each of the 2 layers, not only the masked chunks
    assert rows == 2 * prompt_rows

    # Each request's steps up to the first token two runs differ on (a near-tie), that one
    # included (the logits of a step follow the same tokens in both).
    def agreeing(a: list[int], b: list[int]) -> int:
        differ = (i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        return next(differ, len(a) - 1) + 1

    agreed = {name: agreeing(a, torch_tokens[name]) for name, a in native_tokens.items()}
    assert sum(agreed.values()) >= len(native_logits) * 8
    if dtype == torch.float32:
        for name, same in agreed.items():
            torch.testing.assert_close(
                native_logits[name][:same], torch_logits[name][:same], rtol=1e-4, atol=2e-4
            )
        return
    # bfloat16: the two attentions round differently, and each lies further from float32's
    # logits than from the other's; each is held to float32's (the same weights, torch's
    # attention) over the steps all three agree on: the kernel's mean error at most 1.1x torch's.
    ref_tokens, ref_logits, _ = run(copy.deepcopy(model).float(), False)
    errors = {"native": 0.0, "torch": 0.0}
    count = 0
    for name, same in agreed.items():
        steps = min(same, agreeing(native_tokens[name], ref_tokens[name]))
        want = ref_logits[name][:steps]
        errors["native"] += float((native_logits[name][:steps] - want).abs().sum())
        errors["torch"] += float((torch_logits[name][:steps] - want).abs().sum())
        count += want.numel()
    assert count >= 6 * 4 * 64  # most steps compared
    assert errors["native"] / count <= 1.1 * errors["torch"] / count, errors


def test_native_kernels_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "ENABLED", False)
    assert native.cpu_kernels() is None
    assert TorchPagedAttention("cpu")._kernels is None


def _torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "ENABLED", False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_round_as_the_torch_path_does(
    kernels, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(256, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(256, generator=gen))
    wide = (3 * torch.randn(16, 512, generator=gen)).to(dtype)
    x = wide[:, :256]  # strided rows, as a fused product's slice hands them over
    delta = torch.randn(16, 256, generator=gen).to(dtype)
    with torch.inference_mode():
        native = norm(x), norm.residual(x, delta), norm(x.view(4, 4, 256))
        _torch_paths(monkeypatch)
        plain = norm(x), norm.residual(x, delta), norm(x.view(4, 4, 256))
    assert torch.equal(native[1][0], plain[1][0])  # the sum rounds once either way
    assert native[2].shape == (4, 4, 256)
    if dtype == torch.bfloat16:  # bit for bit
        for a, b in [(native[0], plain[0]), (native[1][1], plain[1][1]), (native[2], plain[2])]:
            assert torch.equal(a, b)
    else:  # the sum of squares in another order: an ulp or so
        for a, b in [(native[0], plain[0]), (native[1][1], plain[1][1]), (native[2], plain[2])]:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_silu_mul_equal_the_torch_ops(
    kernels, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(16, 14 * 32, generator=gen).to(dtype)
    qk = qkv[:, : 12 * 32].view(16, 12, 32)  # q and k heads side by side, v after them
    angles = 40 * torch.rand(16, 1, 32, generator=gen)
    cos, sin = angles.cos().to(dtype), signed_sin(angles.sin()).to(dtype)
    mlp = GatedMLP(64, 128).to(dtype)
    mlp.fuse()
    x = torch.randn(16, 64, generator=gen).to(dtype)
    with torch.inference_mode():
        native = apply_rotary_signed(qk, cos, sin), kernels.silu_mul(8 * qkv[:, :256]), mlp(x)
        _torch_paths(monkeypatch)
        gate, up = (8 * qkv[:, :256]).chunk(2, dim=-1)
        plain = apply_rotary_signed(qk, cos, sin), F.silu(gate) * up, mlp(x)
    assert torch.equal(native[0], plain[0])  # the same three roundings, no fused multiply-add
    if dtype == torch.bfloat16:
        assert torch.equal(native[1], plain[1]) and torch.equal(native[2], plain[2])
    else:  # exp to within an ulp or two
        torch.testing.assert_close(native[1], plain[1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(native[2], plain[2], rtol=1e-5, atol=1e-5)
    # Far tails of silu: exp's clamps give 0 and the identity, never NaN.
    tails = kernels.silu_mul(torch.tensor([[-1e4, 1e4, 100.0, 2.0, 1.0, 1.0, 1.0, 1.0]]).to(dtype))
    torch.testing.assert_close(
        tails.float(),
        torch.tensor([[-0.0, 1e4, 100.0, 2 * 0.8807970779778823]]),
        rtol=8e-3,
        atol=1e-30,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_ops_give_the_same_on_every_path(isa_kernels, kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """rms_norm, add_rms_norm, rotary and silu_mul (checked against torch above, on this
    machine's path) give the same values built for every vector path."""
    gen = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(16, 512, generator=gen)).to(dtype)[:, :256]
    w, delta = (
        (1 + 0.1 * torch.randn(256, generator=gen)).to(dtype),
        torch.randn(16, 256, generator=gen).to(dtype),
    )
    qk = torch.randn(16, 12, 32, generator=gen).to(dtype)
    angles = 40 * torch.rand(16, 32, generator=gen)
    cos, sin = angles.cos().to(dtype), signed_sin(angles.sin()).to(dtype)
    gated = (8 * torch.randn(16, 256, generator=gen)).to(dtype)
    for got, want in [
        (isa_kernels.rms_norm(x, w, 1e-5), kernels.rms_norm(x, w, 1e-5)),
        (
            isa_kernels.add_rms_norm(x, delta, w, 1e-5)[1],
            kernels.add_rms_norm(x, delta, w, 1e-5)[1],
        ),
        (isa_kernels.rotary(qk, cos, sin), kernels.rotary(qk, cos, sin)),
        (isa_kernels.silu_mul(gated), kernels.silu_mul(gated)),
    ]:
        if dtype == torch.bfloat16:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_small_ops_refuse_bad_input(isa_kernels) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        isa_kernels.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        isa_kernels.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="share shape"):
        isa_kernels.add_rms_norm(x, torch.randn(4, 4), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        isa_kernels.silu_mul(x.t())
    with pytest.raises(RuntimeError, match="even width"):
        isa_kernels.silu_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="cos and sin"):
        isa_kernels.rotary(torch.randn(4, 2, 8), torch.randn(4, 6), torch.randn(4, 6))


def test_a_layer_the_kernel_does_not_take_gathers_within_the_same_step(kernels) -> None:  # type: ignore[no-untyped-def]
    """One decode step whose first layer goes through the kernel (float32) and whose second
    cannot (float64): both give attention over each row's keys."""
    import numpy as np

    from mstar.engines.attention import AttentionMetadata

    lens, block_size, kv_heads, heads, dim = [5, 19, 33], 8, 2, 4, 16
    backend = TorchPagedAttention("cpu", native=True)
    for step in range(2):  # the second step finds the kernel used before
        step_lens = [n + step for n in lens]
        per_row = [-(-n // block_size) for n in step_lens]
        tables = [list(range(sum(per_row[:r]), sum(per_row[: r + 1]))) for r in range(len(lens))]
        slots = [
            tables[r][(n - 1) // block_size] * block_size + (n - 1) % block_size
            for r, n in enumerate(step_lens)
        ]
        metadata = AttentionMetadata(
            num_tokens=len(lens),
            slot_mapping=torch.tensor(slots),
            query_start_loc=np.arange(len(lens) + 1),
            seq_lens=np.array(step_lens),
            block_tables=tables,
            kv_limits=None,
            block_size=block_size,
            seq_keys=np.arange(len(lens)),
        )
        backend.plan(metadata)
        for dtype in (torch.float32, torch.float64):
            gen = torch.Generator().manual_seed(step)
            k_cache = torch.randn(sum(per_row), block_size, kv_heads, dim, generator=gen).to(dtype)
            v_cache = torch.randn(sum(per_row), block_size, kv_heads, dim, generator=gen).to(dtype)
            q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
            k = torch.randn(len(lens), kv_heads, dim, generator=gen).to(dtype)
            v = torch.randn(len(lens), kv_heads, dim, generator=gen).to(dtype)
            out = backend.forward(q, k, v, (k_cache, v_cache), dim**-0.5)
            assert backend._native_used == (dtype == torch.float32)
            for r, n in enumerate(step_lens):  # the step's keys were written first
                keys = k_cache[tables[r]].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
                values = v_cache[tables[r]].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
                expected = F.scaled_dot_product_attention(
                    q[r].view(kv_heads, 2, dim), keys, values, scale=dim**-0.5
                ).reshape(heads, dim)
                torch.testing.assert_close(out[r], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("features", [64, 96, 18])
def test_tiled_linear_is_the_product_rounded_once(
    isa_kernels, dtype: torch.dtype, bias: bool, features: int
) -> None:  # type: ignore[no-untyped-def]
    """Every row count a step can have (one to past two blocks of 16), strided input rows.

    On a CPU with AMX, bfloat16 products of 4 rows or more with features in blocks of 32 run
    as tile products (96: a last block of 32 alone; 18: not in blocks, the vector path).
    """
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(80, features, generator=gen).to(dtype)
    b = torch.randn(80, generator=gen).to(dtype) if bias else None
    tiles = isa_kernels.pack_linear(weight)
    for rows in (1, 2, 4, 7, 16, 17, 40):
        x = torch.randn(rows, features + 32, generator=gen).to(dtype)[:, 16 : 16 + features]
        got = isa_kernels.linear(x, tiles, b)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert got.dtype == dtype and got.shape == (rows, 80)
        if dtype == torch.float32:
            torch.testing.assert_close(got, exact.float(), rtol=1e-5, atol=1e-5)
        else:  # float32 sums, rounded once to bfloat16: within half a bfloat16 ulp of the sum
            torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-4)


def test_tiled_linear_of_many_rows_adds_as_a_few_rows_do(isa_kernels) -> None:  # type: ignore[no-untyped-def]
    """bfloat16, 200 rows by 1,536 features: on AMX in blocks of 32 rows, rows and weights a
    stripe at a time. Each row's outputs are the same bits as in a product of fewer rows (the
    same tile products, added in the same order) and within rounding of the exact product."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(80, 1536, generator=gen).bfloat16()
    b = torch.randn(80, generator=gen).bfloat16()
    tiles = isa_kernels.pack_linear(weight)
    x = torch.randn(200, 1536, generator=gen).bfloat16()
    got = isa_kernels.linear(x, tiles, b)
    exact = F.linear(x.double(), weight.double(), b.double())
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-3)
    for rows in (4, 17, 33):
        assert torch.equal(isa_kernels.linear(x[-rows:], tiles, b), got[-rows:])


def test_tiled_linear_refuses_bad_input(isa_kernels) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="multiple of 16"):
        isa_kernels.pack_linear(torch.randn(20, 8))
    tiles = isa_kernels.pack_linear(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="has 9 features, the weights 8"):
        isa_kernels.linear(torch.randn(2, 9), tiles)
    with pytest.raises(RuntimeError, match="bias"):
        isa_kernels.linear(torch.randn(2, 8), tiles, torch.randn(31))
    with pytest.raises(RuntimeError, match="dtype"):
        isa_kernels.linear(torch.randn(2, 8).double(), tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_picks_the_first_maximum(isa_kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """As torch.argmax: the first of tied maxima, NaN above everything (the first NaN), rows
    of any width (whole vectors and a tail), strided rows; bfloat16 read without a copy."""
    gen = torch.Generator().manual_seed(11)
    for width in (1, 15, 16, 31, 32, 33, 100, 32000):
        for trial in range(6):
            x = torch.randn(9, width + 3, generator=gen)[:, 2 : 2 + width]
            if trial % 2:
                x = (x * 2).round()  # many ties
            x[1] = 1.0
            x[2] = float("-inf")
            if width > 3:
                x[3, width // 2] = float("nan")
                x[3, width - 1] = float("nan")
                x[4, 1] = x[4, width - 1] = float("inf")
            x = x.to(dtype)
            expected = x.float().argmax(dim=-1)
            assert torch.equal(isa_kernels.argmax_rows(x), expected), (width, trial)
            assert torch.equal(argmax_rows(x), expected)


def test_argmax_rows_refuses_bad_input(isa_kernels) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="contiguous rows"):
        isa_kernels.argmax_rows(torch.randn(4, 8).t())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        isa_kernels.argmax_rows(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="rows of 1 to"):
        isa_kernels.argmax_rows(torch.randn(2, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["tiled", "in_out", "out_in", "packed"])
def test_native_decoder_layers_equal_the_layer_by_layer_path(
    kernels,
    dtype: torch.dtype,
    layout: str,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """Decode steps run in one `DecodeStack.forward` call: bit for bit the logits and tokens
    of the layer-by-layer path, with requests joining, leaving and preempted. Products in
    oneDNN's packed layout are not taken (the layer-by-layer path serves them)."""
    if layout == layers.PACKED and not layers.can_pack(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    monkeypatch.setattr(layers, "choose_layout", lambda weight, rows=layers.DECODE_ROWS: layout)
    calls = 0

    class CountedStack:
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self._stack = kernels.DecodeStack(*args, **kwargs)

        def add_layer(self, *args):  # type: ignore[no-untyped-def]
            self._stack.add_layer(*args)

        def forward(self, *args):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return self._stack.forward(*args)

    def run(native: bool) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
        model = make_tiny_llama(
            dtype=dtype, hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=3
        )
        model.fuse_for_inference()
        if not native:
            model._native_stack = False
        engine = KVCacheEngine(
            model, KVCacheEngineConfig(block_size=4, num_blocks=12, max_num_batched_tokens=16)
        )
        engine.return_logits = True
        return run_join_leave_schedule(engine)

    monkeypatch.setattr(native, "_loaded", _Counting(kernels, "DecodeStack", CountedStack))
    fused_tokens, fused = run(True)
    plain_tokens, plain = run(False)
    assert (calls > 0) == (layout != "packed")
    assert fused_tokens == plain_tokens
    for name in fused:
        assert all(torch.equal(a, b) for a, b in zip(fused[name], plain[name], strict=True)), name


class _Counting:
    """The kernels module with one function replaced."""

    def __init__(self, module, name: str, fn) -> None:  # type: ignore[no-untyped-def]
        self._module, self._name, self._fn = module, name, fn

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return self._fn if name == self._name else getattr(self._module, name)


def test_decode_layer_refuses_bad_input(isa_kernels) -> None:  # type: ignore[no-untyped-def]
    model = make_tiny_llama(hidden_size=64, num_heads=4, num_kv_heads=2)
    model.fuse_for_inference()
    layer = model.decoder_layers[0]
    products = layer.native_products()
    assert products is not None
    weights, biases, transposed = products
    k_cache = torch.zeros(4, 4, 2, 16)
    v_cache = torch.zeros(4, 4, 2, 16)
    x, cos, sin = torch.randn(2, 64), torch.ones(2, 16), torch.zeros(2, 16)
    tables, lens = torch.tensor([[0], [1]]), torch.tensor([1, 1])
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, 1e-5)

    def call(slots: torch.Tensor, k: torch.Tensor = k_cache):  # type: ignore[no-untyped-def]
        return isa_kernels.decode_layer(
            x,
            None,
            *norms,
            weights,
            biases,
            transposed,
            cos,
            sin,
            k,
            v_cache,
            slots,
            tables,
            lens,
            0.25,
            4,
        )

    residual, mlp = call(torch.tensor([0, 4]))
    assert residual.shape == mlp.shape == (2, 64)
    assert k_cache[1, 0].abs().sum() > 0  # row 1's key went to slot 4: block 1, offset 0
    with pytest.raises(RuntimeError, match="slot 16 is outside the cache"):
        call(torch.tensor([0, 16]))
    with pytest.raises(RuntimeError, match="slots \\[rows\\] int64"):
        call(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="caches"):
        call(torch.tensor([0, 4]), k_cache.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_argmax_is_the_argmax_of_the_tiled_product(isa_kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(13)
    weight = torch.randn(4000, 64, generator=gen).to(dtype)
    bias = torch.randn(4000, generator=gen).to(dtype)
    tiles = isa_kernels.pack_linear(weight)
    for rows in (1, 5, 16):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        for b in (None, bias):
            expected = isa_kernels.argmax_rows(isa_kernels.linear(x, tiles, b))
            assert torch.equal(isa_kernels.linear_argmax(x, tiles, b), expected)


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_argmax_keeps_torchs_choice_on_ties_infinities_and_nans(
    isa_kernels, threads: int
) -> None:  # type: ignore[no-untyped-def]
    """On AMX the bfloat16 product's outputs are never written (each row's maximum is kept as
    they come out, per thread, then merged): still the first maximum, the first NaN, and 0 for
    a row of -inf, as `torch.argmax` of the written outputs gives."""
    gen = torch.Generator().manual_seed(14)
    weight = torch.randn(4000, 64, generator=gen).to(torch.bfloat16)
    weight[3001] = weight[17]  # equal outputs in different tiles and threads' halves
    weight[40:48] = weight[33]  # and within one tile
    tiles = isa_kernels.pack_linear(weight)
    inf, nan = float("inf"), float("nan")
    biases = {
        "none": None,
        "tie": torch.zeros(4000),
        "nan": torch.zeros(4000),
        "ninf": torch.full((4000,), -inf),
    }
    biases["tie"][[17, 3001, 33, 40]] = 100.0
    biases["nan"][[2999, 3500]] = nan
    biases["nan"][12] = inf
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (4, 7, 16, 19):
            x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
            for name, bias in biases.items():
                b = None if bias is None else bias.to(torch.bfloat16)
                outputs = isa_kernels.linear(x, tiles, b)
                expected = torch.argmax(outputs.float(), dim=1)
                assert torch.equal(isa_kernels.linear_argmax(x, tiles, b), expected), (rows, name)
    finally:
        torch.set_num_threads(previous)


def test_a_build_killed_midway_leaves_no_lock_that_stops_the_next(kernels) -> None:  # type: ignore[no-untyped-def]
    """torch's loader leaves its lock file behind when a build is killed; the next build waited on
    it forever."""
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(native._build_name(), verbose=False))
    (build_dir / "lock").write_text("")  # what a build killed while compiling leaves
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(native._build()), daemon=True)
    thread.start()
    thread.join(timeout=90)  # loading the cached build takes milliseconds; the bug waits forever
    assert done and done[0].__name__ == kernels.__name__
    assert not (build_dir / "lock").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_rows_where_index_copy_does(kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(6)
    k_cache = torch.zeros(8, 4, 2, 16, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.randn(5, 3, 2, 16, generator=gen).to(dtype)  # k and v as strided rows of one tensor
    k, v = kv[:, 0], kv[:, 2]
    slots = torch.tensor([31, 0, 5, 6, 17])
    kernels.write_kv(k_cache, v_cache, slots, k, v)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k.view(-1, 2, 16).index_copy_(0, slots, k)
    want_v.view(-1, 2, 16).index_copy_(0, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="slot 32 is outside the cache"):
        kernels.write_kv(k_cache, v_cache, torch.tensor([0, 32, 1, 2, 3]), k, v)
    with pytest.raises(RuntimeError, match="keys and values"):
        kernels.write_kv(k_cache, v_cache, slots, k.float().double(), v)
    with pytest.raises(RuntimeError, match="slots"):
        kernels.write_kv(k_cache, v_cache, slots[:4], k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_silu_mul_is_silu_mul_of_the_product(isa_kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The gated product in one pass gives linear's then silu_mul's values bit for bit, on every
    vector path (AMX blocks of 32 and 16 rows, AVX-512 and AVX2 tiles) and row count."""
    gen = torch.Generator().manual_seed(14)
    for inner, hidden in ((48, 64), (512, 256)):
        weight = (0.2 * torch.randn(2 * inner, hidden, generator=gen)).to(dtype)
        tiles = isa_kernels.pack_linear(weight)
        for rows in (1, 5, 16, 37, 100):
            x = torch.randn(rows, hidden + 8, generator=gen).to(dtype)[:, :hidden]  # strided rows
            got = isa_kernels.linear_silu_mul(x, tiles)
            want = isa_kernels.silu_mul(isa_kernels.linear(x, tiles, None))
            assert got.shape == (rows, inner)
            assert torch.equal(got, want), (inner, rows)
    odd = isa_kernels.pack_linear(weight[:48])  # 48 outputs: not two halves of whole tiles
    with pytest.raises(RuntimeError, match="gate and up"):
        isa_kernels.linear_silu_mul(torch.randn(2, 256).to(dtype), odd)
