"""pi0.5's prompt: the discretized state in the task text, tokenized by SentencePiece.

pi0.5 has no state token: the normalized robot state is binned into 256 bins and written into
the prompt as decimal text, which the VLM reads like any other words::

    BOS "Task: pick up the cup, State: 128 3 255 -1 ...;\\nAction: "  PAD PAD ...
    |<------------------ valid (mask True) ------------------>|<- id 0, mask False ->|
    |<---------------------------- max_token_len ----------------------------------->|

The real model uses PaliGemma's SentencePiece model (not shipped with any checkpoint: the user
gives its path). The small configs train a tiny BPE model of their own vocabulary size, once,
into the mstar cache, so that tests and CPU runs need nothing from the network.
"""

from __future__ import annotations

import io
import logging
import os
import random
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import sentencepiece

from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.cache import mstar_cache_dir
from mstar.zoo.pi05.config import Pi05Config

__all__ = [
    "MAX_TRAINED_VOCAB",
    "MIN_TRAINED_VOCAB",
    "NUM_STATE_BINS",
    "PromptTokenizer",
    "cached_tokenizer",
    "clean_task",
    "discretize_state",
    "pi05_prompt",
    "train_tiny_tokenizer",
]

log = logging.getLogger(__name__)

NUM_STATE_BINS = 256
# The vocabularies a tiny model can have: the specials, the 256 byte pieces and the corpus'
# characters come first (~310 pieces); the generated corpus below runs out of BPE merges at
# ~1300. Anything larger is a real tokenizer (PaliGemma's has 257,152 pieces) that the user
# must provide.
MIN_TRAINED_VOCAB = 384
MAX_TRAINED_VOCAB = 1024
# Bumped whenever the corpus or the trainer options change, so stale cached models are not reused.
_TOKENIZER_VERSION = 1
_PAD_ID = 0

# Left edges of the 256 bins over [-1, 1]: np.digitize returns 1..256 inside the range,
# 0 below -1 and 256 at or past the last edge (there is no right edge: 1.0 is in bin 255).
_BIN_EDGES = np.linspace(-1.0, 1.0, NUM_STATE_BINS + 1)[:-1]


def discretize_state(state: np.ndarray) -> np.ndarray:
    """Bin a normalized state into 256 bins over [-1, 1] (openpi's binning, no clipping).

    Values below -1 land in bin -1 and values at or above 0.9921875 (the last left edge) in
    bin 255, exactly as openpi's tokenizer writes them into the prompt.

    Args:
        state: Normalized state, any shape.

    Returns:
        int64 bins in -1..255, the shape of ``state``.
    """
    return (np.digitize(np.asarray(state), _BIN_EDGES) - 1).astype(np.int64)


def clean_task(task: str) -> str:
    """Return the task text as openpi writes it: stripped, underscores and newlines as spaces."""
    return task.strip().replace("_", " ").replace("\n", " ")


