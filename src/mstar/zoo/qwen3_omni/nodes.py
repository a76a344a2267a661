"""Qwen3-Omni's graph nodes: the encoders, the thinker, the talker (with its code predictor),
Code2Wav.

The thinker appends the prompt's segments by forward firings (`ForwardKVNode`), then answers
on the engine's token loop (`KVNode`): the engine samples, stops and reports log-probabilities
as for every text model, and hands back the last segment's rows with the first token. The
talker is forward-fired: it draws its frames inside the step itself, on the step thread, all
the step's requests in one code-predictor batch (`TalkerStepModel`). What crosses from the
thinker to the talker, one stream item per segment and per answer token::

    prefill item   {"kind": "prefill", rows of the segment's user positions (input embeddings,
                    or captured states at audio / image positions), the talker's coordinates,
                    and on the last segment the assistant turn's rows and the first answer token's}
    text item      {"kind": "text", "embed": [hidden]}  one per answer token but the last

The talker keeps, per request, the text rows not yet spoken, the code history (repetition
penalty), its generator and the summed embedding of the last frame; each decode firing adds
``frame sum + next text`` (``tts_eos`` once the answer is spoken, then ``tts_pad``), its step
draws codebook 0 and the code predictor's 15 codes, and the firing streams the frame to
Code2Wav.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mstar.engines.interfaces import FiringRows, KVChunk, KVForward, KVTurn
from mstar.engines.kv_engine import KVCacheEngineConfig
from mstar.engines.sampler import TokenLogprobs
from mstar.streaming import Chunk
from mstar.zoo.qwen3_omni.frames import FrameInput, SpeechState, TalkerStepModel
from mstar.zoo.qwen3_omni.modules.codec import conv_lookback, decode_chunk
from mstar.zoo.qwen3_omni.modules.encoders import ImageInput, encode_audio, encode_image
from mstar.zoo.qwen3_omni.modules.sampling import CODE_PREDICTOR_SAMPLING, DrawParams
from mstar.zoo.qwen3_omni.modules.text import EmbedsInput
from mstar.zoo.qwen3_omni.modules.weights import Qwen3OmniWeights

__all__ = [
    "AudioEncoderNode",
    "Code2WavNode",
    "TalkerNode",
    "ForcedTokens",
    "ThinkerNode",
    "VisionEncoderNode",
    "draw_params",
]


def draw_params(raw: Mapping[str, Any], prefix: str = "") -> DrawParams:
    """Return the `DrawParams` of a request's sampling dict (keys ``temperature``, ``top_k``,
    ...)."""
    return DrawParams(
        temperature=float(raw.get(f"{prefix}temperature", 0.0)),
        top_k=int(raw.get(f"{prefix}top_k", 0) or 0),
        top_p=float(raw.get(f"{prefix}top_p", 1.0)),
        repetition_penalty=float(raw.get(f"{prefix}repetition_penalty", 1.0)),
    )


def _generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _segment(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    return inputs["segments"][int(inputs["cursor"])]


class AudioEncoderNode:
    """``audio_encoder``: the current segment's log-mel features through the audio tower."""

    def __init__(self, weights: Qwen3OmniWeights) -> None:
        self.weights = weights

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Return each request's audio tokens as the thinker's ``media``."""
        out: list[Mapping[str, Any]] = []
        for x in batch:
            features = torch.as_tensor(_segment(x)["features"])
            out.append(
                {
                    "media": {
                        "embeds": encode_audio(self.weights.audio_tower, features),
                        "deepstack": None,
                    }
                }
            )
        return out


class VisionEncoderNode:
    """``vision_encoder``: the current segment's image patches through the vision tower (with
    DeepStack)."""

    def __init__(self, weights: Qwen3OmniWeights) -> None:
        self.weights = weights

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Return each request's image tokens and DeepStack features as the thinker's ``media``."""
        out: list[Mapping[str, Any]] = []
        for x in batch:
            seg = _segment(x)
            t, h, w = (int(v) for v in seg["grid"])
            tokens, deepstack = encode_image(
                self.weights.visual, ImageInput(torch.as_tensor(seg["pixels"]), (t, h, w))
            )
            out.append({"media": {"embeds": tokens, "deepstack": deepstack}})
        return out


