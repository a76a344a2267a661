"""SNAC, Orpheus' audio codec: frames of 7 codes in, 24 kHz audio out, batched over requests.

The decoder is ``snac.SNAC`` itself (the codec's own implementation), loaded from a local
directory holding ``config.json`` and ``pytorch_model.bin``; only its quantizer and decoder
are kept. Three changes for serving:

* **Weight norm is folded** into plain weights once at load (the parametrization would
  otherwise recompute ``g * v / |v|`` on every call).
* **Noise is reproducible.** SNAC's ``NoiseBlock`` adds ``torch.randn`` noise, so two
  decodes of the same codes differ. Here each batch row draws its noise from its own
  generator seeded by the caller (``noise="seeded"``), so a window decodes the same alone or
  in any batch, or the noise is left out (``noise="off"``).
* **Snake runs in place** (`_Snake`): bitwise the same activation with fewer temporaries.

A frame's 7 codes go to SNAC's three levels by position::

    frame f:   p0  p1  p2  p3  p4  p5  p6
    level 0:   p0                             1 code  per frame (codes_0[f])
    level 1:       p1          p4             2 codes per frame (codes_1[2f:2f+2])
    level 2:           p2  p3      p5  p6     4 codes per frame (codes_2[4f:4f+4])

and ``F`` frames decode to ``F * 4 * hop`` samples (2048 per frame at 24 kHz).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from mstar.errors import CheckpointError
from mstar.zoo.orpheus.config import FRAME_SIZE, SnacConfig

__all__ = ["NoiseMode", "SnacCodec", "frames_to_codes", "load_snac"]

NoiseMode = Literal["seeded", "off"]

_LEVEL_1 = [1, 4]
_LEVEL_2 = [2, 3, 5, 6]


def frames_to_codes(frames: torch.Tensor) -> list[torch.Tensor]:
    """Split codes ``[batch, frames, 7]`` into SNAC's three levels ``[batch, F]``, ``[batch, 2F]``,
    ``[batch, 4F]``."""
    if frames.dim() != 3 or frames.shape[2] != FRAME_SIZE:
        raise ValueError(f"frames must have shape [batch, frames, 7], got {tuple(frames.shape)}")
    batch, num_frames, _ = frames.shape
    return [
        frames[:, :, 0],
        frames[:, :, _LEVEL_1].reshape(batch, 2 * num_frames),
        frames[:, :, _LEVEL_2].reshape(batch, 4 * num_frames),
    ]


class _NoiseSource(threading.local):
    """Per-row generators shared by a decoder's noise blocks for the duration of one call (each
    thread's own: calls on several threads at once do not mix their noise)."""

    def __init__(self) -> None:
        self.generators: list[torch.Generator] | None = None

    def draw(self, batch: int, length: int, like: torch.Tensor) -> torch.Tensor:
        generators = self.generators
        if generators is None or len(generators) != batch:
            raise RuntimeError("seeded SNAC noise was drawn outside SnacCodec.decode")
        noise = torch.empty(batch, 1, length)
        for row, generator in enumerate(generators):
            noise[row].normal_(generator=generator)
        return noise.to(device=like.device, dtype=like.dtype)


class _SeededNoiseBlock(nn.Module):
    """SNAC's ``NoiseBlock`` (``x + randn * linear(x)``) with noise from per-row generators."""

    def __init__(self, linear: nn.Module, source: _NoiseSource) -> None:
        super().__init__()
        self.linear = linear
        self._source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Add noise scaled per channel by the learned 1x1 conv."""
        batch, _, length = x.shape
        return x + self._source.draw(batch, length, x) * self.linear(x)


class _Snake(nn.Module):
    """SNAC's ``Snake1d`` (``x + sin(alpha * x)^2 / (alpha + 1e-9)``) computed in place.

    The same operations in the same order, so bitwise the same result, but one temporary
    instead of four and the reciprocal computed once: about a fifth of a window's decode.
    """

    def __init__(self, alpha: torch.Tensor) -> None:
        super().__init__()
        self.alpha = nn.Parameter(alpha.detach().clone(), requires_grad=False)
        self.inv_alpha: torch.Tensor
        self.register_buffer("inv_alpha", (self.alpha.detach() + 1e-9).reciprocal())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the activation (SNAC's shapes: ``[batch, channels, time]``)."""
        out = x * self.alpha
        out.sin_().square_().mul_(self.inv_alpha)
        return out.add_(x)


class _SnacDecoder(nn.Module):
    """SNAC's quantizer (codes to latents) and decoder (latents to audio)."""

    def __init__(self, quantizer: nn.Module, decoder: nn.Module) -> None:
        super().__init__()
        self.quantizer = quantizer
        self.decoder = decoder

    def forward(self, codes: list[torch.Tensor]) -> torch.Tensor:
        """Decode the three levels of codes to audio ``[batch, 1, samples]``."""
        return self.decoder(self.quantizer.from_codes(codes))  # type: ignore[operator]


