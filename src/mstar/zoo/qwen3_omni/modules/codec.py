"""Code2Wav on left-context chunks without the ConvNet work that only feeds dropped samples.

A streamed chunk is ``context`` frames already spoken plus new ones; transformers decodes all
of it and drops the first ``context * samples_per_frame`` samples. Its sliding-window
transformer needs every context frame (each chunk's attention starts at the chunk), but the
ConvNet after it is causal: a sample reads only the last few frames before it (its
`conv_lookback`: 10 frames for the ``[2, 2] x [8, 5, 4, 3]`` upsampling). So `decode_chunk`
runs the transformer over the whole chunk and the ConvNet from ``lookback`` frames before the
new ones; every kept sample is computed from the same values as in the full decode.

```
codes [B, 16, ctx + new] -> embed, mean -> transformer (all ctx + new frames)
        -> hidden[:, :, ctx - lookback :] -> upsample -> decoder -> drop lookback frames
```
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["conv_lookback", "decode_chunk"]


def conv_lookback(code2wav: Any) -> int:
    """Return how many frames before a sample Code2Wav's ConvNet reads (whole frames, an upper
    bound).

    Walks the upsampling and decoder convolutions in the order they run, at each one's rate
    (samples per codec frame): a causal convolution reads ``(kernel - 1) * dilation`` samples
    back; a transposed one (stride ``s``, kernel ``k``, ``left_pad`` leading samples trimmed)
    reads ``ceil((k - left_pad) / s) - 1`` input samples before the one under its output (0
    for Code2Wav's ``left_pad = k - s``) and multiplies the rate by ``s``. Elementwise layers
    (SnakeBeta, norms, pointwise linears) read nothing back; summing along the chain bounds
    every path, residual ones included. ``[2, 2] x [8, 5, 4, 3]``: 9.09 frames, so 10.
    """
    frames = 0.0
    rate = 1
    inner: set[int] = set()  # the convolutions of the transposed wrappers, counted there
    for part in (code2wav.upsample, code2wav.decoder):
        for module in part.modules():
            conv = getattr(module, "conv", None)
            if isinstance(conv, nn.ConvTranspose1d):
                kernel, stride = int(conv.kernel_size[0]), int(conv.stride[0])
                left_pad = int(getattr(module, "left_pad", 0))
                frames += max(0, math.ceil((kernel - left_pad) / stride) - 1) / rate
                rate *= stride
                inner.add(id(conv))
            elif isinstance(module, nn.ConvTranspose1d) and id(module) not in inner:
                raise ValueError("Code2Wav has a transposed convolution without its trim")
            elif isinstance(module, nn.Conv1d):
                if int(module.stride[0]) != 1:
                    raise ValueError("Code2Wav's ConvNet has a strided convolution")
                frames += (int(module.kernel_size[0]) - 1) * int(module.dilation[0]) / rate
    return math.ceil(frames)


@torch.no_grad()
def decode_chunk(
    code2wav: Any, codes: torch.Tensor, context: int, lookback: int | None = None
) -> torch.Tensor:
    """Return the audio ``[B, 1, (frames - context) * samples_per_frame]`` of a left-context chunk.

    Equal to ``code2wav(codes)[..., context * samples_per_frame:]``, with the ConvNet run only
    over the frames the kept samples read.

    Args:
        code2wav: transformers' ``Qwen3OmniMoeCode2Wav``.
        codes: ``[B, num_quantizers, frames]``, the first ``context`` frames already spoken.
        context: Leading frames whose samples are dropped.
        lookback: `conv_lookback` of ``code2wav`` (computed when None).
    """
    if codes.shape[1] != code2wav.config.num_quantizers:
        raise ValueError(
            f"expected {code2wav.config.num_quantizers} codebooks, got {codes.shape[1]}"
        )
    if lookback is None:
        lookback = conv_lookback(code2wav)
    hidden = code2wav.code_embedding(codes + code2wav.code_offset).mean(1)
    hidden = code2wav.pre_transformer(inputs_embeds=hidden).last_hidden_state
    skip = max(0, context - lookback)
    hidden = hidden[:, skip:].permute(0, 2, 1)
    for blocks in code2wav.upsample:
        for block in blocks:
            hidden = block(hidden)
    for block in code2wav.decoder:
        hidden = block(hidden)
    per_frame = int(code2wav.total_upsample)
    return hidden[..., (context - skip) * per_frame :].clamp(min=-1, max=1)
