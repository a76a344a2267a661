"""Deterministic serving at the engine: a row computes the same bits whatever shares its step.

A request served among others (arriving at random steps, its prompt split into chunks by a
small token budget, preempted and recomputed when blocks run out, hitting the prefix cache)
gives byte for byte the tokens, log-probabilities and raw logits it gives alone in a roomy
engine; sampled requests (temperature 1, top-p 0.9, seeded) too. The products, attention and
sampler each keep a row's arithmetic independent of the other rows and of the thread count.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.engines.greedy_head import ScreenedArgmax, can_screen
from mstar.engines.kv_node import KVNodeEngine
from mstar.engines.layers import (
    TILED,
    FusedLinear,
    deterministic_products,
    make_linears_deterministic,
)
from mstar.engines.native import cpu_kernels
from mstar.engines.sampler import TokenLogprobs
from mstar.zoo.llama import LlamaCausalLM

from .conftest import GroupNode, make_tiny_llama

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs the native CPU kernels")

VOCAB = 96


def _model(dtype: torch.dtype) -> LlamaCausalLM:
    # head_dim 16 (the kernel's smallest), a vocabulary that is not a whole number of tiles,
    # weights flat enough that sampling has several likely tokens.
    model = make_tiny_llama(
        dtype=dtype, vocab_size=VOCAB, hidden_size=64, num_heads=4, num_kv_heads=2, std=0.15
    )
    with deterministic_products():
        model.fuse_for_inference()
    make_linears_deterministic(model)
    return model


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request: pytest.FixtureRequest) -> LlamaCausalLM:
    return _model(request.param)


@dataclass(frozen=True)
class Req:
    name: str
    prompt: list[int]
    params: SamplingParams
    arrival: int


@dataclass
class Result:
    tokens: list[int]
    logits: list[bytes]
    logprobs: list[TokenLogprobs]


def _serve(
    model: LlamaCausalLM, reqs: list[Req], config: KVCacheEngineConfig, logits: bool = True
) -> dict[str, Result]:
    engine = KVCacheEngine(model, config)
    # Without logits, greedy rows take the model's greedy head (a float32 head screened in
    # bfloat16), beside sampled rows or not.
    engine.return_logits = logits
    results = {r.name: Result([], [], []) for r in reqs}
    pending = sorted(reqs, key=lambda r: r.arrival)
    for step in range(10_000):
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            engine.add_request(r.name, r.prompt, r.params, keep_alive=True)
        for out in engine.step():
            assert out.error is None, out.error
            result = results[out.request_id]
            result.tokens.extend(out.new_token_ids)
            if out.logits is not None:
                result.logits.append(out.logits.float().numpy().tobytes())
            seq = engine.get_sequence(out.request_id)
            if seq.params.logprobs is not None and out.new_token_ids:
                result.logprobs.extend(seq.logprobs[-len(out.new_token_ids) :])
                seq.logprobs = []
            if out.finished:
                engine.release(out.request_id)
        if not pending and not engine.has_unfinished():
            break
    return results


def _alone(model: LlamaCausalLM, req: Req, logits: bool = True) -> Result:
    roomy = KVCacheEngineConfig(block_size=4, num_blocks=64, deterministic=True)
    return _serve(model, [Req(req.name, req.prompt, req.params, 0)], roomy, logits)[req.name]


@st.composite
def schedules(draw: st.DrawFn) -> tuple[list[Req], KVCacheEngineConfig]:
    shared = draw(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=12))
    reqs = []
    for i in range(draw(st.integers(2, 6))):
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        prompt = (shared + own) if draw(st.booleans()) else own  # prefix-cache hits
        if draw(st.booleans()):
            params = SamplingParams(
                temperature=1.0,
                top_p=0.9,
                seed=draw(st.integers(0, 2**32)),
                max_tokens=draw(st.integers(1, 12)),
                logprobs=2,
            )
        else:
            params = SamplingParams(temperature=0.0, max_tokens=draw(st.integers(1, 12)))
        reqs.append(Req(f"r{i}", prompt, params, draw(st.integers(0, 8))))
    config = KVCacheEngineConfig(
        block_size=4,
        # few blocks: later arrivals preempt (and recompute) earlier ones
        num_blocks=draw(st.integers(12, 40)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(9, 24)),  # prompts split into chunks
        deterministic=True,
    )
    return reqs, config


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schedule=schedules(), logits=st.booleans())
def test_each_request_gives_the_bytes_it_gives_alone(
    model: LlamaCausalLM, schedule: tuple[list[Req], KVCacheEngineConfig], logits: bool
) -> None:
    reqs, config = schedule
    served = _serve(model, reqs, config, logits)
    for req in reqs:
        alone = _alone(model, req, logits)
        got = served[req.name]
        assert got.tokens == alone.tokens, req
        assert got.logits == alone.logits, req  # the raw logits of every step, bit for bit
        assert got.logprobs == alone.logprobs, req


def test_a_seeded_sampled_request_repeats_under_load(model: LlamaCausalLM) -> None:
    """temperature 1, top-p 0.9: the same tokens and log-probabilities alone and among 7
    others arriving over its decode, twice."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, logprobs=3)
    target = Req("target", [5, 17, 33, 2, 90, 41], params, 0)
    load = [
        Req(
            f"load{i}",
            [(7 * i + j) % VOCAB for j in range(3 + 5 * i)],
            SamplingParams(temperature=0.8, seed=i, max_tokens=20),
            2 * i,
        )
        for i in range(7)
    ]
    config = KVCacheEngineConfig(
        block_size=4, num_blocks=48, max_num_batched_tokens=16, deterministic=True
    )
    alone = _alone(model, target)
    for _ in range(2):
        got = _serve(model, [target, *load], config)["target"]
        assert (got.tokens, got.logits, got.logprobs) == (
            alone.tokens,
            alone.logits,
            alone.logprobs,
        )
    assert len(set(alone.tokens)) > 3  # sampled, not stuck on one token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_threads_do_not_change_a_row(dtype: torch.dtype) -> None:
    """The same schedule on one thread and on two: the same bytes."""
    model = _model(dtype)
    reqs = [
        Req(f"r{i}", [(11 * i + j) % VOCAB for j in range(4 + 9 * i)], params, i)
        for i, params in enumerate(
            [
                SamplingParams(temperature=0.0, max_tokens=10),
                SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=10, logprobs=2),
                SamplingParams(temperature=0.7, seed=4, max_tokens=10, logprobs=1),
            ]
        )
    ]
    config = KVCacheEngineConfig(
        block_size=4, num_blocks=40, max_num_batched_tokens=12, deterministic=True
    )
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(_serve(model, reqs, config))
    finally:
        torch.set_num_threads(before)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("out_features", [48, 100])
