"""Orpheus configs: the token id layout, the SNAC codec, the Llama backbone, checkpoints.

The id layout is parametrised by the text vocabulary size ``T`` (``tokeniser_length``) and
the codebook size ``K``; the real model has T = 128256 and K = 4096:

```
0 ........ T-1 | T+0 ... T+9           | T+10 ......................... T+10+7K-1
 Llama-3 text  | special (custom 0..9) | audio: position p in 0..6, code c in 0..K-1
               |                       |        id = T + 10 + p*K + c
```

Special ids (custom token ``N`` is ``T + N``): start_of_speech T+1, end_of_speech T+2,
start_of_human T+3, end_of_human T+4, start_of_ai T+5, end_of_ai T+6, pad T+7.

A frame is 7 audio tokens; position p feeds SNAC level 0 (p0), 1 (p1, p4) or 2 (p2, p3,
p5, p6), so one frame is one coarse code and ``4 * hop`` samples of audio.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.hf_checkpoint import load_hf_config, read_json_object
from mstar.zoo.llama import LlamaConfig

__all__ = [
    "FRAME_SIZE",
    "LLAMA3_VOCAB_SIZE",
    "ORPHEUS_CONFIGS",
    "OrpheusConfig",
    "SnacConfig",
    "TokenLayout",
    "config_from_checkpoint",
    "get_orpheus_config",
]

FRAME_SIZE = 7
"""Audio tokens per frame (1 + 2 + 4 codes over SNAC's three levels)."""

LLAMA3_VOCAB_SIZE = 128256
"""Ids of the Llama-3 tokenizer (text and its special tokens); custom tokens follow."""

_NUM_SPECIAL = 10  # custom tokens 0..9 precede the audio ids
_LLAMA3_BOS = 128000
_LLAMA3_EOT = 128009


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """Where text, special and audio ids live in an Orpheus vocabulary.

    Attributes:
        tokeniser_length: ``T``, the number of text ids (128256 for the real model).
        codebook_size: ``K``, codes per SNAC codebook (4096 for the real model).
    """

    tokeniser_length: int = LLAMA3_VOCAB_SIZE
    codebook_size: int = 4096

    def __post_init__(self) -> None:
        if self.tokeniser_length < 16:
            raise ValueError(f"tokeniser_length must be >= 16, got {self.tokeniser_length}")
        if self.codebook_size < 1:
            raise ValueError(f"codebook_size must be >= 1, got {self.codebook_size}")

    @property
    def is_llama3_text(self) -> bool:
        """Whether text ids are the Llama-3 ids themselves (else they are folded, see `text_id`)."""
        return self.tokeniser_length == LLAMA3_VOCAB_SIZE

    @property
    def start_of_text(self) -> int:
        """Return the id of Llama's ``<|begin_of_text|>`` (128000 in the real layout)."""
        return self.text_id(_LLAMA3_BOS)

    @property
    def end_of_text(self) -> int:
        """Return the id of Llama's ``<|eot_id|>`` (128009 in the real layout)."""
        return self.text_id(_LLAMA3_EOT)

    @property
    def start_of_speech(self) -> int:
        """Return the id that opens the audio (128257)."""
        return self.tokeniser_length + 1

    @property
    def end_of_speech(self) -> int:
        """Return the id that ends the audio and stops decoding (128258)."""
        return self.tokeniser_length + 2

    @property
    def start_of_human(self) -> int:
        """Return the id that opens the user turn (128259)."""
        return self.tokeniser_length + 3

    @property
    def end_of_human(self) -> int:
        """Return the id that closes the user turn (128260)."""
        return self.tokeniser_length + 4

    @property
    def start_of_ai(self) -> int:
        """Return the id that opens the model turn (128261)."""
        return self.tokeniser_length + 5

    @property
    def end_of_ai(self) -> int:
        """Return the id that closes the model turn (128262)."""
        return self.tokeniser_length + 6

    @property
    def pad(self) -> int:
        """Return the padding id (128263)."""
        return self.tokeniser_length + 7

    @property
    def audio_start(self) -> int:
        """Return the first audio id (128266): position 0, code 0."""
        return self.tokeniser_length + _NUM_SPECIAL

    @property
    def num_ids(self) -> int:
        """Count the ids the layout uses (``T + 10 + 7K``); a model's vocab may be padded past
        it."""
        return self.audio_start + FRAME_SIZE * self.codebook_size

    def text_id(self, llama3_id: int) -> int:
        """Map an id of the Llama-3 tokenizer (extended with custom tokens) into this layout.

        The real layout keeps every id. A smaller ``T`` folds text ids into ``[0, T)`` by
        ``id % T`` (random-weight configs only need the structure, not the meaning) and keeps
        custom tokens custom: ``<custom_token_N>`` (``128256 + N``) becomes ``T + N``.
        """
        if llama3_id < 0:
            raise ValueError(f"token ids are non-negative, got {llama3_id}")
        if llama3_id >= LLAMA3_VOCAB_SIZE:
            return self.tokeniser_length + (llama3_id - LLAMA3_VOCAB_SIZE)
        return llama3_id if self.is_llama3_text else llama3_id % self.tokeniser_length

    def audio_id(self, position: int, code: int) -> int:
        """Return the id of ``code`` at frame ``position``."""
        if not 0 <= position < FRAME_SIZE:
            raise ValueError(f"frame position must be in [0, {FRAME_SIZE}), got {position}")
        if not 0 <= code < self.codebook_size:
            raise ValueError(f"code must be in [0, {self.codebook_size}), got {code}")
        return self.audio_start + position * self.codebook_size + code

    def split_audio_id(self, token_id: int) -> tuple[int, int] | None:
        """Return ``(position, code)`` of an audio id, or None for any other id."""
        offset = token_id - self.audio_start
        if not 0 <= offset < FRAME_SIZE * self.codebook_size:
            return None
        position, code = divmod(offset, self.codebook_size)
        return position, code

    def audio_range(self, position: int) -> tuple[int, int]:
        """Return the ``[start, end)`` ids allowed at frame ``position``."""
        start = self.audio_start + position * self.codebook_size
        return start, start + self.codebook_size


@dataclass(frozen=True, slots=True)
class SnacConfig:
    """The keyword arguments of ``snac.SNAC``, as in the checkpoint's ``config.json``.

    Orpheus needs three levels at strides 4/2/1 (the 1 + 2 + 4 codes of a frame).
    """

    sampling_rate: int = 24000
    encoder_dim: int = 48
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int | None = None
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    attn_window_size: int | None = None
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: tuple[int, ...] = (4, 2, 1)
    noise: bool = True
    depthwise: bool = True

    def __post_init__(self) -> None:
        if tuple(self.vq_strides) != (4, 2, 1):
            raise UnsupportedModelError(
                f"Orpheus frames need SNAC vq_strides (4, 2, 1), got {tuple(self.vq_strides)}"
            )
        if math.prod(self.encoder_rates) != math.prod(self.decoder_rates):
            raise UnsupportedModelError(
                f"SNAC encoder_rates {self.encoder_rates} and decoder_rates {self.decoder_rates} "
                "must have the same product (the hop length)"
            )
        if any(rate % 2 for rate in self.decoder_rates):
            # Odd strides make transposed convs overshoot: decode length != codes * hop.
            raise UnsupportedModelError(
                f"SNAC decoder_rates must be even, got {self.decoder_rates}"
            )

    @property
    def hop_length(self) -> int:
        """Return the samples per latent step (512 for the 24 kHz model)."""
        return math.prod(self.encoder_rates)

    @property
    def samples_per_frame(self) -> int:
        """Return the samples one Orpheus frame decodes to (one coarse code: 2048 at 24 kHz)."""
        return self.hop_length * self.vq_strides[0]

    def to_json_dict(self) -> dict[str, Any]:
        """Return the fields as SNAC's ``config.json`` holds them."""
        raw = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in raw.items()}

    @classmethod
    def from_json_dict(cls, raw: dict[str, Any]) -> SnacConfig:
        """Build from a SNAC ``config.json`` dict.

        Raises:
            CheckpointError: The dict has unknown or ill-typed fields.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CheckpointError(f"SNAC config.json has unknown fields {unknown}")
        try:
            values: dict[str, Any] = {
                k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()
            }
            return cls(**values)
        except TypeError as exc:
            raise CheckpointError(f"SNAC config.json is malformed: {exc}") from exc


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_MAKE_HINT = "python scripts/make_orpheus_checkpoint.py --config {name} --out DIR"


@dataclass(frozen=True)
class OrpheusConfig:
    """One Orpheus configuration: backbone, codec, id layout, sampling and checkpoints.

    Attributes:
        name: The config's name (``orpheus-3b``, ``orpheus-small``, ``orpheus-tiny``).
        llm: The Llama backbone's architecture.
        snac: The codec's architecture.
        layout: The token id layout.
        constrained: Whether decoding masks logits to the audio ids valid at each frame
            position (on for random weights, which emit arbitrary ids).
        temperature, top_p, repetition_penalty, max_tokens: Sampling defaults (Orpheus' engine).
        llm_dir: A Hugging Face Llama checkpoint directory (config.json + safetensors).
        snac_dir: A SNAC checkpoint directory (config.json + pytorch_model.bin).
        noise_seed: Base seed of SNAC's noise (see `mstar.zoo.orpheus.codec`).
    """

    name: str
    llm: LlamaConfig
    snac: SnacConfig
    layout: TokenLayout
    constrained: bool = False
    temperature: float = 0.6
    top_p: float = 0.8
    repetition_penalty: float = 1.3
    max_tokens: int = 1200
    llm_dir: Path | None = None
    snac_dir: Path | None = None
    noise_seed: int = 0
    initializer_range: float = field(default=0.02, compare=False)

    def __post_init__(self) -> None:
        if self.llm.vocab_size < self.layout.num_ids:
            raise UnsupportedModelError(
                f"{self.name}: the LLM vocab ({self.llm.vocab_size}) is smaller than the id "
                f"layout needs ({self.layout.num_ids})"
            )
        if self.snac.codebook_size != self.layout.codebook_size:
            raise UnsupportedModelError(
                f"{self.name}: SNAC codebook_size {self.snac.codebook_size} != layout "
                f"codebook_size {self.layout.codebook_size}"
            )

    def with_checkpoints(self, llm_dir: str | Path, snac_dir: str | Path) -> OrpheusConfig:
        """Return a copy that loads its weights from these directories."""
        return dataclasses.replace(self, llm_dir=Path(llm_dir), snac_dir=Path(snac_dir))

    def require_checkpoints(self) -> tuple[Path, Path]:
        """Return ``(llm_dir, snac_dir)`` after checking that their files exist.

        Raises:
            CheckpointError: A directory is unset or lacks a file; the message says how to fix it.
        """
        hint = _MAKE_HINT.format(name=self.name)
        if self.llm_dir is None or self.snac_dir is None:
            raise CheckpointError(
                f"{self.name} has no checkpoint directories: pass an HF Llama directory and a "
                f"SNAC directory (config.with_checkpoints(llm_dir, snac_dir)); for random "
                f"weights run `{hint}`"
            )
        llm_needs = ("config.json",)
        snac_needs = ("config.json", "pytorch_model.bin")
        for directory, needs, what in (
            (self.llm_dir, llm_needs, "an HF Llama checkpoint (config.json + *.safetensors)"),
            (
                self.snac_dir,
                snac_needs,
                "a SNAC 24 kHz checkpoint (config.json + pytorch_model.bin)",
            ),
        ):
            if not directory.is_dir():
                raise CheckpointError(
                    f"{self.name}: checkpoint directory {str(directory)!r} does not exist; it "
                    f"must hold {what} (for random weights run `{hint}`)"
                )
            for name in needs:
                if not (directory / name).is_file():
                    raise CheckpointError(
                        f"{self.name}: {str(directory / name)!r} is missing; the directory must "
                        f"hold {what} (for random weights run `{hint}`)"
                    )
        has_weights = any(self.llm_dir.glob("*.safetensors"))
        if not has_weights:
            raise CheckpointError(
                f"{self.name}: {str(self.llm_dir)!r} has no *.safetensors weights; it must hold "
                f"an HF Llama checkpoint (for random weights run `{hint}`)"
            )
        return self.llm_dir, self.snac_dir


def _llama(
    *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, max_pos: int
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE),
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )


_REAL_LAYOUT = TokenLayout()
_TINY_LAYOUT = TokenLayout(tokeniser_length=1024, codebook_size=4096)

ORPHEUS_CONFIGS: dict[str, OrpheusConfig] = {
    # Llama-3.2-3B with the extended vocabulary (156,940 = 156,938 used ids, padded), and
    # hubertsiuzdak/snac_24khz. Checkpoints must be given: nothing downloads at run time.
    "orpheus-3b": OrpheusConfig(
        name="orpheus-3b",
        llm=_llama(
            vocab=156940, hidden=3072, layers=28, heads=24, kv_heads=8, mlp=8192, max_pos=131072
        ),
        snac=SnacConfig(),
        layout=_REAL_LAYOUT,
    ),
    # Meaningful on a CPU: the real token scheme and codec with a narrow, shallow backbone.
    "orpheus-small": OrpheusConfig(
        name="orpheus-small",
        llm=_llama(
            vocab=156940, hidden=512, layers=8, heads=8, kv_heads=4, mlp=1536, max_pos=16384
        ),
        snac=SnacConfig(),
        layout=_REAL_LAYOUT,
        constrained=True,
    ),
    # Seconds on a laptop: the same structure and rates (hop 512, 2048 samples per frame).
    "orpheus-tiny": OrpheusConfig(
        name="orpheus-tiny",
        llm=dataclasses.replace(
            _llama(
                vocab=_TINY_LAYOUT.num_ids,
                hidden=64,
                layers=2,
                heads=4,
                kv_heads=2,
                mlp=128,
                max_pos=16384,
            ),
            torch_dtype="float32",
        ),
        snac=SnacConfig(encoder_dim=4, decoder_dim=64),
        layout=_TINY_LAYOUT,
        constrained=True,
        initializer_range=0.15,  # wider logits: random-weight greedy choices are not near-ties
    ),
}


def get_orpheus_config(
    name: str, *, llm_dir: str | Path | None = None, snac_dir: str | Path | None = None
) -> OrpheusConfig:
    """Return the named config, with checkpoint directories if given.

    Raises:
        UnsupportedModelError: The name is not an Orpheus config.
    """
    try:
        config = ORPHEUS_CONFIGS[name]
    except KeyError:
        raise UnsupportedModelError(
            f"unknown Orpheus config {name!r}; choose one of {sorted(ORPHEUS_CONFIGS)}"
        ) from None
    if llm_dir is not None or snac_dir is not None:
        if llm_dir is None or snac_dir is None:
            raise CheckpointError("give both llm_dir and snac_dir, or neither")
        config = config.with_checkpoints(llm_dir, snac_dir)
    return config


def config_from_checkpoint(llm_dir: str | Path, snac_dir: str | Path) -> OrpheusConfig:
    """Return the config of a checkpoint: the speech LM's and SNAC's own ``config.json``.

    The id layout follows from the two: SNAC's ``codebook_size`` is ``K``; the text ids are
    Llama-3's 128,256 when the vocabulary holds them and the audio ids after them (the
    published model, whose vocabulary is padded), else every id below the 10 special and
    ``7 K`` audio ids. The name is the LM directory's; decoding is unconstrained, as upstream's.

    Raises:
        CheckpointError: A file or field is missing, or the two do not fit together.
    """
    llm_dir, snac_dir = Path(llm_dir), Path(snac_dir)
    try:
        llm = LlamaConfig.from_hf(load_hf_config(llm_dir))
    except UnsupportedModelError as exc:
        raise CheckpointError(f"{str(llm_dir / 'config.json')!r}: {exc}") from exc
    snac_file = snac_dir / "config.json"
    if not snac_file.is_file():
        raise CheckpointError(f"the SNAC checkpoint {str(snac_dir)!r} has no config.json")
    try:
        snac = SnacConfig.from_json_dict(read_json_object(snac_file))
    except UnsupportedModelError as exc:
        raise CheckpointError(f"{str(snac_file)!r}: {exc}") from exc
    audio_ids = _NUM_SPECIAL + FRAME_SIZE * snac.codebook_size
    text_ids = (
        LLAMA3_VOCAB_SIZE
        if llm.vocab_size >= LLAMA3_VOCAB_SIZE + audio_ids
        else llm.vocab_size - audio_ids
    )
    if text_ids < 16:
        raise CheckpointError(
            f"{str(llm_dir / 'config.json')!r}: vocab_size {llm.vocab_size} leaves no room "
            "for text ids beside "
            f"Orpheus's {audio_ids} special and audio ids (SNAC codebook_size {snac.codebook_size})"
        )
    layout = TokenLayout(tokeniser_length=text_ids, codebook_size=snac.codebook_size)
    try:
        return OrpheusConfig(
            name=llm_dir.name, llm=llm, snac=snac, layout=layout, llm_dir=llm_dir, snac_dir=snac_dir
        )
    except UnsupportedModelError as exc:
        raise CheckpointError(
            f"the Orpheus checkpoint {str(llm_dir)!r} with SNAC {str(snac_dir)!r}: {exc}"
        ) from exc
