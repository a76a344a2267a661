"""Qwen3-Omni's baseline: one request through its components one after another.

The thinker and the talker run on `KVCacheEngine`s (paged caches) in the forward style the
graph's nodes use: each step appends inputs in ``"hidden"`` mode and the caller samples from
the returned rows, so every position's captured thinker states are at hand for the talker.
Code2Wav decodes the codes in left-context chunks, after the talker is done. The parity tests
compare it with transformers, and the served graph (`mstar.zoo.qwen3_omni`) with it.

```
thinker  prompt ──prefill──▶ rows ─▶ token 1 ─▶ rows ─▶ token 2 ... EOS     (final | embed | layer-k)
talker   prompt(9+) ─prefill─▶ hidden ─▶ code0 ─┬─ code predictor ─▶ frame 0 ─▶ next input ─▶ ...
code2wav frames ──[25 new + up to 25 context]──▶ audio (context trimmed)
```
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from mstar.engines.kv_engine import KVCacheEngine, KVCacheEngineConfig
from mstar.zoo.qwen3_omni.modules.codec import conv_lookback, decode_chunk
from mstar.zoo.qwen3_omni.modules.sampling import (
    CODE_PREDICTOR_SAMPLING,
    TALKER_SAMPLING,
    DrawParams,
    draw,
    talker_suppress_mask,
)
from mstar.zoo.qwen3_omni.modules.talker import TalkerPrompt, make_talker_prompt
from mstar.zoo.qwen3_omni.modules.text import EmbedsInput, MoEDecoder
from mstar.zoo.qwen3_omni.modules.weights import Qwen3OmniWeights

__all__ = [
    "SpeechResult",
    "ThinkerResult",
    "decode_chunks",
    "run_talker",
    "run_thinker",
    "speak",
]

_ids = itertools.count()


def _engine(model: MoEDecoder, num_blocks: int = 256) -> KVCacheEngine:
    config = KVCacheEngineConfig(num_blocks=num_blocks, block_size=16, max_num_batched_tokens=8192)
    return KVCacheEngine(model, config)


def _rows(engine: KVCacheEngine, request_id: str) -> torch.Tensor:
    """Step ``engine`` until ``request_id``'s rows come back."""
    while True:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.error is not None:
                raise out.error
            if out.hidden is not None:
                return out.hidden
        if not engine.has_unfinished():
            raise RuntimeError(f"request {request_id!r} finished without rows")


@dataclass(frozen=True, eq=False)
class ThinkerResult:
    """A thinker run: every token and the states the talker reads.

    The states cover every position but the last token's, which is never run (transformers'
    ``generate`` keeps the same: the answer's final token, EOS, is not spoken).
    """

    token_ids: list[int]
    prompt_len: int
    embeds: torch.Tensor  # [len, hidden] input embeddings
    hidden: torch.Tensor  # [len, hidden] captured at accept_hidden_layer
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        """Return the generated tokens."""
        return self.token_ids[self.prompt_len :]


@torch.no_grad()
def run_thinker(
    weights: Qwen3OmniWeights,
    prompt: list[int] | EmbedsInput,
    *,
    max_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
    prompt_ids: list[int] | None = None,
    engine: KVCacheEngine | None = None,
) -> ThinkerResult:
    """Generate greedily with the thinker (prompt ids, or an embedded multimodal prompt).

    Args:
        weights: The model.
        prompt: Token ids, or the prompt's embeddings (audio / vision features scattered in).
        max_tokens: Tokens to generate at most.
        stop_token_ids: Tokens that end the answer (kept).
        prompt_ids: The token ids of an embedded prompt (placeholders at multimodal positions).
        engine: The thinker's engine (default: a fresh one).
    """
    model = weights.thinker_text
    engine = engine or _engine(model)
    request_id = f"thinker-{next(_ids)}"
    hidden = model.hidden_size
    if isinstance(prompt, EmbedsInput):
        if prompt_ids is None:
            raise ValueError("an embedded prompt needs its prompt_ids")
        ids = list(prompt_ids)
        engine.add_request(
            request_id,
            [],
            payload=prompt,
            num_tokens=prompt.num_rows,
            output_mode="hidden",
            keep_alive=True,
        )
    else:
        ids = list(prompt)
        engine.add_request(request_id, ids, output_mode="hidden", keep_alive=True)
    prompt_len = len(ids)
    rows = [_rows(engine, request_id)]
    logits: list[torch.Tensor] = []
    try:
        for step in range(max_tokens):
            row_logits = model.compute_logits(rows[-1][-1:])[0]
            logits.append(row_logits)
            token = int(row_logits.argmax())
            ids.append(token)
            if token in stop_token_ids or step == max_tokens - 1:
                break
            engine.resume(request_id, [token], output_mode="hidden")
            rows.append(_rows(engine, request_id))
    finally:
        engine.abort(request_id)
        model.forget(request_id)
    states = torch.cat(rows)
    return ThinkerResult(
        ids, prompt_len, states[:, hidden : 2 * hidden], states[:, 2 * hidden :], logits
    )


