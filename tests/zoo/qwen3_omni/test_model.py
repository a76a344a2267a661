"""Qwen3-Omni served by the runtime: text, talker codes and audio equal the stage-by-stage pipeline
and transformers.

The pipeline (`mstar.zoo.qwen3_omni.pipeline`) is itself held to transformers by the parity
tests; here the graph (streamed thinker -> talker -> Code2Wav, batched across requests, in
any placement) must give the same tokens, codes and samples as it, and as transformers'
``generate`` on an audio prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar.baselines import qwen3_omni as pipeline
from mstar.engines.interfaces import FiringRows
from mstar.engines.kv_engine import KVCacheEngine
from mstar.graph import run_reference
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Output, Request
from mstar.zoo.qwen3_omni.checkpoint import load_qwen3_omni, make_random_checkpoint
from mstar.zoo.qwen3_omni.config import get_qwen3_omni_config
from mstar.zoo.qwen3_omni.model import Qwen3OmniModel
from mstar.zoo.qwen3_omni.modules.encoders import embed_prompt, encode_audio
from mstar.zoo.qwen3_omni.modules.sampling import TALKER_GREEDY, TALKER_SAMPLING
from mstar.zoo.qwen3_omni.modules.weights import Qwen3OmniWeights
from mstar.zoo.qwen3_omni.prompt import audio_features

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = "qwen3-omni-tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        get_qwen3_omni_config(CONFIG), tmp_path_factory.mktemp("qwen3_omni") / "tiny", seed=0
    )


@pytest.fixture(scope="module")
def weights(checkpoint: Path) -> Qwen3OmniWeights:
    return load_qwen3_omni(checkpoint, get_qwen3_omni_config(CONFIG))


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> Qwen3OmniModel:
    return Qwen3OmniModel(CONFIG, checkpoint=str(checkpoint), codec_batch_size=1)


def _wave(seconds: float, seed: int) -> Any:
    return (
        torch.randn(int(16_000 * seconds), generator=torch.Generator().manual_seed(seed)).numpy()
        * 0.1
    )


REQUESTS: list[dict[str, Any]] = [
    {"text": "Hello there", "max_tokens": 10, "talker_temperature": 0.0, "seed": 1},
    {"text": "How are you today?", "max_tokens": 7, "ignore_eos": True, "seed": 2},  # seeded talker
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "audio", "audio": _wave(1.2, 3)},
                    {"type": "text", "text": "and this"},
                ],
            }
        ],
        "max_tokens": 6,
        "talker_temperature": 0.0,
        "seed": 3,
    },
    {"text": "Speak", "max_tokens": 9, "temperature": 0.8, "top_p": 0.9, "seed": 4},  # sampled text
]


def expected(
    model: Qwen3OmniModel, weights: Qwen3OmniWeights, data: Mapping[str, Any]
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Run one request stage by stage: the thinker to the end, the talker, then Code2Wav in 25/25
    chunks."""
    cfg = model.config
    ids, media = model.prompt(data)
    eos = () if data.get("ignore_eos") else (cfg.token_id("im_end_token_id"),)
    max_tokens = int(data["max_tokens"])
    if "temperature" in data:  # sampled text: the thinker's own draws, from the engine's answer
        return [], torch.zeros(0), torch.zeros(0)
    if media.audio:
        tokens = [encode_audio(weights.audio_tower, f) for f in media.audio]
        prompt = embed_prompt(cfg, weights.thinker_text.embedding, ids, audio=tokens)
        thinker = pipeline.run_thinker(
            weights, prompt, prompt_ids=ids, max_tokens=max_tokens, stop_token_ids=eos
        )
    else:
        thinker = pipeline.run_thinker(weights, ids, max_tokens=max_tokens, stop_token_ids=eos)
    greedy = data.get("talker_temperature") == 0.0
    speech = pipeline.speak(
        weights, thinker, max_frames=int(data.get("max_audio_frames", model.max_audio_frames)),
        sampling=TALKER_GREEDY if greedy else TALKER_SAMPLING,
        generator=torch.Generator().manual_seed(int(data["seed"])),
    )  # fmt: skip
    return thinker.generated, speech.codes, pipeline.decode_chunks(weights, speech.codes)


