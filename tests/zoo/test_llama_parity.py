"""Parity of the paged Llama decoder in `KVCacheEngine` with transformers' `LlamaForCausalLM`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.zoo.hf_checkpoint import save_state_dict
from mstar.zoo.llama import LlamaCausalLM, LlamaConfig, load_llama

NUM_STEPS = 64
MAX_BATCH = 16


def _hf_config(**overrides: object) -> HFLlamaConfig:
    fields: dict[str, object] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        # Larger than the default 0.02 so that greedy choices are not near-ties.
        "initializer_range": 0.15,
        # No EOS: transformers' generate must not stop or suppress any token.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    fields.update(overrides)
    return HFLlamaConfig(**fields)


def _prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _hf_reference(
    hf: HFLlamaForCausalLM, prompt: list[int], steps: int
) -> tuple[list[int], torch.Tensor]:
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits, dim=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    torch.manual_seed(0)
    hf_config = _hf_config()
    hf = HFLlamaForCausalLM(hf_config).eval()
    checkpoint = tmp_path_factory.mktemp("tiny-llama")
    save_state_dict(hf.state_dict(), checkpoint, hf_config.to_dict())
    prompts = _prompts(MAX_BATCH, hf_config.vocab_size)
    with torch.inference_mode():
        refs = [_hf_reference(hf, p, NUM_STEPS) for p in prompts]
    return {"checkpoint": checkpoint, "prompts": prompts, "refs": refs}


def _run_engine(
    model: LlamaCausalLM, prompts: list[list[int]], config: KVCacheEngineConfig
) -> tuple[KVCacheEngine, dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    engine = KVCacheEngine(model, config)
    engine.return_logits = True
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams.greedy(max_tokens=NUM_STEPS))
        tokens[str(i)], logits[str(i)] = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            assert out.logits is not None
            logits[out.request_id].append(out.logits)
    return engine, tokens, logits


@pytest.mark.parametrize("batch_size", [1, 3, 8, 16])
@pytest.mark.parametrize("preempt", [False, True], ids=["no-preemption", "preemption"])
def test_greedy_tokens_and_logits_match_transformers(
    tiny: dict[str, object], batch_size: int, preempt: bool
) -> None:
    model = load_llama(tiny["checkpoint"])  # type: ignore[arg-type]
    prompts: list[list[int]] = tiny["prompts"][:batch_size]  # type: ignore[index]
    refs: list[tuple[list[int], torch.Tensor]] = tiny["refs"][:batch_size]  # type: ignore[index]
    longest = max(len(p) for p in prompts) + NUM_STEPS
    # With preemption: room for about two full sequences, so larger batches must preempt.
    num_blocks = 2 * (-(-longest // 4)) if preempt else 1024
    config = KVCacheEngineConfig(
        block_size=4, num_blocks=num_blocks, max_num_batched_tokens=40, max_num_seqs=16
    )
    engine, tokens, logits = _run_engine(model, prompts, config)
    if preempt and batch_size > 2:
        assert engine.scheduler.num_preemptions > 0
    for i, (ref_tokens, ref_logits) in enumerate(refs):
        assert tokens[str(i)] == ref_tokens, f"request {i}"
        got = torch.stack(logits[str(i)])
        torch.testing.assert_close(got, ref_logits, atol=2e-4, rtol=1e-4)
    # Nothing is left behind.
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert engine.num_requests == 0


@pytest.mark.parametrize("batch_size", [1, 16])
def test_greedy_tokens_without_logits_match_transformers(
    tiny: dict[str, object], batch_size: int
) -> None:
    # No logits asked: greedy rows take the model's own argmax (`SupportsGreedyTokens`; on a
    # CPU with bfloat16 products, a bfloat16 screen decided in float32).
    model = load_llama(tiny["checkpoint"])  # type: ignore[arg-type]
    prompts: list[list[int]] = tiny["prompts"][:batch_size]  # type: ignore[index]
    refs: list[tuple[list[int], torch.Tensor]] = tiny["refs"][:batch_size]  # type: ignore[index]
    engine = KVCacheEngine(
        model, KVCacheEngineConfig(block_size=4, num_blocks=1024, max_num_seqs=16)
    )
    got = engine.generate(prompts, SamplingParams.greedy(max_tokens=NUM_STEPS))
    assert got == [ref_tokens for ref_tokens, _ in refs]


def _decided_steps(logits: torch.Tensor) -> int:
    """Return how many steps come before the first whose top two logits lie within a bfloat16
    ulp."""
    top2 = logits.float().reshape(len(logits), -1).topk(2, dim=-1).values
    ulp = torch.exp2(torch.floor(torch.log2(top2[:, 0].abs())) - 7)
    close = (top2[:, 0] - top2[:, 1] <= ulp).nonzero()
    return int(close[0]) if len(close) else len(logits)


@pytest.mark.parametrize("batch_size", [1, 16])
def test_bfloat16_greedy_tokens_match_transformers_in_bfloat16(
    tiny: dict[str, object], batch_size: int
) -> None:
    # bfloat16 weights and cache (products accumulate in float32) on both sides. Their
    # rounding differs, so a step whose two best logits are at most an ulp apart may go
    # either way: tokens must match up to the first such step of each prompt.
    steps = 16
    prompts: list[list[int]] = tiny["prompts"][:batch_size]  # type: ignore[index]
    hf = HFLlamaForCausalLM.from_pretrained(str(tiny["checkpoint"]), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        refs = [_hf_reference(hf, p, steps) for p in prompts]
    model = load_llama(tiny["checkpoint"], dtype=torch.bfloat16)  # type: ignore[arg-type]
    engine = KVCacheEngine(
        model, KVCacheEngineConfig(block_size=4, num_blocks=1024, max_num_seqs=16)
    )
    got = engine.generate(prompts, SamplingParams.greedy(max_tokens=steps))
    decided = [_decided_steps(ref_logits) for _, ref_logits in refs]
    for tokens, (ref_tokens, _), n in zip(got, refs, decided, strict=True):
        assert tokens[:n] == ref_tokens[:n]
    # Not a vacuous test: a good share of the steps are decided (how many depends on the
    # reference's own rounding, which differs between CPUs: 47 % of them on AVX2, more on AVX-512).
    assert sum(decided) >= steps * len(prompts) // 3


def test_a_bfloat16_head_takes_each_rows_first_maximum_of_its_logits(
    tiny: dict[str, object],
) -> None:
    # No screen for a bfloat16 head: greedy rows take the full product's first maximum, as the
    # sampler would (ties, which rounding every logit to bfloat16 makes likely, included).
    model = load_llama(tiny["checkpoint"], dtype=torch.bfloat16)  # type: ignore[arg-type]
    hidden = torch.randn(
        16, model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    ).bfloat16()
    hidden[5] = 0  # every logit 0: id 0 wins
    with torch.inference_mode():
        tokens = model.greedy_tokens(hidden)
        logits = model.compute_logits(hidden).float()
    expected = [int((row == row.max()).nonzero()[0, 0]) for row in logits]
    assert tokens is not None and tokens.tolist() == expected and expected[5] == 0


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
        {"num_key_value_heads": 4, "head_dim": 32, "attention_bias": True, "mlp_bias": True},
        {"num_key_value_heads": 1},
    ],
    ids=["tied", "llama3-rope", "linear-rope", "mha-bias-headdim", "mqa"],
)
def test_architecture_variants_match_transformers(
    tmp_path: Path, overrides: dict[str, object]
) -> None:
    torch.manual_seed(1)
    hf_config = _hf_config(**overrides)
    hf = HFLlamaForCausalLM(hf_config).eval()
    save_state_dict(hf.state_dict(), tmp_path, hf_config.to_dict())
    model = load_llama(tmp_path)
    prompts = _prompts(3, hf_config.vocab_size, seed=3)
    steps = 24
    with torch.inference_mode():
        refs = [_hf_reference(hf, p, steps) for p in prompts]
    engine = KVCacheEngine(model, KVCacheEngineConfig(block_size=8, num_blocks=64))
    got = engine.generate(prompts, SamplingParams.greedy(max_tokens=steps))
    assert got == [r[0] for r in refs]


def test_config_reads_both_transformers_layouts() -> None:
    v5 = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 5.0, "factor": 2.0},
    }
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4 |= {"rope_theta": 5.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    a, b = LlamaConfig.from_hf(v5), LlamaConfig.from_hf(v4)
    assert a.rope_theta == b.rope_theta == 5.0
    assert a.num_key_value_heads == 2 and a.head_dim == 4
    assert a.rope_scaling is not None and a.rope_scaling["factor"] == 2.0


@pytest.mark.parametrize("tied", [False, True])
def test_logits_in_ranges_equal_the_full_head_there(
    tiny: dict[str, object], tmp_path: Path, tied: bool
) -> None:
    checkpoint = tiny["checkpoint"]
    if tied:
        torch.manual_seed(3)
        config = _hf_config(tie_word_embeddings=True)
        checkpoint = tmp_path / "tied"
        hf = HFLlamaForCausalLM(config)
        state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        save_state_dict(state, checkpoint, config.to_dict())
    model = load_llama(checkpoint)
    hidden = torch.randn(5, model.config.hidden_size)
    ranges = [[(3, 40)], [(0, 1), (50, 90)], [(3, 40)], [(10, 11)], [(0, 1), (50, 90)]]
    with torch.inference_mode():
        full = model.compute_logits(hidden)
        part = model.compute_logits_in(hidden, ranges)
    for row, row_ranges in enumerate(ranges):
        allowed = torch.zeros(full.shape[1], dtype=torch.bool)
        for start, end in row_ranges:
            allowed[start:end] = True
        torch.testing.assert_close(part[row, allowed], full[row, allowed], rtol=1e-5, atol=1e-5)
        assert torch.isinf(part[row, ~allowed]).all()
