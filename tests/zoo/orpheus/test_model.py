"""Orpheus served by the runtime: streamed audio equals the pieces run by hand, in any placement."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.errors import WalkExecutionError
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Output, Placement, Request
from mstar.streaming import SlidingWindowChunkPolicy, StreamBuffer
from mstar.zoo.orpheus import (
    AudioLogitsProcessor,
    AudioStreamState,
    decode_chunks,
    get_orpheus_config,
    load_orpheus_codec,
    load_orpheus_llm,
    make_random_checkpoint,
)
from mstar.zoo.orpheus.model import OrpheusModel
from tests.helpers import wait_until_idle

TEXT = "Hello there, this is mstar speaking."
SPLIT = (
    "node_groups:\n  - {node_names: [LLM], ranks: [0]}\n  - {node_names: [snac_decoder], "
    "ranks: [1]}\n"
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cfg = make_random_checkpoint(
        get_orpheus_config("orpheus-tiny"), tmp_path_factory.mktemp("orpheus"), seed=5
    )
    assert cfg.llm_dir is not None and cfg.snac_dir is not None
    return {"checkpoint": str(cfg.llm_dir), "snac_dir": str(cfg.snac_dir)}


def expected_audio(
    dirs: dict[str, str], text: str, max_tokens: int, seed: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Run the pieces by hand: the engine to completion, then the 28/7 chunks through the codec."""
    cfg = get_orpheus_config("orpheus-tiny", llm_dir=dirs["checkpoint"], snac_dir=dirs["snac_dir"])
    model = OrpheusModel("orpheus-tiny", **dirs)
    prompt = model.tokenizer.format_prompt(text, "tara")
    engine = KVCacheEngine(
        load_orpheus_llm(cfg), KVCacheEngineConfig(num_blocks=64, max_model_len=512)
    )
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=cfg.repetition_penalty,
        top_p=cfg.top_p,
        max_tokens=max_tokens,
        stop_token_ids=(cfg.layout.end_of_speech,),
    )
    engine.add_request(
        "r", prompt, params, logits_processor=AudioLogitsProcessor(cfg.layout, len(prompt))
    )
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    buf: StreamBuffer[int] = StreamBuffer(SlidingWindowChunkPolicy(28, 7))
    buf.put(tokens)
    buf.close()
    codec = load_orpheus_codec(cfg)
    state = AudioStreamState(noise_seed=cfg.noise_seed + seed)
    audio = []
    for chunk in buf.pop_ready():
        (result,) = decode_chunks(codec, cfg.layout, [(state, chunk)])
        state = result.state
        if result.audio.numel():
            audio.append(result.audio)
    return tokens, audio


async def speak(engine: AsyncEngine, max_tokens: int, seed: int) -> list[Output]:
    data = {
        "text": TEXT,
        "voice": "tara",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
    }
    return await engine.run(Request("speech", data))


def assert_audio_equal(outputs: list[Output], audio: list[torch.Tensor]) -> None:
    got = [o.data for o in outputs if o.data.numel()]
    assert {o.modality for o in outputs} == {"audio"}
    assert len(got) == len(audio)
    for a, b in zip(got, audio, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("max_tokens", [20, 27, 28, 50, 91])
async def test_streamed_audio_equals_the_pieces_and_keeps_every_frame(
    dirs: dict[str, str], max_tokens: int
) -> None:
    tokens, audio = expected_audio(dirs, TEXT, max_tokens, seed=2)
    model = OrpheusModel(
        "orpheus-tiny", **dirs, codec_batch_size=1, engine_config={"num_blocks": 64}
    )
    async with await AsyncEngine.start(model, config=EngineConfig(offload_steps=False)) as engine:
        outputs = await speak(engine, max_tokens, seed=2)
    assert_audio_equal(outputs, audio)
    frames = sum(1 for t in tokens if t != model.config.layout.end_of_speech) // 7
    assert sum(o.data.numel() for o in outputs) == 2048 * frames  # every complete frame, once


def test_ignore_eos_masks_end_of_speech(dirs: dict[str, str]) -> None:
    """End of speech may close a request's audio only where it stops the request: with
    ``ignore_eos`` the constrained decoding masks it, so every request runs to ``max_tokens``
    (what a benchmark needs for equal work)."""
    model = OrpheusModel("orpheus-tiny", **dirs)
    node = model.submodule("LLM", torch.device("cpu"))
    eos = model.config.layout.end_of_speech
    for ignore in (False, True):
        request = Request("speech", {"text": TEXT, "ignore_eos": ignore})
        turn = node.turn("r", model.preprocess(request).inputs["LLM"], is_first=True)
        assert turn.logits_processor is not None
        ranges = turn.logits_processor.vocab_ranges(list(turn.new_token_ids))  # a frame boundary
        assert any(a <= eos < b for a, b in ranges) is not ignore


async def test_concurrent_requests_batch_and_stay_independent(dirs: dict[str, str]) -> None:
    runs = [(30, 1), (64, 2), (45, 3), (90, 4)]
    expected = [expected_audio(dirs, TEXT, n, s)[1] for n, s in runs]
    model = OrpheusModel(
        "orpheus-tiny", **dirs, codec_batch_size=1, engine_config={"num_blocks": 128}
    )
    async with await AsyncEngine.start(model) as engine:
        results = await asyncio.gather(*(speak(engine, n, s) for n, s in runs))
    for outputs, audio in zip(results, expected, strict=True):
        assert_audio_equal(outputs, audio)


async def test_llm_and_codec_in_separate_processes(dirs: dict[str, str]) -> None:
    _, audio = expected_audio(dirs, TEXT, 60, seed=7)
    spec = ModelSpec(
        "mstar.zoo.orpheus.model:OrpheusModel",
        {"config": "orpheus-tiny", **dirs, "codec_batch_size": 1},
    )
    config = EngineConfig(worker_processes=True)
    async with await AsyncEngine.start(spec, Placement.from_yaml(SPLIT), config) as engine:
        outputs = await speak(engine, 60, seed=7)
        assert_audio_equal(outputs, audio)
        await wait_until_idle(engine)


async def test_invalid_audio_tokens_fail_the_request_clearly(dirs: dict[str, str]) -> None:
    model = OrpheusModel("orpheus-tiny", **dirs, constrained=False)
    async with await AsyncEngine.start(model) as engine:
        with pytest.raises(
            WalkExecutionError, match=r"node 'snac_decoder', walk 'snac_chunk'"
        ) as info:
            await speak(engine, 80, seed=0)
        assert "AudioTokenError" in str(info.value)
        with pytest.raises(ValueError, match="unknown Orpheus voice"):
            await engine.run(Request("speech", {"text": "hi", "voice": "nobody"}))


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="does not exist"):
        OrpheusModel(
            "orpheus-3b", checkpoint=str(tmp_path / "nope"), snac_dir=str(tmp_path / "nope2")
        )


PD_SPLIT = """
node_groups:
  - {node_names: [LLM], ranks: [0], graph_walks: [prefill]}
  - {node_names: [LLM], ranks: [1], graph_walks: [decode]}
  - {node_names: [snac_decoder], ranks: [1]}
"""


async def test_prefill_and_decode_on_different_ranks(dirs: dict[str, str]) -> None:
    _, audio = expected_audio(dirs, TEXT, 50, seed=3)
    model = OrpheusModel(
        "orpheus-tiny", **dirs, codec_batch_size=1, engine_config={"num_blocks": 64}
    )
    async with await AsyncEngine.start(model, Placement.from_yaml(PD_SPLIT)) as engine:
        assert_audio_equal(await speak(engine, 50, seed=3), audio)
