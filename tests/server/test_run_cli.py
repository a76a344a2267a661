"""`mstar run` on text models: the chat template for instruct models, the task by default,
the answer on standard output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mstar.cli import main
from tests.server.models import save_tiny_chat_llama


def _greedy(path: Path, prompt: list[int], num_tokens: int) -> list[int]:
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    ids = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [int(i) for i in ids[0, len(prompt) :]]


def test_run_sends_a_chat_to_an_instruct_model_without_a_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = save_tiny_chat_llama(tmp_path / "llama")
    assert (
        main(
            [
                "run",
                str(path),
                "--text",
                "Why?",
                "--param",
                "max_tokens=5",
                "--param",
                "ignore_eos=true",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Why?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # Greedy by default: the same answer as transformers' greedy decoding of the chat prompt.
    assert out == tokenizer.decode(_greedy(path, prompt, 5), skip_special_tokens=True) + "\n"


def test_run_needs_a_task_only_when_the_model_has_several(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "toy-composite", "--text", "x"]) == 2
    assert (
        "has several tasks: choose one with --task (speech, image, image_edit)"
        in capsys.readouterr().err
    )


@pytest.mark.slow
def test_run_answers_a_question_with_smollm2(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        from mstar.zoo.smollm2 import smollm2_checkpoint_dir

        smollm2_checkpoint_dir()
    except Exception as exc:  # the weights package is not installed here
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")
    assert main(["run", "smollm2-135m", "--text", "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out, captured.out
    assert "tokens in" in captured.err