class SnacCodec:
    """Decode Orpheus frames with SNAC; many requests' windows in one call.

    A row decoded in a batch gets the same noise as alone; its samples differ from a
    one-row call only by float rounding of the batched convolutions (about 1e-6, at most one
    PCM16 step); one row per call is bitwise reproducible.

    Args:
        snac: A loaded ``snac.SNAC`` (its encoder is not kept).
        config: Its architecture.
        noise: ``"seeded"`` (each row's noise from its own seed) or ``"off"``.
        fold_weight_norm: Fold the weight-norm parametrizations into plain weights.
    """

    def __init__(
        self,
        snac: nn.Module,
        config: SnacConfig,
        *,
        noise: NoiseMode = "seeded",
        fold_weight_norm: bool = True,
    ) -> None:
        from snac.layers import NoiseBlock, Snake1d

        if noise not in ("seeded", "off"):
            raise ValueError(f"noise must be 'seeded' or 'off', got {noise!r}")
        self.config = config
        self.noise = noise
        self._source = _NoiseSource()
        module = _SnacDecoder(snac.quantizer, snac.decoder)  # type: ignore[arg-type]
        if fold_weight_norm:
            _fold_weight_norm(module)
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, NoiseBlock):
                    replacement: nn.Module = (
                        _SeededNoiseBlock(child.linear, self._source)
                        if noise == "seeded"
                        else nn.Identity()
                    )
                    setattr(parent, name, replacement)
                elif isinstance(child, Snake1d):
                    setattr(parent, name, _Snake(child.alpha))
        self.module = module.eval()
        self.has_noise = config.noise and noise == "seeded"

    @property
    def sample_rate(self) -> int:
        """Return the output sample rate (24000)."""
        return self.config.sampling_rate

    @property
    def samples_per_frame(self) -> int:
        """Return the samples one frame decodes to (2048 at 24 kHz)."""
        return self.config.samples_per_frame

    @property
    def device(self) -> torch.device:
        """Return where the weights live."""
        return next(self.module.parameters()).device

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> SnacCodec:
        """Move the weights (and optionally cast them); return self."""
        self.module.to(device=device, dtype=dtype)
        return self

    def decode(self, frames: torch.Tensor, seeds: Sequence[int] | None = None) -> torch.Tensor:
        """Decode codes ``[batch, F, 7]`` (values in ``[0, K)``) to audio ``[batch, F * 2048]``.

        Args:
            frames: Integer codes, one row per window (all with ``F`` frames).
            seeds: One noise seed per row (required when the codec adds seeded noise).

        Raises:
            ValueError: A code is out of range, or seeds are missing or of the wrong count.
        """
        codebook_size = self.config.codebook_size
        if frames.numel() and (int(frames.min()) < 0 or int(frames.max()) >= codebook_size):
            raise ValueError(f"SNAC codes must be in [0, {codebook_size})")
        batch, num_frames = frames.shape[0], frames.shape[1]
        if self.has_noise and (seeds is None or len(seeds) != batch):
            raise ValueError(f"seeded SNAC noise needs one seed per row ({batch}), got {seeds!r}")
        codes = [c.to(device=self.device, dtype=torch.long) for c in frames_to_codes(frames)]
        with torch.inference_mode():
            if self.has_noise:
                assert seeds is not None
                self._source.generators = [torch.Generator().manual_seed(s) for s in seeds]
            try:
                audio = self.module(codes)
            finally:
                self._source.generators = None
        expected = num_frames * self.samples_per_frame
        if audio.shape[-1] != expected:
            raise RuntimeError(
                f"SNAC decoded {audio.shape[-1]} samples for {num_frames} frames, expected "
                f"{expected}"
            )
        return audio.reshape(batch, expected).float()


def _fold_weight_norm(module: nn.Module) -> None:
    from torch.nn.utils import parametrize

    for sub in module.modules():
        if parametrize.is_parametrized(sub, "weight"):
            parametrize.remove_parametrizations(sub, "weight", leave_parametrized=True)


def load_snac(
    directory: str | Path,
    *,
    expected: SnacConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    noise: NoiseMode = "seeded",
    fold_weight_norm: bool = True,
) -> SnacCodec:
    """Load a SNAC checkpoint directory (``config.json`` + ``pytorch_model.bin``) without network.

    Args:
        directory: The checkpoint directory.
        expected: The architecture the caller expects; a different ``config.json`` is an error.
        device: Where the weights go.
        dtype: Weight dtype.
        noise: See `SnacCodec`.
        fold_weight_norm: See `SnacCodec`.

    Raises:
        CheckpointError: A file is missing or does not match the architecture.
    """
    from snac import SNAC

    path = Path(directory)
    config_path, weights_path = path / "config.json", path / "pytorch_model.bin"
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise CheckpointError(
                f"SNAC checkpoint {str(path)!r} lacks {needed.name}: it must hold config.json and "
                "pytorch_model.bin (as hubertsiuzdak/snac_24khz does); for random weights run "
                "`python scripts/make_orpheus_checkpoint.py --config orpheus-tiny --out DIR`"
            )
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {str(config_path)!r}: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(config_path)!r} must hold a JSON object")
    config = SnacConfig.from_json_dict(raw)
    if expected is not None and config != expected:
        raise CheckpointError(
            f"SNAC checkpoint {str(path)!r} has config {config}, expected {expected}"
        )
    model = SNAC(**config.to_json_dict())
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: torch raises many types
        raise CheckpointError(f"cannot read {str(weights_path)!r}: {exc}") from exc
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{str(weights_path)!r} does not match the SNAC config: {exc}"
        ) from exc
    codec = SnacCodec(model, config, noise=noise, fold_weight_norm=fold_weight_norm)
    return codec.to(device, dtype)