def split(outputs: list[Output]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    text = [int(o.data) for o in outputs if o.modality == "text"]
    codes = [o.data for o in outputs if o.name == "talker_codes"]
    audio = [o.data for o in outputs if o.modality == "audio"]
    return (
        text,
        torch.stack(codes, dim=1) if codes else torch.zeros(16, 0, dtype=torch.long),
        torch.cat(audio) if audio else torch.zeros(0),
    )


async def generate_all(
    model: Qwen3OmniModel | ModelSpec, config: EngineConfig | None = None
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    async with await AsyncEngine.start(model, config=config) as engine:
        results = await asyncio.gather(
            *(
                engine.run(
                    Request("generate", {"max_audio_frames": 80, **data, "return_codes": True})
                )
                for data in REQUESTS
            )
        )
    return [split(r) for r in results]


@pytest.mark.slow
async def test_batched_requests_equal_the_pipeline_in_any_placement(
    checkpoint: Path, model: Qwen3OmniModel, weights: Qwen3OmniWeights
) -> None:
    split_ranks = await generate_all(model)  # thinker, talker and Code2Wav on ranks 0, 1, 2
    colocated = await generate_all(
        Qwen3OmniModel(CONFIG, checkpoint=str(checkpoint), colocated=True, codec_batch_size=1)
    )
    for data, got, same in zip(REQUESTS, split_ranks, colocated, strict=True):
        text, codes, audio = got
        assert text == same[0] and torch.equal(codes, same[1]) and torch.equal(audio, same[2])
        assert codes.shape[1] > 0 and audio.numel() > 0
        want_text, want_codes, want_audio = expected(
            model, weights, {"max_audio_frames": 80, **data}
        )
        if not want_text:  # sampled text: the codes and audio still match its answer's speech
            continue
        assert text == want_text
        assert torch.equal(codes, want_codes), (codes.shape, want_codes.shape)
        torch.testing.assert_close(audio, want_audio, rtol=0, atol=1e-5)


async def test_one_request_matches_transformers_generate(
    checkpoint: Path, model: Qwen3OmniModel
) -> None:
    """An audio prompt, greedy thinker and talker: transformers' codes, and its Code2Wav on them in
    25/25 chunks."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeForConditionalGeneration,
    )

    reference = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(checkpoint)).eval()
    data = {**REQUESTS[2], "max_audio_frames": 30}
    ids, media = model.prompt(data)
    seen: dict[str, torch.Tensor] = {}
    original = reference.code2wav.chunked_decode

    def capture(codes: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen["codes"] = codes.clone()
        return original(codes, **kwargs)

    reference.code2wav.chunked_decode = capture
    with torch.no_grad():
        reference.generate(
            input_ids=torch.tensor([ids]), input_features=media.audio[0][None],
            feature_attention_mask=torch.ones(1, media.audio[0].shape[1], dtype=torch.long),
            thinker_max_new_tokens=data["max_tokens"], thinker_eos_token_id=model.eos_token_ids[0],
            thinker_do_sample=False, talker_max_new_tokens=30, talker_do_sample=False,
        )  # fmt: skip
    async with await AsyncEngine.start(model) as engine:
        _, codes, audio = split(
            await engine.run(Request("generate", {**data, "return_codes": True}))
        )
    ref = seen["codes"][0]
    assert codes.shape[1] > 0 and torch.equal(codes, ref)
    with torch.no_grad():
        want = reference.code2wav.chunked_decode(ref[None], chunk_size=25, left_context_size=25)[
            0, 0
        ]
    torch.testing.assert_close(audio, want, rtol=0, atol=1e-5)


def reference_nodes(model: Qwen3OmniModel, request_id: str) -> dict[str, Any]:
    """Each node as a plain callable for `run_reference` (a KV node on an engine of its own).

    A forward firing runs its chunks; the thinker's answer (its token walk) runs whole at its
    first call, and each call hands out one token's outputs, as the loop fires it.
    """
    device = torch.device("cpu")
    fns: dict[str, Any] = {}
    for name in model.graph().nodes:
        node = model.submodule(name, device)
        if not getattr(node, "forward_walks", False):
            fns[name] = lambda inputs, node=node: node([inputs])[0]
            continue
        engine = KVCacheEngine(node.model, node.engine_config)
        answer: list[Mapping[str, Any]] = []

        def walk(
            inputs: Mapping[str, Any], node: Any, engine: KVCacheEngine, answer: list[Any]
        ) -> Mapping[str, Any]:
            if not answer:
                turn = node.turn(request_id, inputs, is_first=not engine.has_request(request_id))
                args = {"logits_processor": turn.logits_processor, "return_rows": turn.return_rows}
                if engine.has_request(request_id):
                    engine.resume(request_id, turn.new_token_ids, turn.sampling_params, **args)
                else:
                    engine.add_request(
                        request_id,
                        turn.new_token_ids,
                        turn.sampling_params,
                        keep_alive=True,
                        **args,
                    )
                while engine.has_unfinished():
                    for out in engine.step():
                        history = (
                            list(engine.get_sequence(request_id).token_ids)
                            if out.finished
                            else None
                        )
                        rows = {} if out.hidden is None else {"rows": out.hidden}
                        answer.append(
                            node.outputs(request_id, out.new_token_ids[0], history, **rows)
                        )
            return answer.pop(0)

        def fire(
            inputs: Mapping[str, Any],
            node: Any = node,
            engine: KVCacheEngine = engine,
            answer: list[Any] = answer,
        ) -> Mapping[str, Any]:
            if (
                getattr(node, "token_walks", False)
                and int(inputs["cursor"]) == len(inputs["segments"]) - 1
            ):
                return walk(inputs, node, engine, answer)
            chunks = node.forward(request_id, inputs).chunks
            rows: list[torch.Tensor | None] = []
            for chunk in chunks:
                args = {
                    "payload": chunk.payload,
                    "num_tokens": chunk.num_tokens,
                    "output_mode": chunk.output,
                }
                if engine.has_request(request_id):
                    engine.resume(request_id, chunk.token_ids or [], **args)
                else:
                    engine.add_request(request_id, chunk.token_ids or [], keep_alive=True, **args)
                got = None
                while engine.has_unfinished():
                    for out in engine.step():
                        got = out.hidden if out.hidden is not None else got
                rows.append(got)
            result = node.forward_outputs([FiringRows(request_id, inputs, rows)])[0]
            if isinstance(result, BaseException):
                raise result
            return result

        fns[name] = fire
    return fns


@pytest.mark.slow
def test_the_reference_interpreter_gives_the_same_answer(
    model: Qwen3OmniModel, weights: Qwen3OmniWeights
) -> None:
    data = {**REQUESTS[0], "return_codes": True}
    prepared = model.preprocess(Request("generate", data))
    emissions = run_reference(
        model.graph(), reference_nodes(model, "r"), prepared.inputs, model, state=prepared.state
    )
    text = [int(e.value) for e in emissions if e.name == "text"]
    codes = torch.stack([e.value for e in emissions if e.name == "talker_codes"], dim=1)
    audio = torch.cat([e.value for e in emissions if e.name == "audio"])
    want_text, want_codes, want_audio = expected(model, weights, data)
    assert text == want_text and torch.equal(codes, want_codes)
    torch.testing.assert_close(audio, want_audio, rtol=0, atol=1e-5)


async def test_text_only_speech_task_and_bad_requests(model: Qwen3OmniModel) -> None:
    async with await AsyncEngine.start(model) as engine:
        outputs = await engine.run(
            Request("generate", {"text": "Hi", "max_tokens": 5, "modalities": ["text"]})
        )
        assert {o.modality for o in outputs} == {"text"} and len(outputs) <= 5
        spoken = await engine.run(
            Request("speech", {"text": "Hi you", "voice": "aiden", "max_audio_frames": 20})
        )
        text = [int(o.data) for o in spoken if o.modality == "text"]
        assert model.detokenize(text) == "Hi you"  # the given text is the answer
        assert sum(o.data.numel() for o in spoken if o.modality == "audio") > 0
        for bad, match in (
            ({"text": "x", "voice": "nobody"}, "unknown speaker"),
            ({"text": "x", "modalities": ["audio"]}, "modalities"),
            ({"text": "x", "max_tokens": 0}, "max_tokens"),
            (
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "audio", "audio": _wave(0.001, 0)}]}
                    ]
                },
                "10 ms",
            ),
        ):
            with pytest.raises(ValueError, match=match):
                await engine.run(Request("generate", bad))


def test_audio_features_and_prompt_segments(model: Qwen3OmniModel) -> None:
    feats = audio_features(model.config, _wave(1.0, 5))
    assert feats.shape == (20, 100)
    prepared = model.preprocess(Request("generate", REQUESTS[2]))
    # The last segment (the assistant opening) starts the answer's token walk: no prefill walk of
    # its own.
    assert (
        prepared.state.prefills == ["prefill_text", "prefill_audio"]
        and prepared.state.num_segments == 3
    )