def pi05_prompt(task: str, state: np.ndarray | Sequence[float]) -> str:
    """Build pi0.5's prompt text from a task and the normalized (unpadded) state.

    Args:
        task: The instruction, e.g. ``"pick up the cup"``.
        state: The quantile-normalized state, 1-D (8 values on DROID).

    Returns:
        ``"Task: {task}, State: {bins};\\nAction: "`` with the bins space-separated.

    Raises:
        ValueError: The state is not 1-D or holds non-finite values (openpi would silently
            write NaN as bin 255).
    """
    values = np.asarray(state, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"state must be 1-D, got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError(f"state must be finite, got {values.tolist()}")
    return _format_prompt(task, discretize_state(values).tolist())


def _format_prompt(task: str, bins: Sequence[int]) -> str:
    return f"Task: {clean_task(task)}, State: {' '.join(str(b) for b in bins)};\nAction: "


class PromptTokenizer:
    """Tokenize pi0.5 prompts with a SentencePiece model, as openpi's PaliGemma tokenizer does.

    The prompt is encoded in one call with BOS in front, then padded with id 0 (or truncated)
    to ``max_token_len``.

    Args:
        model_file: A SentencePiece ``.model`` file.
        max_token_len: Tokens per prompt, BOS and padding included.
        vocab_size: The model's embedding rows; the tokenizer must not produce ids past it.

    Raises:
        CheckpointError: The file is missing or unreadable, has no BOS piece, or has more
            pieces than ``vocab_size``.
    """

    def __init__(
        self, model_file: str | Path, max_token_len: int, *, vocab_size: int | None = None
    ) -> None:
        path = Path(model_file)
        if not path.is_file():
            raise CheckpointError(f"SentencePiece model {str(path)!r} is not a file")
        if max_token_len < 1:
            raise ValueError(f"max_token_len must be positive, got {max_token_len}")
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"{str(path)!r} is not a SentencePiece model: {exc}") from None
        self.bos_id: int = self._processor.bos_id()
        if self.bos_id < 0:
            raise CheckpointError(f"SentencePiece model {str(path)!r} defines no BOS piece")
        self.num_pieces: int = self._processor.get_piece_size()
        if vocab_size is not None and self.num_pieces > vocab_size:
            raise CheckpointError(
                f"SentencePiece model {str(path)!r} has {self.num_pieces} pieces but the "
                "model embeds "
                f"only {vocab_size}: use the tokenizer the checkpoint was trained with"
            )
        self.max_token_len = max_token_len
        self.path = path

    @classmethod
    def from_config(
        cls, config: Pi05Config, tokenizer_path: str | Path | None = None
    ) -> PromptTokenizer:
        """Open the tokenizer of a config (see `cached_tokenizer`), sized by its
        ``max_token_len``."""
        path = cached_tokenizer(config, tokenizer_path)
        return cls(path, config.max_token_len, vocab_size=config.vocab_size)

    def token_ids(self, task: str, state: np.ndarray | Sequence[float] | None) -> list[int]:
        """Return the prompt's valid ids: BOS and the text, truncated to ``max_token_len``.

        mstar writes only these into the prefix; padding exists only in `encode`'s arrays.
        Without a state (openpi's ``discrete_state_input=False``, as ``pi05_libero``) the text is
        the cleaned task, then ``"\\n"`` encoded on its own, as openpi's tokenizer writes it.
        """
        if state is None:
            text = self._processor.encode(clean_task(task)) + self._processor.encode("\n")
        else:
            text = self._processor.encode(pi05_prompt(task, state))
        ids: list[int] = [self.bos_id, *text]
        if len(ids) > self.max_token_len:
            # openpi truncates too (and warns): the tail, "Action: " included, is lost.
            log.warning("pi0.5 prompt of %d tokens truncated to %d", len(ids), self.max_token_len)
            del ids[self.max_token_len :]
        return ids

    def encode(
        self, task: str, state: np.ndarray | Sequence[float] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize a prompt into fixed-length arrays, as openpi's tokenizer returns them.

        Args:
            task: The instruction.
            state: The quantile-normalized state, 1-D; None leaves it out of the prompt.

        Returns:
            ``(token_ids, mask)``: int64 ``[max_token_len]`` padded with id 0, and bool
            ``[max_token_len]``, True for real tokens (all True when truncated).
        """
        ids = self.token_ids(task, state)
        token_ids = np.full(self.max_token_len, _PAD_ID, dtype=np.int64)
        token_ids[: len(ids)] = ids
        mask = np.zeros(self.max_token_len, dtype=np.bool_)
        mask[: len(ids)] = True
        return token_ids, mask

    @staticmethod
    def num_tokens(mask: np.ndarray) -> int:
        """Count the real tokens of an `encode` mask."""
        return int(np.count_nonzero(mask))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Decode ids back to text (BOS and padding dropped), for logs and tests."""
        specials = {self.bos_id, _PAD_ID}
        return str(self._processor.decode([int(i) for i in token_ids if int(i) not in specials]))


# Words of DROID-style instructions: the tiny tokenizers learn them as whole pieces so that
# test prompts stay short; any other text still encodes, through byte fallback.
_TASKS = (
    "pick up the red cup",
    "put the marker in the bowl",
    "open the top drawer",
    "close the drawer",
    "move the block to the left",
    "move the can to the right",
    "wipe the table with the towel",
    "stack the green cube on the blue cube",
    "pour the water into the glass",
    "place the spoon on the plate",
    "push the button",
    "fold the cloth",
    "turn on the faucet",
    "put the apple in the basket",
    "take the lid off the pot",
    "hang the mug on the rack",
    "put the pen in the cup",
    "slide the box forward",
    "pick the banana and place it in the sink",
    "remove the book from the shelf",
)
_NUM_STATE_DIMS = 8  # DROID's joints and gripper, the prompts the tiny models will see
_NUM_CORPUS_PROMPTS = 4000


def _tokenizer_corpus(seed: int) -> Iterator[str]:
    """Yield the training sentences: pi0.5 prompts with random tasks and bins, and every bin."""
    rng = random.Random(seed)
    for _ in range(_NUM_CORPUS_PROMPTS):
        bins = [rng.randint(-1, NUM_STATE_BINS - 1) for _ in range(_NUM_STATE_DIMS)]
        yield _format_prompt(rng.choice(_TASKS), bins)
    # Every bin at least a few times more, so that none is rarer than the random draws make it.
    every_bin = " ".join(str(b) for b in range(-1, NUM_STATE_BINS))
    for _ in range(3):
        yield f"State: {every_bin};"


def train_tiny_tokenizer(path: str | Path, vocab_size: int, *, seed: int = 0) -> Path:
    """Train a small BPE SentencePiece model on generated pi0.5 prompts and write it atomically.

    The ids of the special pieces are PaliGemma's (pad 0, eos 1, bos 2, unk 3); byte fallback
    makes every string encodable. Training is single-threaded from a seeded corpus, so the same
    arguments write the same bytes.

    Args:
        path: Where to write the ``.model`` file (parents are created).
        vocab_size: Pieces in the model, `MIN_TRAINED_VOCAB`..`MAX_TRAINED_VOCAB`.
        seed: Seed of the generated corpus.

    Returns:
        ``path``.

    Raises:
        UnsupportedModelError: The vocabulary is outside what the generated corpus can train.
    """
    if not MIN_TRAINED_VOCAB <= vocab_size <= MAX_TRAINED_VOCAB:
        raise UnsupportedModelError(
            f"a tiny pi0.5 tokenizer has {MIN_TRAINED_VOCAB}..{MAX_TRAINED_VOCAB} pieces, "
            f"got {vocab_size}"
        )
    model = io.BytesIO()
    # Gemma's normalization: text as is (identity, whitespace kept), so "\n" survives.
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_tokenizer_corpus(seed),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        pad_id=_PAD_ID,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        num_threads=1,
        minloglevel=2,
    )
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: a reader never sees half a model, and two
    # processes training at once just replace identical files.
    fd, scratch = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(model.getvalue())
            file.flush()
            os.fsync(file.fileno())
        os.replace(scratch, target)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
    return target


