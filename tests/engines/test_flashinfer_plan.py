"""FlashInfer's plans, checked without a GPU: which decode kernel, host index arrays, padded
graph page tables. A stand-in `flashinfer` module records what the backend asks of it."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from mstar.engines.attention import AttentionMetadata
from mstar.engines.attention.flashinfer_plan import (
    decode_uses_tensor_cores,
    padded_page_table,
    page_table,
)


class _Wrapper:
    made: ClassVar[list[_Wrapper]] = []

    def __init__(self, workspace: torch.Tensor, layout: str, **kwargs: Any) -> None:
        self.workspace, self.layout, self.kwargs = workspace, layout, kwargs
        self.plans: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        _Wrapper.made.append(self)

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.plans.append((args, kwargs))

    def run(self, q: torch.Tensor, *args: Any, return_lse: bool = False) -> Any:
        out = torch.zeros_like(q)
        return (out, torch.zeros(q.shape[:2])) if return_lse else out


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (_Wrapper,), {})  # type: ignore[attr-defined]
    module.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (_Wrapper,), {})  # type: ignore[attr-defined]
    module.BatchPrefillWithRaggedKVCacheWrapper = type("Ragged", (_Wrapper,), {})  # type: ignore[attr-defined]
    module.merge_state = lambda a, la, b, lb: (a + b, la)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.delitem(sys.modules, "mstar.engines.attention.flashinfer_backend", raising=False)
    _Wrapper.made = []
    yield module
    sys.modules.pop("mstar.engines.attention.flashinfer_backend", None)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tensor_cores"),
    [
        (28, 4, True),
        (14, 2, True),
        (32, 8, False),
        (24, 8, False),
        (16, 16, False),
        (8, 1, True),
        (12, 2, True),
    ],
)
def test_decode_takes_tensor_cores_for_groups_the_cuda_core_kernel_lacks(
    heads: int, kv_heads: int, tensor_cores: bool
) -> None:
    # 7 (BAGEL-7B's Qwen2.5) and 6 have no CUDA-core kernel in FlashInfer 0.2; 8 and up run faster
    # on tensor cores.
    assert decode_uses_tensor_cores(heads, kv_heads) is tensor_cores


def test_page_tables_and_their_graph_padding() -> None:
    indptr, indices, last = page_table(np.array([5, 16, 17]), [[3, 9], [4, 1], [7, 2, 8]], 8)
    assert (
        indptr.tolist() == [0, 1, 3, 6]
        and indices.tolist() == [3, 4, 1, 7, 2, 8]
        and last.tolist() == [5, 8, 1]
    )
    indptr, indices, last = padded_page_table(
        np.array([5, 16]), [[3, 9], [4, 1]], 8, 4, sink_block=99
    )
    assert indptr.tolist() == [0, 1, 3, 4, 5]
    assert indices.tolist() == [3, 4, 1, 99, 99] and last.tolist() == [5, 8, 1, 1]
    assert all(a.dtype == np.int32 for a in (indptr, indices, last))
    empty = padded_page_table(np.zeros(0, np.int64), [], 8, 2, sink_block=5)
    assert [a.tolist() for a in empty] == [[0, 1, 2], [5, 5], [1, 1]]


def _step(
    q_lens: list[int], seq_lens: list[int], kv_limits: list[int] | None = None
) -> AttentionMetadata:
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    tables = [list(range(10 * i, 10 * i + -(-n // 4))) for i, n in enumerate(seq_lens)]
    return AttentionMetadata(
        num_tokens=int(starts[-1]),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.long, device="meta"),
        query_start_loc=starts,
        seq_lens=np.array(seq_lens, dtype=np.int64),
        block_tables=tables,
        kv_limits=None if kv_limits is None else np.array(kv_limits, dtype=np.int64),
        block_size=4,
    )


def _forward(backend: Any, meta: AttentionMetadata, heads: int, kv_heads: int) -> None:
    q = torch.zeros(meta.num_tokens, heads, 16, device="meta")
    k = torch.zeros(meta.num_tokens, kv_heads, 16, device="meta")
    cache = torch.zeros(64, 4, kv_heads, 16, device="meta")
    backend.plan(meta)
    backend.forward(q, k, torch.zeros_like(k), (cache, torch.zeros_like(cache)), 0.25)


def test_plans_take_host_index_arrays_and_the_decode_kernel_by_group(
    fake_flashinfer: types.ModuleType,
) -> None:
    # "meta" stands for the GPU: anything sent there would be a device tensor.
    backend = importlib.import_module(
        "mstar.engines.attention.flashinfer_backend"
    ).FlashInferAttention("meta")
    assert backend.workspace.device.type == "meta"
    _forward(backend, _step([1, 1], [5, 9]), heads=28, kv_heads=4)
    _forward(backend, _step([1, 1], [6, 10]), heads=8, kv_heads=4)
    decodes = [w for w in _Wrapper.made if type(w).__name__ == "Decode"]
    assert [w.kwargs["use_tensor_cores"] for w in decodes] == [True, False]
    for wrapper in decodes:
        ((args, kwargs),) = wrapper.plans
        indptr, indices, last = args[:3]
        assert all(
            a.device.type == "cpu" and a.dtype == torch.int32 for a in (indptr, indices, last)
        )
        assert kwargs["sm_scale"] == 0.25
    assert decodes[0].plans[0][0][:3][0].tolist() == [0, 2, 5]  # 5 keys in 2 pages, 9 in 3
    # A causal prefill: host arrays too, no mask.
    _forward(backend, _step([3, 1], [3, 9]), heads=8, kv_heads=4)
    prefill = [w for w in _Wrapper.made if type(w).__name__ == "Prefill"][-1]
    ((args, kwargs),) = prefill.plans
    assert (
        all(a.device.type == "cpu" for a in args[:4])
        and kwargs["custom_mask"] is None
        and kwargs["causal"]
    )


def test_a_masked_plan_keeps_its_arrays_on_the_device(fake_flashinfer: types.ModuleType) -> None:
    # FlashInfer packs a custom mask on the device, indexed by the plan's arrays.
    backend = importlib.import_module(
        "mstar.engines.attention.flashinfer_backend"
    ).FlashInferAttention("meta")
    _forward(backend, _step([3], [3], kv_limits=[3, 3, 3]), heads=4, kv_heads=4)  # full: no mask
    # block-causal: a mask
    _forward(backend, _step([3], [3], kv_limits=[2, 2, 3]), heads=4, kv_heads=4)
    unmasked, masked = (w for w in _Wrapper.made if type(w).__name__ == "Prefill")
    assert unmasked.kwargs["backend"] == "auto" and masked.kwargs["backend"] == "fa2"
    args, kwargs = masked.plans[0]
    assert (
        all(a.device.type == "meta" for a in args[:4])
        and kwargs["custom_mask"].device.type == "meta"
    )
    assert unmasked.plans[0][1]["causal"] is False and unmasked.plans[0][0][0].device.type == "cpu"


def test_graph_buckets_plan_fixed_buffers_on_padded_host_tables(
    fake_flashinfer: types.ModuleType,
) -> None:
    from mstar.engines.cuda_graphs import _FlashInferDecodeAttention

    workspace = torch.zeros(16, dtype=torch.uint8)
    attention = _FlashInferDecodeAttention(
        workspace, torch.full((8,), 63 * 4, dtype=torch.long), max_batch_size=8, max_pages=4,
        sink_block=63, block_size=4, device=torch.device("cpu"),
    )  # fmt: skip
    q, k = torch.zeros(4, 28, 16), torch.zeros(4, 4, 16)
    cache = torch.zeros(64, 4, 4, 16)
    # the bucket's warm-up: its wrapper is made and planned on padding alone
    attention.batch_size = 4
    attention.forward(q, k, torch.zeros_like(k), (cache, torch.zeros_like(cache)), 0.25)
    (wrapper,) = _Wrapper.made
    assert wrapper.kwargs["use_cuda_graph"] and wrapper.kwargs["use_tensor_cores"]
    assert wrapper.kwargs["paged_kv_indptr_buffer"].shape == (5,)
    assert wrapper.kwargs["paged_kv_last_page_len_buffer"].shape == (4,)
    assert wrapper.kwargs["paged_kv_indices_buffer"].data_ptr() == attention.indices.data_ptr()
    assert wrapper.plans[0][0][0].tolist() == [0, 1, 2, 3, 4]
    attention.prepare(_step([1, 1], [5, 9]), 4)  # two sequences in the bucket of 4
    args, kwargs = wrapper.plans[-1]
    assert [a.tolist() for a in args[:3]] == [
        [0, 2, 5, 6, 7],
        [0, 1, 10, 11, 12, 63, 63],
        [1, 1, 1, 1],
    ]
    assert args[3:7] == (28, 4, 16, 4) and kwargs["sm_scale"] == 0.25
    assert all(a.device.type == "cpu" for a in args[:3])
