"""Keys staged across steps (groups of frame blocks, queries over an unchanged context) give
exactly what gathering them from the paged cache every step gives."""

from __future__ import annotations

import torch

from mstar.engines import AttentionMask, KVCacheEngine, KVCacheEngineConfig
from mstar.engines.attention import TorchPagedAttention

from .conftest import make_tiny_llama


def _engine(staging: bool) -> KVCacheEngine:
    engine = KVCacheEngine(
        make_tiny_llama(),
        KVCacheEngineConfig(block_size=4, num_blocks=128, attention_backend="torch"),
    )
    backend = TorchPagedAttention(chunk_staging=staging)
    engine.runner.backend = backend
    engine.runner.ctx.backend = backend
    return engine


def _run(staging: bool) -> tuple[list[torch.Tensor], int]:
    """Three rows append full-mask blocks step after step (one leaves, one joins late), while
    four query steps read one context; return every row the steps returned."""
    engine = _engine(staging)
    full = AttentionMask.full()
    rows: list[torch.Tensor] = []
    engine.add_request("ctx", list(range(1, 12)), output_mode="none", keep_alive=True)
    for o in engine.step():
        assert o.hidden is None
    for step in range(6):
        for r in range(3):
            if (r == 2 and step < 2) or (r == 1 and step > 3):
                continue  # row 2 joins at step 2, row 1 leaves after step 3
            tokens = [(7 * step + 3 * r + k) % 60 + 1 for k in range(5)]
            key = f"row{r}"
            try:
                engine.resume(key, tokens, mask=full, output_mode="hidden")
            except Exception:
                engine.add_request(key, tokens, mask=full, output_mode="hidden", keep_alive=True)
        if step < 4:
            engine.query("ctx", f"q{step}", token_ids=[5 + step, 6, 7], mask=full)
        outs = sorted(engine.step(), key=lambda o: o.request_id)
        rows.extend(o.hidden for o in outs if o.hidden is not None)
    backend = engine.runner.backend
    assert isinstance(backend, TorchPagedAttention)
    return rows, backend.num_staged_groups


def test_staged_groups_equal_gathered_ones() -> None:
    (staged, num_staged), (gathered, num_gathered) = _run(True), _run(False)
    assert num_gathered == 0 and num_staged >= 4  # the query steps and the rows' steady steps
    assert len(staged) == len(gathered) == 6 * 3 - 2 - 2 + 4
    for a, b in zip(staged, gathered, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