def cached_tokenizer(config: Pi05Config, tokenizer_path: str | Path | None = None) -> Path:
    """Return the SentencePiece model file of a config.

    A path given by the user wins. Otherwise the small configs (vocabulary up to
    `MAX_TRAINED_VOCAB`) train a tiny model once into ``<mstar cache>/pi05/``, keyed by
    vocabulary size; the real model needs PaliGemma's ``tokenizer.model``.

    Raises:
        CheckpointError: The given path is not a file, or the config needs the real tokenizer
            and no path was given.
    """
    if tokenizer_path is not None:
        path = Path(tokenizer_path)
        if not path.is_file():
            raise CheckpointError(f"pi0.5 tokenizer {str(path)!r} is not a file")
        return path
    if config.vocab_size > MAX_TRAINED_VOCAB:
        raise CheckpointError(
            f"{config.name} needs PaliGemma's SentencePiece tokenizer ({config.vocab_size} "
            "pieces), which "
            "no pi0.5 checkpoint ships: download paligemma_tokenizer.model (gs://big_vision/, or "
            "tokenizer.model of google/paligemma-3b-pt-224) and pass its path"
        )
    path = (
        mstar_cache_dir() / "pi05" / f"tokenizer-bpe{config.vocab_size}-v{_TOKENIZER_VERSION}.model"
    )
    if not path.is_file():
        train_tiny_tokenizer(path, config.vocab_size)
    return path
