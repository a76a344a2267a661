"""Orpheus TTS: a Llama-3 speech LM whose audio tokens SNAC decodes to 24 kHz speech.

The model-specific pieces, each usable on its own:

* `config`: `OrpheusConfig` (``orpheus-3b``, ``orpheus-small``, ``orpheus-tiny``) and the
  `TokenLayout` of text, special and audio ids;
* `tokens`: the Llama-3 tokenizer with Orpheus' custom tokens, and the prompt format;
* `constrained`: `AudioLogitsProcessor` (constrained decoding) and `audio_code` (validation);
* `codec`: `SnacCodec`, SNAC with folded weight norm and seeded noise, batched over windows;
* `stream`: which frames each chunk of the 28/7 sliding window emits (`plan_chunk`), and
  batched decoding of many requests' chunks (`decode_chunks`);
* `checkpoint`: random checkpoints in the real formats, and loading;
* `audio`: PCM16 and WAV output.
"""

from __future__ import annotations

from mstar.zoo.orpheus.audio import SAMPLE_RATE, pcm16_bytes, wav_bytes, write_wav
from mstar.zoo.orpheus.checkpoint import (
    llama_hf_config,
    load_orpheus_codec,
    load_orpheus_llm,
    make_random_checkpoint,
)
from mstar.zoo.orpheus.codec import NoiseMode, SnacCodec, frames_to_codes, load_snac
from mstar.zoo.orpheus.config import (
    FRAME_SIZE,
    ORPHEUS_CONFIGS,
    OrpheusConfig,
    SnacConfig,
    TokenLayout,
    get_orpheus_config,
)
from mstar.zoo.orpheus.constrained import AudioLogitsProcessor, audio_code, audio_codes
from mstar.zoo.orpheus.stream import (
    WINDOW_FRAMES,
    AudioStreamState,
    AudioWindow,
    StreamResult,
    decode_chunks,
    decode_windows,
    plan_chunk,
    plan_tokens,
    window_seed,
)
from mstar.zoo.orpheus.tokens import EMOTIVE_TAGS, VOICES, OrpheusTokenizer, load_llama3_tokenizer

__all__ = [
    "EMOTIVE_TAGS",
    "FRAME_SIZE",
    "ORPHEUS_CONFIGS",
    "SAMPLE_RATE",
    "VOICES",
    "WINDOW_FRAMES",
    "AudioLogitsProcessor",
    "AudioStreamState",
    "AudioWindow",
    "NoiseMode",
    "OrpheusConfig",
    "OrpheusTokenizer",
    "SnacCodec",
    "SnacConfig",
    "StreamResult",
    "TokenLayout",
    "audio_code",
    "audio_codes",
    "decode_chunks",
    "decode_windows",
    "frames_to_codes",
    "get_orpheus_config",
    "llama_hf_config",
    "load_llama3_tokenizer",
    "load_orpheus_codec",
    "load_orpheus_llm",
    "load_snac",
    "make_random_checkpoint",
    "pcm16_bytes",
    "plan_chunk",
    "plan_tokens",
    "wav_bytes",
    "window_seed",
    "write_wav",
]
