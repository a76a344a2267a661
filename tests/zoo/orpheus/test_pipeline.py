"""The Orpheus pieces together, without the runtime: prompt, constrained LLM decode, streamed codec,
WAV."""

from __future__ import annotations

import wave
from pathlib import Path

import pytest
import torch

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.streaming import SlidingWindowChunkPolicy, StreamBuffer
from mstar.zoo.orpheus import (
    AudioLogitsProcessor,
    AudioStreamState,
    OrpheusConfig,
    OrpheusTokenizer,
    audio_codes,
    decode_chunks,
    get_orpheus_config,
    load_orpheus_codec,
    load_orpheus_llm,
    make_random_checkpoint,
    write_wav,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> OrpheusConfig:
    return make_random_checkpoint(
        get_orpheus_config("orpheus-tiny"), tmp_path_factory.mktemp("tiny")
    )


def test_two_requests_speak_through_the_engine_and_codec(
    tiny: OrpheusConfig, tmp_path: Path
) -> None:
    layout = tiny.layout
    tokenizer = OrpheusTokenizer(layout)
    engine = KVCacheEngine(
        load_orpheus_llm(tiny), KVCacheEngineConfig(num_blocks=64, max_model_len=512)
    )
    codec = load_orpheus_codec(tiny)
    texts = {"a": ("Hello there.", "tara", 47), "b": ("How are you today?", "leo", 30)}
    buffers: dict[str, StreamBuffer[int]] = {}
    states: dict[str, AudioStreamState] = {}
    generated: dict[str, list[int]] = {}
    audio: dict[str, list[torch.Tensor]] = {}
    for rid, (text, voice, max_tokens) in texts.items():
        prompt = tokenizer.format_prompt(text, voice=voice)
        params = SamplingParams(
            temperature=tiny.temperature,
            top_p=tiny.top_p,
            repetition_penalty=tiny.repetition_penalty,
            max_tokens=max_tokens,
            stop_token_ids=(layout.end_of_speech,),
            seed=len(rid),
        )
        engine.add_request(
            rid, prompt, params, logits_processor=AudioLogitsProcessor(layout, len(prompt))
        )
        buffers[rid] = StreamBuffer(SlidingWindowChunkPolicy(28, 7))
        states[rid] = AudioStreamState(noise_seed=len(rid))
        generated[rid], audio[rid] = [], []
    while engine.has_unfinished():
        pending = []
        for out in engine.step():
            buffers[out.request_id].put(out.new_token_ids)
            generated[out.request_id] += out.new_token_ids
            if out.finished:
                buffers[out.request_id].close()
            pending += [(out.request_id, chunk) for chunk in buffers[out.request_id].pop_ready()]
        results = decode_chunks(codec, layout, [(states[rid], chunk) for rid, chunk in pending])
        for (rid, _), result in zip(pending, results, strict=True):
            assert result.error is None
            states[rid] = result.state
            audio[rid].append(result.audio)
    for rid, (_, _, max_tokens) in texts.items():
        tokens = generated[rid]
        assert len(tokens) <= max_tokens and states[rid].is_done
        speech = tokens[:-1] if tokens[-1] == layout.end_of_speech else tokens
        audio_codes(layout, speech)  # constrained decoding kept every token at its position
        num_frames = len(speech) // 7
        samples = torch.cat(audio[rid])
        assert samples.shape == (2048 * num_frames,)
        path = write_wav(tmp_path / f"{rid}.wav", samples)
        with wave.open(str(path), "rb") as f:
            assert (f.getframerate(), f.getnframes()) == (24000, 2048 * num_frames)
