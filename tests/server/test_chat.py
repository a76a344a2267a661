"""Chat and completions (SSE streaming, usage, stop strings) on a tiny random Llama with a
byte-level tokenizer, through the official `openai` client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from tests.server.conftest import RunningServer

MODEL = "tiny-chat"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi: héllo €"},
]


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def prompt_ids(
    tokenizer: transformers.PreTrainedTokenizerFast, messages: list[dict[str, str]]
) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_chat_streamed_equals_chat_whole(
    llama_server: RunningServer, byte_tokenizer: transformers.PreTrainedTokenizerFast
) -> None:
    oa = client(llama_server)
    whole = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )  # type: ignore[arg-type]
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    text = "".join(deltas)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert text == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length"
    n_prompt = len(prompt_ids(byte_tokenizer, MESSAGES))
    for usage in (whole.usage, chunks[-1].usage):
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            n_prompt,
            12,
            n_prompt + 12,
        )
    # Only complete characters go out while the model runs (the end may flush a broken one).
    assert not any(d.endswith("\ufffd") for d in deltas[:-2])
    # The KV-cache engine's steps, per walk: each request prefilled once and sampled the rest in
    # decode.
    with httpx.Client(base_url=llama_server.url) as http:
        assert http.get("/metrics").status_code == 200
    inputs = {
        w: llama_server.metric("mstar_engine_walk_inputs_total", rank="0", node="llm", walk=w)
        for w in ("prefill", "decode")
    }
    assert inputs["prefill"] >= 2 and inputs["decode"] >= 2 * 11
    assert (
        llama_server.metric(
            "mstar_engine_walk_step_seconds_count", rank="0", node="llm", walk="decode"
        )
        >= 11
    )


def test_chat_text_is_the_detokenized_greedy_continuation(
    llama_server: RunningServer,
    tiny_llama_dir: Path,
    byte_tokenizer: transformers.PreTrainedTokenizerFast,
) -> None:
    with httpx.Client(base_url=llama_server.url) as http:
        native = http.post(
            "/generate",
            json={
                "prompt_token_ids": prompt_ids(byte_tokenizer, MESSAGES),
                "max_tokens": 10,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
    ids = [i for line in native.text.splitlines() for i in json.loads(line).get("token_ids", [])]
    assert len(ids) == 10
    chat = client(llama_server).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    assert chat.choices[0].message.content == byte_tokenizer.decode(ids, skip_special_tokens=True)
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompt = prompt_ids(byte_tokenizer, MESSAGES)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert out[0, len(prompt) :].tolist() == ids


def test_completions_and_stop_strings(llama_server: RunningServer) -> None:
    oa = client(llama_server)
    full = oa.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = full.choices[0].text
    assert (
        full.object == "text_completion"
        and full.usage is not None
        and full.usage.completion_tokens == 16
    )
    cut = next((text[i : i + 1] for i in range(2, len(text)) if text[i] != "\ufffd"), None)
    if cut is None:
        pytest.skip("the random model produced no usable stop character")
    stopped = oa.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=16,
        temperature=0,
        stop=[cut],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].text == text[: text.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = oa.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=16,
        temperature=0,
        stop=[cut],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[: text.index(cut)]
    assert llama_server.wait_idle() is not None and llama_server.state.admission.num_running == 0


def test_chat_errors_name_the_field(llama_server: RunningServer) -> None:
    oa = client(llama_server)
    with pytest.raises(openai.BadRequestError) as bad_role:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])  # type: ignore[list-item]
    assert bad_role.value.body["param"] == "messages.0.role"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad_temp:
        oa.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)  # type: ignore[arg-type]
    assert bad_temp.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as image_part:
        oa.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
            ],
        )
    assert image_part.value.body["param"] == "messages.0.content.0"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="top_k"):
        oa.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"top_k": -5})  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4o", messages=MESSAGES)  # type: ignore[arg-type]


def test_leaving_a_chat_stream_aborts_it_and_frees_its_kv_cache(
    llama_server: RunningServer,
) -> None:
    aborted = llama_server.metric(
        "mstar_requests_finished_total", task="generate", status="aborted"
    )
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=llama_server.url) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        events = response.iter_lines()
        assert next(events).startswith("data: ")  # the stream runs (thousands of tokens to go)
    held = llama_server.wait_idle()
    assert all(v == 0 for counts in held.values() for v in counts.values()), held
    assert "requests:llm" in held["rank0"]  # the KV cache was checked
    assert (
        llama_server.metric("mstar_requests_finished_total", task="generate", status="aborted")
        == aborted + 1
    )