def test_a_deterministic_product_computes_each_row_as_alone(
    dtype: torch.dtype, out_features: int
) -> None:
    """Tiled (outputs padded to whole tiles), bfloat16 on one instruction path at every row
    count: row i of a 1..40-row product is the product of row i alone. A head's slice gives the
    full head's logits of those ids."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, 64, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    linear = torch.nn.Linear(64, out_features).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    with deterministic_products():
        fused = FusedLinear.of([linear])
        head = FusedLinear.shared(weight)
        part = FusedLinear.shared(weight[20:37])
    assert fused.layout == head.layout == TILED and fused.deterministic
    x = torch.randn(40, 64, generator=gen).to(dtype)
    for rows in (1, 2, 3, 4, 5, 16, 17, 40):
        batch = fused(x[:rows])
        assert batch.shape == (rows, out_features)
        for i in range(rows):
            assert torch.equal(batch[i], fused(x[i : i + 1])[0])
    assert torch.equal(head(x)[:, 20:37], part(x))
    reference = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    if dtype == torch.bfloat16:  # one rounding of the float32 sum
        assert torch.allclose(fused(x).double(), reference, rtol=1e-2, atol=0.1)
    else:
        assert torch.allclose(fused(x).double(), reference, atol=1e-4)


def test_linears_a_model_calls_directly_become_deterministic() -> None:
    """`make_linears_deterministic` routes plain `nn.Linear`s through the tiles and leaves
    their weights (and another node's weights, still on the meta device) in place."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 5))
    with torch.device("meta"):
        elsewhere = torch.nn.Linear(8, 8)
    x = torch.randn(7, 8)
    expected = net(x)
    assert make_linears_deterministic(torch.nn.ModuleList([net, elsewhere])) == 2
    assert "forward" not in vars(elsewhere)
    got = net(x)
    assert torch.allclose(got, expected, atol=1e-5)
    assert all(torch.equal(got[i], net(x[i : i + 1])[0]) for i in range(7))
    assert net[0].weight is not None and net[0].weight.shape == (24, 8)


def test_the_fast_path_stays_the_default() -> None:
    """Outside `deterministic_products` nothing is deterministic; the engine's config says
    off unless asked."""
    fused = FusedLinear.of([torch.nn.Linear(16, 32)])
    assert not fused.deterministic
    assert not KVCacheEngineConfig().deterministic


async def test_forked_samples_give_the_bytes_of_lone_requests(model: LlamaCausalLM) -> None:
    """Parallel samples of one prompt fork its blocks copy-on-write: each sample's tokens and
    log-probabilities are those of the same request alone."""
    prompt = [(5 * i + 3) % VOCAB for i in range(14)]
    params = {
        f"s{i}": SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=i, logprobs=2)
        for i in range(3)
    }

    async def sample(inputs: dict[str, dict[str, Any]]) -> dict[str, list[Any]]:
        engine = KVNodeEngine("llm", GroupNode(model), None, "cpu", deterministic=True)
        got: dict[str, list[Any]] = {r: [] for r in inputs}
        engine.start()
        try:
            await asyncio.gather(*(engine.run(r, x, 1, got[r].append) for r, x in inputs.items()))
            await asyncio.gather(*(engine.run(r, x, 7, got[r].append) for r, x in inputs.items()))
        finally:
            await engine.aclose()
        return got

    grouped = await sample(
        {r: {"prompt": prompt, "params": p, "group": "g"} for r, p in params.items()}
    )
    for r, p in params.items():
        alone = await sample({r: {"prompt": prompt, "params": p}})
        assert grouped[r] == alone[r]
    assert len({tuple(o["token"] for o in out) for out in grouped.values()}) > 1


def test_a_deterministic_greedy_screen_decides_every_row_as_alone() -> None:
    """Rows the bfloat16 screen cannot decide (a flat head: too many candidates) take their own
    full product's argmax, one by one: never None, and each row's token is its token alone."""
    weight = torch.randn(600, 32, generator=torch.Generator().manual_seed(0))
    weight[:300] = weight[0]  # 300 ids tie exactly: rows near them cannot be screened
    if not can_screen(weight):
        pytest.skip("no bfloat16 products for the screen on this CPU")
    with deterministic_products():
        head = FusedLinear.shared(weight)
        screen = ScreenedArgmax(weight, full=head)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1))
    x[:4] = weight[0] * 3  # these rows favour the tied ids
    tokens = screen(x)
    assert tokens is not None
    assert tokens.tolist() == [int(screen(x[i : i + 1])[0]) for i in range(9)]  # type: ignore[index]
    assert tokens.tolist() == head(x).argmax(dim=1).tolist()
