"""What the text API asks of sampling: validated params, OpenAI's presence and frequency
penalties, log-probabilities, and parallel samples of one prompt forking its KV blocks."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, Sampler, SamplingParams, Sequence
from mstar.engines.kv_node import KVNodeEngine
from mstar.engines.sampler import TokenLogprobs
from mstar.errors import InvalidSamplingParamsError, KVCacheCapacityError
from mstar.zoo.llama import LlamaCausalLM
from tests.helpers import make_sequence

from .conftest import GroupNode, make_tiny_llama

# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", [1]),
        ("seed", {}),
        ("seed", math.inf),
        ("seed", 1.5),
        ("seed", True),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("temperature", "hot"),
        ("temperature", math.nan),
        ("top_k", " "),
        ("top_k", 2.0),
        ("top_p", "NaN"),
        ("top_p", math.nan),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("max_tokens", True),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=field):
        SamplingParams(**{field: value})


def test_seeds_take_the_whole_64_bit_range() -> None:
    for seed in (-(2**63), 0, 2**64 - 1):
        assert SamplingParams(seed=seed).seed == seed


# --- penalties and log-probabilities ---------------------------------------------------------


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    params = SamplingParams(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=1.5, prompt_len=2
    )
    # Prompt [4, 4] does not count; generated 4, 3, 3 do.
    seq = make_sequence([4, 4, 4, 3, 3], params, walk_start=5)
    got = Sampler._apply_presence_frequency(logits.clone(), [seq])
    expected = torch.tensor([[1.0, 2.0, 3.0, 4.0 - 0.5 - 2 * 1.5, 5.0 - 0.5 - 1.5]])
    torch.testing.assert_close(got, expected)
    # Without prompt_len, the tokens of the current walk count.
    seq = make_sequence(
        [0, 1, 2], SamplingParams(temperature=0.0, presence_penalty=1.0), walk_start=2
    )
    torch.testing.assert_close(
        Sampler._apply_presence_frequency(logits.clone(), [seq]),
        logits - torch.tensor([0, 0, 1.0, 0, 0]),
    )


def test_a_penalty_changes_the_greedy_pick_and_zero_changes_nothing() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9]])
    plain = make_sequence([1, 1], SamplingParams(temperature=0.0), walk_start=1)
    assert Sampler()(logits.clone(), [plain]).tolist() == [1]
    penalised = make_sequence(
        [1, 1], SamplingParams(temperature=0.0, frequency_penalty=0.2, prompt_len=1), walk_start=1
    )
    assert Sampler()(logits.clone(), [penalised]).tolist() == [2]


def test_logprobs_are_the_raw_distribution_and_keep_greedy_picks() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.3),
    ]
    seqs = [Sequence(str(i), [5, 6], p, arrival=i) for i, p in enumerate(params)]
    plain = Sampler()(
        logits.clone(),
        [
            Sequence(
                str(i),
                [5, 6],
                SamplingParams(temperature=0.0, repetition_penalty=p.repetition_penalty),
                arrival=i,
            )
            for i, p in enumerate(params)
        ],
    )
    tokens = Sampler()(logits.clone(), seqs)
    assert torch.equal(tokens, plain)  # asking for log-probabilities never changes a pick
    reference = logits.log_softmax(-1)
    (first,) = seqs[0].logprobs
    assert first.token_id == int(tokens[0])
    assert first.logprob == pytest.approx(float(reference[0, tokens[0]]))
    top = reference[0].topk(3)
    assert list(first.top_token_ids) == top.indices.tolist()
    assert list(first.top_logprobs) == pytest.approx(top.values.tolist())
    assert seqs[1].logprobs == []
    (third,) = seqs[2].logprobs
    assert third.top_token_ids == () and third.logprob == pytest.approx(
        float(reference[2, tokens[2]])
    )
    assert TokenLogprobs.from_dict(first.to_dict()) == first


# --- parallel samples fork the prompt's blocks -----------------------------------------------


@pytest.fixture(scope="module")
def model() -> LlamaCausalLM:
    return make_tiny_llama(vocab_size=64)


async def _sample(
    engine: KVNodeEngine, inputs: dict[str, dict[str, Any]], max_tokens: int
) -> dict[str, list[Any]]:
    """Run requests (their inputs by id) at once: a one-step "prefill", then a "decode"."""
    got: dict[str, list[Any]] = {r: [] for r in inputs}
    await asyncio.gather(*(engine.run(r, x, 1, got[r].append) for r, x in inputs.items()))
    await asyncio.gather(
        *(engine.run(r, x, max_tokens - 1, got[r].append) for r, x in inputs.items())
    )
    return got


def _counting(engine: KVNodeEngine) -> list[int]:
    """Record the tokens each step computes."""
    computed: list[int] = []
    execute = engine.engine.runner.execute

    def counted(out: Any, **kwargs: Any) -> Any:
        computed.append(sum(item.num_tokens for item in out.scheduled))
        return execute(out, **kwargs)

    engine.engine.runner.execute = counted  # type: ignore[method-assign]
    return computed


async def test_samples_of_one_prompt_share_its_blocks_and_match_lone_requests(
    model: LlamaCausalLM,
) -> None:
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks and a partial one
    params = {
        f"s{i}": SamplingParams(temperature=1.0, max_tokens=6, seed=i, logprobs=2) for i in range(3)
    }
    shared = KVNodeEngine("llm", GroupNode(model), None, "cpu")
    computed = _counting(shared)
    shared.start()
    try:
        grouped = await _sample(
            shared, {r: {"prompt": prompt, "params": p, "group": "g"} for r, p in params.items()}, 6
        )
        held = shared.engine.num_requests
    finally:
        await shared.aclose()
    for r, p in params.items():
        alone = KVNodeEngine("llm", GroupNode(model), None, "cpu")
        alone.start()
        try:
            single = await _sample(alone, {r: {"prompt": prompt, "params": p}}, 6)
        finally:
            await alone.aclose()
        assert [o["token"] for o in grouped[r]] == [o["token"] for o in single[r]]
        assert [o["logprobs"].token_id for o in grouped[r]] == [o["token"] for o in grouped[r]]
    # The prompt but its last token was computed once; then each sample its last prompt token
    # and its 5 decode inputs.
    assert sum(computed) == 13 + 3 * 1 + 3 * 5
    assert held == 3  # the shared prompt was dropped once forked


async def test_a_sample_released_before_the_fork_is_skipped(model: LlamaCausalLM) -> None:
    engine = KVNodeEngine("llm", GroupNode(model), None, "cpu")
    inputs = {"prompt": list(range(1, 10)), "params": SamplingParams.greedy(4), "group": "g"}
    first = asyncio.ensure_future(engine.run("a", inputs, 1, lambda out: None))
    second = asyncio.ensure_future(engine.run("b", inputs, 1, lambda out: None))
    await asyncio.sleep(0)
    engine.release("b")  # before the engine ever ran a step
    engine.start()
    try:
        await first
        with pytest.raises(Exception, match="aborted"):
            await second
        engine.release("a")
        for _ in range(100):
            if engine.engine.num_requests == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.engine.num_requests == 0
        assert engine.engine.block_manager.num_free_blocks == engine.engine.num_blocks
    finally:
        await engine.aclose()


def test_a_request_longer_than_the_cache_is_refused_before_it_runs(model: LlamaCausalLM) -> None:
    engine = KVCacheEngine(model, KVCacheEngineConfig(block_size=4, num_blocks=8))
    assert engine.max_seq_len == 32
    engine.check_length("ok", 10, 22)
    with pytest.raises(KVCacheCapacityError, match="capacity is 32 tokens"):
        engine.check_length("big", 10, 23)


async def test_a_walk_that_could_not_finish_fails_before_its_first_token(
    model: LlamaCausalLM,
) -> None:
    engine = KVNodeEngine("llm", GroupNode(model, num_blocks=8), None, "cpu")
    engine.start()
    tokens: list[Any] = []
    try:
        with pytest.raises(KVCacheCapacityError, match="needs up to 40 tokens"):
            await engine.run(
                "r",
                {"prompt": list(range(1, 11)), "params": SamplingParams.greedy(30)},
                1,
                tokens.append,
            )
    finally:
        await engine.aclose()
    assert tokens == []


async def test_seeded_walks_draw_anew_and_the_same_on_any_rank(model: LlamaCausalLM) -> None:
    prompt = list(range(3, 12))
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    together = KVNodeEngine("llm", GroupNode(model), None, "cpu")
    together.start()
    try:
        both = await _sample(together, {"r": {"prompt": prompt, "params": params}}, 8)
    finally:
        await together.aclose()
    tokens = [o["token"] for o in both["r"]]
    prefill, decode = (KVNodeEngine("llm", GroupNode(model), None, "cpu") for _ in range(2))
    for engine in (prefill, decode):
        engine.start()
    try:
        first: list[Any] = []
        await prefill.run("r", {"prompt": prompt, "params": params}, 1, first.append)
        rest: list[Any] = []  # another rank: the cache is rebuilt from the history
        history = [*prompt, first[0]["token"]]
        await decode.run(
            "r",
            {"prompt": history, "params": params.replace(max_tokens=7)},
            7,
            rest.append,
        )
    finally:
        await prefill.aclose()
        await decode.aclose()
    assert [o["token"] for o in first + rest] == tokens