def _engine_config(max_model_len: int) -> KVCacheEngineConfig:
    # Payload prompts (media, summed talker rows) are never shared by token hash.
    return KVCacheEngineConfig(
        block_size=16, max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=max_model_len,
        enable_prefix_caching=False, cuda_graphs=False,
    )  # fmt: skip


class ThinkerNode:
    """``thinker``: prompt segments as forward firings, then the answer as a token walk.

    Every segment but the last is a forward firing (`ForwardKVNode`): inputs ``segments``,
    ``cursor`` (which is next) and ``media`` (the encoder's output in audio / vision walks);
    outputs ``cursor`` and, when the answer is spoken, the talker's share of the segment. The
    last segment (always text: the assistant's opening) starts the answer, a token walk on the
    engine's loop (`KVNode`): its sampling is the request's ``sampling`` input (`SamplingParams`,
    the stop tokens, the tokens a speech request forces), and its rows come back with the first
    token for the talker. Outputs: ``text`` (each token, EOS included), ``thinker_states`` (the
    talker's stream) and ``stop`` on the last.
    """

    forward_walks = True
    token_walks = True

    def __init__(self, weights: Qwen3OmniWeights, max_model_len: int = 4096) -> None:
        self.weights = weights
        self.model = weights.thinker_text
        self.hidden = self.model.hidden_size
        self.engine_config = _engine_config(max_model_len)
        # request -> (speaks, last segment)
        self._answers: dict[str, tuple[bool, Mapping[str, Any]]] = {}

    # -- the prompt's segments: forward firings --------------------------------------------

    def forward(self, request_id: str, inputs: Mapping[str, Any]) -> KVForward:
        """Append the next segment of the prompt (text ids, or its encoder's embeddings)."""
        seg = inputs["segments"][int(inputs["cursor"])]
        ids = [int(i) for i in torch.as_tensor(seg["ids"]).tolist()]
        if seg["kind"] == "text":
            return KVForward([KVChunk(token_ids=ids)])
        media = inputs["media"]
        if not isinstance(media, Mapping):
            raise ValueError(f"a {seg['kind']} segment needs its encoder's output")
        payload = EmbedsInput(
            torch.as_tensor(media["embeds"]),
            positions3=seg["positions3"],
            rope_delta=seg["rope_delta"],
            deepstack=media.get("deepstack"),
        )
        if payload.num_rows != len(ids):
            raise ValueError(
                f"the encoder made {payload.num_rows} tokens for {len(ids)} placeholders"
            )
        return KVForward([KVChunk(payload=payload, num_tokens=payload.num_rows)])

    def forward_outputs(self, firings: list[FiringRows]) -> list[Mapping[str, Any] | BaseException]:
        """Move each request's cursor on; hand the talker its share of the segment."""
        results: list[Mapping[str, Any] | BaseException] = []
        for f in firings:
            cursor = int(f.inputs["cursor"])
            out: dict[str, Any] = {"cursor": cursor + 1}
            if f.inputs["sampling"]["speak"]:
                out["thinker_states"] = self._prefill_item(
                    f.inputs["segments"][cursor], f.rows[0], None
                )
            results.append(out)
        return results

    # -- the answer: a token walk ----------------------------------------------------------

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        """Append the last segment and generate the answer (its rows too, when it is spoken)."""
        segments, sampling = inputs["segments"], inputs["sampling"]
        last = segments[-1]
        if int(inputs["cursor"]) != len(segments) - 1 or last["kind"] != "text":
            raise ValueError(
                "the answer starts after every segment but the last (text) is in the cache"
            )
        speaks = bool(sampling["speak"])
        self._answers[request_id] = (speaks, last)
        forced = sampling["forced"]
        processor = ForcedTokens(forced) if forced else None
        ids = [int(i) for i in torch.as_tensor(last["ids"]).tolist()]
        return KVTurn(ids, sampling["params"], logits_processor=processor, return_rows=speaks)

    def outputs(
        self,
        request_id: str,
        token_id: int,
        history: list[int] | None,
        *,
        logprobs: TokenLogprobs | None = None,
        rows: torch.Tensor | None = None,
    ) -> Mapping[str, Any]:
        """Emit the token; feed the talker (the opening's rows first); ``stop`` on the last
        token."""
        is_end = history is not None
        text: Any = token_id if logprobs is None else logprobs.to_dict()
        out: dict[str, Any] = {"text": text, "stop": is_end}
        speaks, last = self._answers[request_id]
        if speaks:
            embed = None
            if not is_end:
                with torch.inference_mode():
                    embed = self.model.embedding(
                        torch.tensor([token_id], device=self.model.embedding.weight.device)
                    )[0]
            if rows is not None:
                out["thinker_states"] = self._prefill_item(last, rows, embed)
            elif embed is not None:
                out["thinker_states"] = {"kind": "text", "embed": embed}
        if is_end:
            self._answers.pop(request_id, None)
        return out

    def _prefill_item(
        self, seg: Mapping[str, Any], rows: torch.Tensor | None, first: torch.Tensor | None
    ) -> dict[str, Any]:
        """Return the talker's share of a prefill segment (see the module docstring)."""
        assert rows is not None
        hidden = self.hidden
        keep = torch.as_tensor(seg["keep"], dtype=torch.bool, device=rows.device)
        is_mm = seg["kind"] != "text"
        part = rows[keep, 2 * hidden :] if is_mm else rows[keep, hidden : 2 * hidden]
        item: dict[str, Any] = {
            "kind": "prefill", "rows": part, "is_mm": is_mm, "is_last": bool(seg["is_last"]),
            "positions3": seg["talker_positions3"], "rope_delta": seg["talker_rope_delta"],
        }  # fmt: skip
        if seg["is_last"]:
            item["opening"] = rows[-int(seg["opening"]) :, hidden : 2 * hidden]
            item["first_text"] = first
        return item

    def release(self, request_id: str) -> None:
        """Forget the request's answer state and MRoPE offset."""
        self._answers.pop(request_id, None)
        self.model.forget(request_id)


