"""The text API users expect from a vLLM-style server, on a tiny random Llama whose KV cache
holds 128 tokens: length checks before any token, log-probabilities, parallel samples,
seeds, penalties, streamed usage, and a 400 naming the field for every bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from mstar.runtime.model import ModelSpec
from tests.server.conftest import RunningServer, running_server

MODEL = "tiny-chat"
CACHE_TOKENS = 128  # 8 blocks of 16
MESSAGES = [{"role": "user", "content": "Say hi"}]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[RunningServer]:
    spec = ModelSpec(
        "mstar.zoo.llm:TextLLM",
        {"checkpoint": str(tiny_llama_dir), "name": MODEL, "engine_config": {"num_blocks": 8}},
    )
    with running_server(spec, names=(MODEL,)) as running:
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_ids(
    tokenizer: transformers.PreTrainedTokenizerFast, messages: list[dict[str, str]]
) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


# --- lengths ---------------------------------------------------------------------------------


def test_max_tokens_past_the_cache_is_a_400_before_any_token(
    server: RunningServer, byte_tokenizer: transformers.PreTrainedTokenizerFast
) -> None:
    room = CACHE_TOKENS - len(chat_ids(byte_tokenizer, MESSAGES))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for stream in (False, True):
            body = {"messages": MESSAGES, "max_tokens": room + 1, "stream": stream}
            answer = http.post("/v1/chat/completions", json=body)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
            assert f"at most {room}" in error["message"]
        body = {"messages": MESSAGES, "max_completion_tokens": room + 1}
        assert (
            http.post("/v1/chat/completions", json=body).json()["error"]["param"]
            == "max_completion_tokens"
        )
        long_prompt = http.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 1})
        assert long_prompt.status_code == 400 and long_prompt.json()["error"]["param"] == "prompt"
    fits = client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=room, temperature=0, extra_body=IGNORE_EOS
    )  # type: ignore[arg-type]
    assert fits.usage is not None and fits.usage.completion_tokens == room


def test_missing_max_tokens_runs_to_the_models_length(server: RunningServer) -> None:
    prompt = list(range(10, 40))
    done = client(server).completions.create(
        model=MODEL, prompt=prompt, temperature=0, extra_body=IGNORE_EOS
    )
    assert done.usage is not None and done.usage.completion_tokens == CACHE_TOKENS - len(prompt)
    assert done.choices[0].finish_reason == "length"


def test_native_generate_refuses_what_cannot_fit_before_streaming(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        answer = http.post(
            "/generate", json={"prompt_token_ids": [1, 2, 3], "max_tokens": CACHE_TOKENS}
        )
    assert answer.status_code == 400 and "max_tokens" in answer.json()["error"]["message"]


# --- log-probabilities -----------------------------------------------------------------------


def test_chat_logprobs_are_the_models_and_name_their_bytes(
    server: RunningServer,
    tiny_llama_dir: Path,
    byte_tokenizer: transformers.PreTrainedTokenizerFast,
) -> None:
    oa = client(server)
    whole = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=IGNORE_EOS,  # type: ignore[arg-type]
    )
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    prompt = chat_ids(byte_tokenizer, MESSAGES)
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    assert content[0].logprob == pytest.approx(float(first.max()), abs=1e-4)
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[
            0
        ].logprob == pytest.approx(entry.logprob)
        assert (
            entry.top_logprobs[0].logprob
            >= entry.top_logprobs[1].logprob
            >= entry.top_logprobs[2].logprob
        )
    assert content[0].bytes == [int(first.argmax())]  # ids 0-255 are the bytes themselves
    # The bytes of the tokens are the answer's bytes (byte-level tokens are bytes).
    text = whole.choices[0].message.content or ""
    assert b"".join(bytes(e.bytes or []) for e in content).decode("utf-8", errors="replace") == text
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body=IGNORE_EOS,  # type: ignore[arg-type]
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    # Equal up to float rounding: another request may share a step (batched matmuls round
    # differently).
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    plain = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, extra_body=IGNORE_EOS
    )  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_completion_logprobs_have_the_legacy_shape(server: RunningServer) -> None:
    oa = client(server)
    done = oa.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body=IGNORE_EOS,
    )
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    )
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(
        top is not None and len(top) <= 2 and max(top.values()) == pytest.approx(x)
        for top, x in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    with httpx.Client(base_url=server.url, timeout=30) as http:
        native = http.post(
            "/generate",
            json={
                "prompt": "Once upon",
                "max_tokens": 2,
                "temperature": 0,
                "logprobs": 1,
                "ignore_eos": True,
            },
        )
    lines = [json.loads(line) for line in native.text.splitlines()]
    assert [line["logprobs"]["logprob"] for line in lines if "logprobs" in line] == pytest.approx(
        lp.token_logprobs[:2]
    )


# --- choices, seeds, penalties, usage --------------------------------------------------------


def test_n_choices_are_seeded_one_by_one_and_stream_interleaved(server: RunningServer) -> None:
    oa = client(server)
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        "extra_body": IGNORE_EOS,
    }
    three = oa.chat.completions.create(n=3, **args)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) > 1  # each choice draws on its own
    assert [
        c.message.content for c in oa.chat.completions.create(n=3, **args).choices
    ] == texts  # reproducible
    assert (
        oa.chat.completions.create(n=1, **args).choices[0].message.content == texts[0]
    )  # choice 0 draws from the seed
    assert three.usage is not None and three.usage.completion_tokens == 18
    chunks = list(
        oa.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **args)
    )
    streamed = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
    assert sorted(
        c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason
    ) == [0, 1, 2]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage is not None
        and chunks[-1].usage.completion_tokens == 18
    )
    greedy = oa.completions.create(
        model=MODEL, prompt="Once", n=2, max_tokens=6, temperature=0, extra_body=IGNORE_EOS
    )
    alone = oa.completions.create(
        model=MODEL, prompt="Once", max_tokens=6, temperature=0, extra_body=IGNORE_EOS
    )
    assert [c.text for c in greedy.choices] == [alone.choices[0].text] * 2
    assert server.wait_idle() is not None and server.state.admission.num_running == 0


def test_seeds_reproduce_and_differ(server: RunningServer) -> None:
    oa = client(server)

    def sample(seed: int) -> str | None:
        done = oa.completions.create(
            model=MODEL,
            prompt="Once",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body=IGNORE_EOS,
        )
        return done.choices[0].text

    assert sample(1) == sample(1)
    assert len({sample(1), sample(2), sample(3)}) > 1


def test_frequency_and_presence_penalties_steer_greedy_decoding(server: RunningServer) -> None:
    oa = client(server)

    def complete(**extra: float) -> str:
        done = oa.completions.create(
            model=MODEL, prompt="Once", max_tokens=24, temperature=0, extra_body=IGNORE_EOS, **extra
        )  # type: ignore[arg-type]
        return done.choices[0].text

    plain = complete()
    assert complete(frequency_penalty=0.0, presence_penalty=0.0) == plain
    assert complete(frequency_penalty=2.0) != plain
    assert complete(presence_penalty=2.0) != plain


def test_stop_strings_cut_every_choice_in_streams(server: RunningServer) -> None:
    oa = client(server)
    args: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Once upon",
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": IGNORE_EOS,
    }
    text = oa.completions.create(**args).choices[0].text
    cut = next((text[i] for i in range(2, len(text)) if text[i] != "\ufffd"), None)
    if cut is None:
        pytest.skip("the random model produced no usable stop character")
    expected = text[: text.index(cut)]
    streamed = ["", ""]
    for chunk in oa.completions.create(n=2, stop=[cut], stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [expected, expected]


# --- every bad input is a 400 naming its field ----------------------------------------------

BAD_CHAT = [
    (b'"seed": [1]', "seed"),
    (b'"seed": {}', "seed"),
    (b'"seed": Infinity', "seed"),
    (b'"seed": 18446744073709551616', "seed"),
    (b'"seed": -9223372036854775809', "seed"),
    (b'"seed": 1.5', "seed"),
    (b'"temperature": "hot"', "temperature"),
    (b'"temperature": NaN', "temperature"),
    (b'"top_k": " "', "top_k"),
    (b'"top_p": "NaN"', "top_p"),
    (b'"top_p": -Infinity', "top_p"),
    (b'"max_tokens": true', "max_tokens"),
    (b'"max_tokens": 100000', "max_tokens"),
    (b'"n": 0', "n"),
    (b'"presence_penalty": 3', "presence_penalty"),
    (b'"logprobs": true, "top_logprobs": 21', "top_logprobs"),
    (b'"top_logprobs": 2', "top_logprobs"),
    (b'"stop": ["\\ud800"]', "stop.0"),
    (b'"model": "\\udc00x"', "model"),
]


@pytest.mark.parametrize(("field", "param"), BAD_CHAT, ids=[f.decode() for f, _ in BAD_CHAT])
def test_bad_chat_fields_are_400s_naming_the_field(
    server: RunningServer, field: bytes, param: str
) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], ' + field + b"}"
    answer = _post(server, "/v1/chat/completions", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


BAD_TEXT = [
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfffb"}]}]}',
        "messages.0.content.0.text",
    ),
    ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\ud800"]}', "prompt.1"),
    ("/v1/completions", b'{"prompt": "hi", "seed": [1]}', "seed"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 21}', "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 200}', "max_tokens"),
    ("/generate", b'{"prompt": "\\ud800"}', "prompt"),
    ("/generate", b'{"data": {"prompt": "\\ud800"}}', "data.prompt"),
    ("/generate", b'{"prompt": "hi", "seed": [1]}', "seed"),
    ("/generate", b'{"prompt": "hi", "seed": null}', "seed"),
    ("/generate", b'{"prompt": "hi", "seed": {}}', "seed"),
    ("/generate", b'{"prompt": "hi", "seed": Infinity}', "seed"),
    ("/generate", b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    ("/generate", b'{"prompt": "hi", "data": {"seed": "1"}}', "data.seed"),
    ("/generate", b'{"prompt": "hi", "temperature": "hot"}', "temperature"),
    ("/generate", b'{"prompt": "hi", "top_k": " "}', "top_k"),
    ("/generate", b'{"prompt": "hi", "top_p": "NaN"}', "top_p"),
    ("/generate", b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    ("/generate", b'{"prompt": "hi", "logprobs": 50}', "logprobs"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), BAD_TEXT, ids=[f"{p} {b.decode()}" for p, b, _ in BAD_TEXT]
)
def test_bad_bodies_are_400s_naming_the_field(
    server: RunningServer, path: str, body: bytes, param: str
) -> None:
    answer = _post(server, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_a_null_seed_is_no_seed_as_openai_allows(server: RunningServer) -> None:
    answer = _post(
        server,
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": null}',
    )
    assert answer.status_code == 200, answer.text


def _post(server: RunningServer, path: str, body: bytes) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        return http.post(path, content=body, headers={"content-type": "application/json"})
