"""The LLM benchmark's peers: the decode floor's arithmetic, the vLLM peer's stream protocol."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from mstar.baselines.llm import (
    PeerStartError,
    VllmPeer,
    add_floors,
    decode_step_cost,
    kv_cache_bytes,
)

# A Llama of hidden 256, 4 layers, 8 heads / 4 KV heads, intermediate 512, vocab 32000.
TINY_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}

# Speaks the peer's protocol without vLLM: each request gets tokens 0, 1, ... one per step.
FAKE_PEER = """
import json, sys
print(json.dumps({"ready": True, "torch_threads": 1}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if request.get("exit"):
        break
    n = request["max_tokens"]
    for i in range(n):
        print(json.dumps({"step": [[request["id"], [i], i == n - 1]]}), flush=True)
"""


def test_step_cost_counts_weights_once_and_every_cached_key() -> None:
    config = dict(TINY_CONFIG)
    one, flops_one = decode_step_cost(config, 4, 1, 0)
    # Layers (q, k, v, o, gate, up, down, two norms), the final norm, the head, one embedding row.
    per_layer = 256 * 32 * (2 * 8 + 2 * 4) + 3 * 256 * 512 + 2 * 256
    assert one == 4 * (4 * per_layer + 256 + 32000 * 256 + 256)
    sixteen, flops_sixteen = decode_step_cost(config, 4, 16, 100)
    kv = 16 * 100 * 4 * 2 * 4 * 32 * 4
    assert sixteen == one + 15 * 256 * 4 + kv
    assert flops_sixteen > 16 * flops_one


def test_floors_are_bytes_over_bandwidth_and_the_roofline_the_larger_floor() -> None:
    # Bound by arithmetic (the tiny model at c = 16 on one thread) ...
    row = {"step_bytes": 1.31e7, "flop_ms": 3.17, "mstar_tpot_ms": 4.0}
    add_floors(row, 1e10)
    assert (row["floor_ms"], row["floor_pct"]) == pytest.approx((1.31, 32.75))
    assert (row["roofline_ms"], row["roofline_pct"]) == pytest.approx((3.17, 79.25))
    # ... or by bandwidth (one row).
    row = {"step_bytes": 1.09e7, "flop_ms": 0.20, "mstar_tpot_ms": 2.0}
    add_floors(row, 1e10)
    assert (row["roofline_ms"], row["roofline_pct"]) == pytest.approx((1.09, 54.5))


def test_peer_streams_each_request_its_tokens(tmp_path: Path) -> None:
    fake = tmp_path / "fake_peer.py"
    fake.write_text(FAKE_PEER)

    async def run() -> list[list[int]]:
        peer = VllmPeer(Path(sys.executable), fake, {}, threads=1, log=tmp_path / "peer.log")
        await peer.start()
        try:

            async def one(n: int) -> list[int]:
                return [t async for t in peer.generate([1, 2, 3], n)]

            return list(await asyncio.gather(one(3), one(5)))
        finally:
            await peer.close()

    assert asyncio.run(run()) == [[0, 1, 2], [0, 1, 2, 3, 4]]


async def test_a_peer_that_exits_while_loading_says_so(tmp_path: Path) -> None:
    dead = tmp_path / "dead_peer.py"
    dead.write_text("raise SystemExit(3)\n")
    peer = VllmPeer(Path(sys.executable), dead, {}, threads=1, log=tmp_path / "peer.log")
    with pytest.raises(PeerStartError, match="exited while loading"):
        await peer.start()
    missing = VllmPeer(tmp_path / "none", dead, {}, threads=1, log=tmp_path / "peer.log")
    with pytest.raises(PeerStartError, match="no interpreter"):
        await missing.start()


def test_attentions_part_is_its_keys_and_values_over_the_bandwidth() -> None:
    config = dict(TINY_CONFIG)
    kv = kv_cache_bytes(config, 2, 16, 1536)
    assert kv == 16 * 1536 * 4 * 2 * 4 * 32 * 2  # rows x keys x layers x (K, V) x heads x dim
    total, _ = decode_step_cost(config, 2, 16, 1536)
    row = {"step_bytes": total, "kv_bytes": kv, "flop_ms": 0.1, "mstar_tpot_ms": 20.0}
    add_floors(row, 1e10)
    assert row["kv_floor_ms"] == pytest.approx(kv / 1e7)
    assert row["kv_share_pct"] == pytest.approx(100 * kv / total)
    assert 0 < row["kv_share_pct"] < 100