class ForcedTokens:
    """A `mstar.engines.LogitsProcessor` that makes the answer exactly ``tokens``: at each step
    every id but the next forced one is -inf (a speech request speaks its given text)."""

    __slots__ = ("_start", "tokens")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self._start: int | None = None

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self._start is None:  # the first call comes before the answer's first token
            self._start = len(token_ids)
        k = len(token_ids) - self._start
        forced = self.tokens[min(k, len(self.tokens) - 1)]
        out = torch.full_like(logits, float("-inf"))
        out[..., forced] = 0.0
        return out


class TalkerNode:
    """``talker`` (`ForwardKVNode`): the talker's prompt segment by segment, then one codec frame
    per firing.

    Inputs: ``thinker_states`` (a chunk of the thinker's stream) and ``talker_params``
    (sampling, voice, frame cap, seed). Outputs: ``codes`` (a frame ``[16]``, streamed to
    Code2Wav) and the ``stop`` signal: raised after each thinker item, and once the
    thinker is done, at codec EOS.
    """

    forward_walks = True

    def __init__(self, weights: Qwen3OmniWeights, max_model_len: int = 8192) -> None:
        config = weights.config
        self.weights = weights
        self.config = config
        self.model = TalkerStepModel(weights)  # the decoder, drawing each step's frames
        self.engine_config = _engine_config(max_model_len)
        embedding = weights.talker_text.embedding
        device = embedding.weight.device
        with torch.no_grad():
            ids = torch.tensor(
                [
                    config.token_id(n)
                    for n in ("tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id")
                ],
                device=device,
            )
            self.tts_bos, self.tts_eos, self.tts_pad = weights.text_projection(
                weights.thinker_text.embedding(ids)
            ).unbind(0)
            codec = torch.tensor(
                [
                    config.codec_id(n)
                    for n in (
                        "codec_nothink_id",
                        "codec_think_bos_id",
                        "codec_think_eos_id",
                        "codec_pad_id",
                        "codec_bos_id",
                    )
                ],
                device=device,
            )
            self._codec = embedding(codec)  # nothink, think_bos, think_eos, pad, bos
        self._speech: dict[str, SpeechState] = {}

    def _state(self, request_id: str, params: Mapping[str, Any]) -> SpeechState:
        state = self._speech.get(request_id)
        if state is None:
            sampling = draw_params(params, "talker_")
            code_sampling = (
                DrawParams(temperature=0.0) if sampling.is_greedy else CODE_PREDICTOR_SAMPLING
            )
            device = self.weights.talker_text.embedding.weight.device
            state = self._speech[request_id] = SpeechState(
                sampling,
                code_sampling,
                _generator(int(params["seed"]), device),
                int(params["max_frames"]),
                int(params["speaker"]),
            )
        return state

    @torch.no_grad()
    def forward(self, request_id: str, inputs: Mapping[str, Any]) -> KVForward:
        """Turn the chunk's items into cache rows: a prompt segment, or the next frame's input."""
        chunk: Chunk[Any] = inputs["thinker_states"]
        state = self._state(request_id, inputs["talker_params"])
        state.expects_frame = False
        projection = self.weights.text_projection
        device = self.weights.talker_text.embedding.weight.device
        prefill: list[torch.Tensor] = []
        positions3 = rope_delta = None
        is_opening = False  # the assistant's rows: the prefill that draws the first frame
        fresh = [item for j, item in enumerate(chunk.items) if chunk.start + j >= state.num_seen]
        state.num_seen = max(state.num_seen, chunk.end)
        for item in fresh:
            if item["kind"] == "text":
                state.texts.append(projection(torch.as_tensor(item["embed"]).to(device)[None])[0])
                continue
            rows = torch.as_tensor(item["rows"]).to(device)
            if rows.shape[0]:
                mlp = self.weights.hidden_projection if item["is_mm"] else projection
                prefill.append(mlp(rows))
            positions3, rope_delta = item["positions3"], item["rope_delta"]
            if item["is_last"]:
                opening = projection(torch.as_tensor(item["opening"]).to(device))
                state.texts.extend([*opening[3:]])
                if item["first_text"] is not None:
                    state.texts.append(
                        projection(torch.as_tensor(item["first_text"]).to(device)[None])[0]
                    )
                if not state.texts:  # no answer text to speak (transformers cannot either)
                    state.is_done = True
                    return KVForward([])
                prefill.append(self._assistant(opening[:3], state))
                is_opening = True
                state.is_started = True
        if state.is_done:
            return KVForward([])
        if prefill:
            embeds = torch.cat(prefill)
            state.expects_frame = is_opening
            payload = (
                FrameInput(embeds, positions3=positions3, rope_delta=rope_delta, state=state)
                if is_opening
                else EmbedsInput(embeds, positions3=positions3, rope_delta=rope_delta)
            )
            return KVForward([KVChunk(payload=payload, num_tokens=payload.num_rows, output="none")])
        if not state.is_started or state.pending is None:
            return KVForward([])
        if state.texts:
            text = state.texts.popleft()
        elif chunk.is_last and not state.eos_used:
            text, state.eos_used = self.tts_eos, True
        else:
            text = self.tts_pad
        x = (state.pending + text)[None]
        state.expects_frame = True
        return KVForward([KVChunk(payload=FrameInput(x, state=state), num_tokens=1, output="none")])

    def _assistant(self, opening: torch.Tensor, state: SpeechState) -> torch.Tensor:
        """Return the 9 assistant positions: text ``A0 A1 A2 pad*4 bos A3`` plus codec ``0 0 0
        nothink think_bos think_eos speaker pad bos``."""
        first = state.texts.popleft()
        text = torch.cat((opening, self.tts_pad.expand(4, -1), self.tts_bos[None], first[None]))
        speaker = self.weights.talker_text.embedding(
            torch.tensor([state.speaker], device=opening.device)
        )
        nothink, think_bos, think_eos, pad, bos = self._codec
        codec = torch.cat(
            (
                opening.new_zeros(3, opening.shape[1]),
                torch.stack((nothink, think_bos, think_eos)),
                speaker,
                torch.stack((pad, bos)),
            )
        )
        return text + codec

    def forward_outputs(self, firings: list[FiringRows]) -> list[Mapping[str, Any] | BaseException]:
        """Return each firing's frame (drawn in its step, see `TalkerStepModel`) and its stop
        signal."""
        results: list[Mapping[str, Any] | BaseException] = []
        for f in firings:
            state = self._speech.get(f.request_id)
            chunk: Chunk[Any] = f.inputs["thinker_states"]
            # An item's walk is one step; the final chunk's walk speaks to the end.
            out: dict[str, Any] = {"stop": state is None or state.is_done or not chunk.is_last}
            if state is not None and state.expects_frame:
                state.expects_frame = False
                frame, state.frame = state.frame, None
                if frame is not None:
                    out["codes"] = frame
                    if f.inputs["talker_params"].get("return_codes"):
                        out["talker_codes"] = frame
            results.append(out)
        return results

    def release(self, request_id: str) -> None:
        """Forget the request's speech state and MRoPE offset."""
        self._speech.pop(request_id, None)
        self.model.forget(request_id)