@dataclass(frozen=True, eq=False)
class SpeechResult:
    """A talker run: ``codes`` ``[16, frames]`` (codebook 0 first) and the codebook-0 tokens
    drawn."""

    codes: torch.Tensor
    code0: list[int]


@torch.no_grad()
def run_talker(
    weights: Qwen3OmniWeights,
    prompt: TalkerPrompt,
    *,
    max_frames: int,
    sampling: DrawParams = TALKER_SAMPLING,
    code_sampling: DrawParams | None = None,
    generator: torch.Generator | None = None,
    engine: KVCacheEngine | None = None,
) -> SpeechResult:
    """Draw codec frames with the talker and its code predictor until codec EOS.

    Draws follow transformers' order (one codebook-0 draw, then per step the code predictor's
    15 and the next codebook-0 draw), all from ``generator``, so a seeded generator gives
    transformers' codes for ``torch.manual_seed`` of the same seed. ``max_frames`` caps the
    codebook-0 draws, as ``talker_max_new_tokens`` does.
    """
    config = weights.config
    talker = weights.talker_text
    engine = engine or _engine(talker)
    code_sampling = code_sampling or (
        DrawParams(temperature=0.0) if sampling.is_greedy else CODE_PREDICTOR_SAMPLING
    )
    eos = config.codec_id("codec_eos_token_id")
    suppress = talker_suppress_mask(config, prompt.embeds.device)
    request_id = f"talker-{next(_ids)}"
    first = EmbedsInput(prompt.embeds, positions3=prompt.positions3, rope_delta=prompt.rope_delta)
    engine.add_request(
        request_id,
        [],
        payload=first,
        num_tokens=prompt.embeds.shape[0],
        output_mode="hidden",
        keep_alive=True,
    )
    frames: list[torch.Tensor] = []
    drawn: list[int] = []
    try:
        last = _rows(engine, request_id)[-1:]
        for step in range(max_frames):
            code0 = draw(
                talker.compute_logits(last),
                sampling,
                [generator],
                history=[drawn],
                suppress=suppress,
            )
            drawn.append(int(code0))
            if int(code0) == eos or step == max_frames - 1:
                break
            code0_embed = talker.embedding(code0)
            residual, embeds = weights.code_predictor.generate(
                last, code0_embed, code_sampling, [generator]
            )
            frames.append(torch.cat((code0, residual[0])))
            text = prompt.trailing[step] if step < prompt.trailing.shape[0] else prompt.tts_pad
            x = code0_embed + torch.stack(embeds).sum(0) + text
            engine.resume(
                request_id, [], payload=EmbedsInput(x), num_tokens=1, output_mode="hidden"
            )
            last = _rows(engine, request_id)[-1:]
    finally:
        engine.abort(request_id)
    codes = (
        torch.stack(frames, dim=1)
        if frames
        else torch.zeros(config.num_code_groups, 0, dtype=torch.long)
    )
    return SpeechResult(codes, drawn)


@torch.no_grad()
def decode_chunks(
    weights: Qwen3OmniWeights, codes: torch.Tensor, chunk: int = 25, left_context: int = 25
) -> torch.Tensor:
    """Decode ``codes`` ``[16, frames]`` to audio ``[samples]`` in left-context chunks (trimmed).

    The ConvNet skips the context frames no kept sample reads (`decode_chunk`).
    """
    lookback = conv_lookback(weights.code2wav)
    pieces = []
    for start in range(0, codes.shape[1], chunk):
        context = min(left_context, start)
        window = codes[None, :, start - context : start + chunk]
        pieces.append(decode_chunk(weights.code2wav, window, context, lookback)[0, 0])
    return torch.cat(pieces) if pieces else torch.zeros(0)


def speak(
    weights: Qwen3OmniWeights,
    thinker: ThinkerResult,
    *,
    max_frames: int,
    speaker: str | None = None,
    sampling: DrawParams = TALKER_SAMPLING,
    generator: torch.Generator | None = None,
    image_grids: list[tuple[int, int, int]] | None = None,
) -> SpeechResult:
    """Build the talker's prompt from a thinker run and draw its frames."""
    prompt = make_talker_prompt(
        weights.config,
        token_ids=thinker.token_ids,
        prompt_len=thinker.prompt_len,
        thinker_embed=thinker.embeds,
        thinker_hidden=thinker.hidden,
        text_projection=weights.text_projection,
        hidden_projection=weights.hidden_projection,
        codec_embedding=weights.talker_text.embedding,
        thinker_embedding=weights.thinker_text.embedding,
        speaker=speaker,
        image_grids=image_grids,
    )
    return run_talker(
        weights, prompt, max_frames=max_frames, sampling=sampling, generator=generator
    )