class Code2WavNode:
    """``code2wav``: each request's chunk of frames to audio, context trimmed.

    Chunks of equal length and context run as one batch of at most ``max_batch_size`` (1: each
    alone, so a chunk's samples never depend on what it was batched with). The default batches
    on an accelerator and runs each chunk alone on a CPU, where a batch costs more per frame
    than its chunks one by one (its activations outgrow what the allocator reuses: measured on
    ``qwen3-omni-small``, 0.84 ms per frame alone, 1.42 ms in batches of 8).

    With ``skip_context`` (the default) the ConvNet skips the context frames no kept sample
    reads (`decode_chunk`: 25/25 chunks run it over 35 frames, not 50). The samples are those
    of the full decode up to the convolutions' summation order, which oneDNN picks by length
    (float32 rounding; bit-equal with ``skip_context=False``).
    """

    def __init__(
        self,
        weights: Qwen3OmniWeights,
        max_batch_size: int | None = None,
        *,
        skip_context: bool = True,
    ) -> None:
        self.weights = weights
        self.samples_per_frame = weights.config.samples_per_frame
        if max_batch_size is None and next(weights.code2wav.parameters()).device.type == "cpu":
            max_batch_size = 1
        self.max_batch_size = max_batch_size
        self.lookback = conv_lookback(weights.code2wav) if skip_context else None

    @torch.no_grad()
    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Decode every chunk; an empty final chunk makes no audio."""
        out: list[Mapping[str, Any]] = [{} for _ in batch]
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, x in enumerate(batch):
            chunk: Chunk[Any] = x["codes"]
            if chunk.items:
                by_shape.setdefault((len(chunk.items), chunk.context_len), []).append(i)
        code2wav = self.weights.code2wav
        device = next(code2wav.parameters()).device
        size = self.max_batch_size or len(batch)
        for (_, context), group in by_shape.items():
            for k in range(0, len(group), size):
                members = group[k : k + size]
                codes = torch.stack(
                    [
                        torch.stack([torch.as_tensor(c) for c in batch[i]["codes"].items], dim=1)
                        for i in members
                    ]
                ).to(device)
                if self.lookback is None:
                    wav = code2wav(codes)[..., context * self.samples_per_frame :]
                else:
                    wav = decode_chunk(code2wav, codes, context, self.lookback)
                for j, i in enumerate(members):
                    out[i] = {"audio": wav[j, 0].float().cpu()}
        return out
