"""pi0.5's prompt and DROID policy transforms: binning, tokenizer, normalization, parsing,
images."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sentencepiece
import torch
from PIL import Image

from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.pi05.config import get_pi05_config
from mstar.zoo.pi05.policy import (
    EXTERIOR_IMAGE_KEY,
    GRIPPER_POSITION_KEY,
    JOINT_POSITION_KEY,
    PROMPT_KEY,
    WRIST_IMAGE_KEY,
    DroidObservation,
    NormStats,
    QuantileStats,
    absent_image,
    droid_actions,
    prepare_image,
    quantile_normalize,
    quantile_unnormalize,
    resize_with_pad,
    write_norm_stats,
)
from mstar.zoo.pi05.prompt import (
    PromptTokenizer,
    cached_tokenizer,
    discretize_state,
    pi05_prompt,
    train_tiny_tokenizer,
)

# -- binning ---------------------------------------------------------------------------------

# Left bin edges are e_k = -1 + k/128 (k = 0..255); the bin is #{k : e_k <= x} - 1.
BIN_CASES = [
    (-1.5, -1),  # below every edge: no clipping, bin -1
    (-1.0, 0),  # e_0 = -1
    (-1.0 + 1 / 128 - 1e-9, 0),  # just below e_1
    (-1.0 + 1 / 128, 1),  # e_1
    (-1 / 128, 127),  # e_127
    (0.0, 128),  # e_128
    (0.1, 140),  # 1.1 * 128 = 140.8 -> k <= 140
    (-0.3, 89),  # 0.7 * 128 = 89.6 -> k <= 89
    # e_192 = 0.5 exactly, so 0.5 is in bin 192. /work/shared/zoo/pi05.md says 191, which is
    # round((0.5 + 1) / 2 * 255), not openpi's digitize formula; the formula gives 192.
    (0.5, 192),
    (0.99, 254),  # 1.99 * 128 = 254.72 -> k <= 254
    (0.9921875, 255),  # e_255 = 127/128, the last edge
    (1.0, 255),
    (1.5, 255),
]


@pytest.mark.parametrize(("value", "expected"), BIN_CASES)
def test_discretize_state_matches_the_digitize_formula(value: float, expected: int) -> None:
    formula = int(np.digitize(value, np.linspace(-1, 1, 257)[:-1]) - 1)
    assert formula == expected
    assert discretize_state(np.array([value]))[0] == expected


def test_discretize_state_keeps_shape_and_returns_int64() -> None:
    values = np.array([[value for value, _ in BIN_CASES]] * 2)
    bins = discretize_state(values)
    assert bins.shape == values.shape and bins.dtype == np.int64
    assert bins[1].tolist() == [expected for _, expected in BIN_CASES]


DROID_STATE = [0.1, -0.3, 0.99, -1.0, 1.0, 0.5, 0.0, -2.0]


def test_prompt_string_for_a_droid_state() -> None:
    assert pi05_prompt("pick up the cup", DROID_STATE) == (
        "Task: pick up the cup, State: 140 89 254 0 255 192 128 -1;\nAction: "
    )


def test_prompt_cleans_the_task_but_keeps_its_case() -> None:
    prompt = pi05_prompt("  Put_the marker\nin the Bowl \n", [0.0])
    assert prompt == "Task: Put the marker in the Bowl, State: 128;\nAction: "


@pytest.mark.parametrize("state", [[[0.0, 1.0]], [float("nan")], [0.0, float("inf")]])
def test_prompt_rejects_non_vector_or_non_finite_state(state: Any) -> None:
    with pytest.raises(ValueError, match="state"):
        pi05_prompt("task", state)


# -- tokenizer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("spm") / "tiny.model", 512)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PromptTokenizer:
    return PromptTokenizer(tiny_model, max_token_len=48, vocab_size=512)


def test_tiny_tokenizer_has_paligemma_special_ids(tiny_model: Path) -> None:
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tiny_model))
    assert processor.get_piece_size() == 512
    assert (processor.pad_id(), processor.eos_id(), processor.bos_id(), processor.unk_id()) == (
        0,
        1,
        2,
        3,
    )
    # Byte fallback: text the corpus never saw still round-trips.
    text = "Zürich 日本 ~ {x}"
    assert processor.decode(processor.encode(text)) == text
    assert processor.unk_id() not in processor.encode(text)


def test_tiny_tokenizer_training_is_deterministic(tmp_path: Path, tiny_model: Path) -> None:
    again = train_tiny_tokenizer(tmp_path / "again.model", 512)
    assert again.read_bytes() == tiny_model.read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name != "again.model"]  # no scratch file left


@pytest.mark.parametrize("vocab_size", [100, 383, 1025, 257_152])
def test_tiny_tokenizer_rejects_untrainable_vocab(tmp_path: Path, vocab_size: int) -> None:
    with pytest.raises(UnsupportedModelError):
        train_tiny_tokenizer(tmp_path / "x.model", vocab_size)


def test_encode_prepends_bos_pads_with_zero_and_masks(
    tokenizer: PromptTokenizer, tiny_model: Path
) -> None:
    token_ids, mask = tokenizer.encode("pick up the red cup", DROID_STATE)
    assert token_ids.shape == mask.shape == (48,)
    assert token_ids.dtype == np.int64 and mask.dtype == np.bool_
    num = PromptTokenizer.num_tokens(mask)
    valid = tokenizer.token_ids("pick up the red cup", DROID_STATE)
    assert num == len(valid) < 48
    assert mask[:num].all() and not mask[num:].any()
    assert (token_ids[num:] == 0).all()
    # BOS, then ONE encode call of the whole prompt ("\n" included).
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tiny_model))
    prompt = pi05_prompt("pick up the red cup", DROID_STATE)
    assert token_ids[:num].tolist() == valid == [2, *processor.encode(prompt)]
    assert tokenizer.decode(token_ids) == prompt


def test_encode_truncates_long_prompts(
    tiny_model: Path, tokenizer: PromptTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    short = PromptTokenizer(tiny_model, max_token_len=10)
    with caplog.at_level(logging.WARNING):
        token_ids, mask = short.encode("pick up the red cup", DROID_STATE)
    assert "truncated" in caplog.text
    assert mask.all() and PromptTokenizer.num_tokens(mask) == 10
    full = tokenizer.token_ids("pick up the red cup", DROID_STATE)
    assert token_ids.tolist() == full[:10] == short.token_ids("pick up the red cup", DROID_STATE)


def test_tokenizer_rejects_a_model_larger_than_the_embedding(tmp_path: Path) -> None:
    path = train_tiny_tokenizer(tmp_path / "big.model", 1024)
    with pytest.raises(CheckpointError, match="1024 pieces"):
        PromptTokenizer(path, 48, vocab_size=512)


def test_tokenizer_rejects_missing_or_garbage_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a file"):
        PromptTokenizer(tmp_path / "absent.model", 48)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="not a SentencePiece model"):
        PromptTokenizer(garbage, 48)


def test_cached_tokenizer_trains_once_per_vocab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))
    tiny, small = get_pi05_config("pi05-tiny"), get_pi05_config("pi05-small")
    tiny_path = cached_tokenizer(tiny)
    assert tiny_path.is_relative_to(tmp_path) and "512" in tiny_path.name
    mtime = tiny_path.stat().st_mtime_ns
    assert cached_tokenizer(tiny) == tiny_path and tiny_path.stat().st_mtime_ns == mtime
    small_path = cached_tokenizer(small)
    assert small_path != tiny_path and "1024" in small_path.name
    tok = PromptTokenizer.from_config(small)
    assert tok.num_pieces == 1024 and tok.max_token_len == small.max_token_len


def test_droid_config_needs_the_real_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))
    droid = get_pi05_config("pi05-droid")
    with pytest.raises(CheckpointError, match="PaliGemma"):
        cached_tokenizer(droid)
    with pytest.raises(CheckpointError, match="not a file"):
        cached_tokenizer(droid, tmp_path / "tokenizer.model")
    given = tmp_path / "tokenizer.model"
    given.write_bytes(b"x")
    assert cached_tokenizer(droid, given) == given


# -- normalization ---------------------------------------------------------------------------


def _stats(num_dims: int, seed: int = 0) -> QuantileStats:
    rng = np.random.default_rng(seed)
    q01 = rng.uniform(-2, 0, num_dims)
    return QuantileStats(q01=q01, q99=q01 + rng.uniform(0.1, 3, num_dims))


def test_normalize_formula_and_round_trip() -> None:
    stats = QuantileStats(q01=np.array([0.0, 10.0]), q99=np.array([2.0, 20.0]))
    x = np.array([1.0, 20.0])
    expected = np.array([1.0 / (2.0 + 1e-6) * 2 - 1, 10.0 / (10.0 + 1e-6) * 2 - 1])
    np.testing.assert_array_equal(quantile_normalize(x, stats), expected)
    rng = np.random.default_rng(1)
    values = rng.normal(size=(5, 8))
    stats8 = _stats(8)
    normalized = quantile_normalize(values, stats8)
    assert normalized.dtype == np.float64
    np.testing.assert_allclose(quantile_unnormalize(normalized, stats8), values, rtol=0, atol=1e-12)
    # q01 -> -1 and q99 -> 1 less the epsilon's share.
    span = stats8.q99 - stats8.q01
    np.testing.assert_allclose(quantile_normalize(stats8.q01, stats8), -1.0, atol=1e-12)
    np.testing.assert_allclose(
        quantile_normalize(stats8.q99, stats8), span / (span + 1e-6) * 2 - 1, atol=1e-12
    )


def test_epsilon_keeps_a_constant_dimension_finite() -> None:
    stats = QuantileStats(q01=np.array([0.5]), q99=np.array([0.5]))
    assert quantile_normalize(np.array([0.5]), stats)[0] == -1.0
    np.testing.assert_allclose(quantile_normalize(np.array([0.5 + 1e-6]), stats), [1.0], rtol=1e-9)
    # Unnormalize spans exactly the epsilon: -1 -> q01, 1 -> q01 + 1e-6.
    np.testing.assert_array_equal(quantile_unnormalize(np.array([-1.0]), stats), [0.5])
    np.testing.assert_allclose(
        quantile_unnormalize(np.array([1.0]), stats), [0.5 + 1e-6], rtol=1e-12
    )


def test_normalize_slices_stats_to_the_state() -> None:
    stats = _stats(32)
    state = np.linspace(-1, 1, 8)
    np.testing.assert_array_equal(
        quantile_normalize(state, stats),
        quantile_normalize(state, QuantileStats(q01=stats.q01[:8], q99=stats.q99[:8])),
    )
    with pytest.raises(ValueError, match="9 dims"):
        quantile_normalize(np.zeros(9), _stats(8))


def test_unnormalize_passes_dims_past_the_stats_through() -> None:
    stats = _stats(8)
    actions = np.random.default_rng(2).normal(size=(15, 32)).astype(np.float32)
    out = quantile_unnormalize(actions, stats)
    assert out.shape == (15, 32) and out.dtype == np.float64
    np.testing.assert_array_equal(out[:, 8:], actions[:, 8:].astype(np.float64))
    expected = (actions[:, :8].astype(np.float64) + 1) / 2 * (
        stats.q99 - stats.q01 + 1e-6
    ) + stats.q01
    np.testing.assert_array_equal(out[:, :8], expected)
    # Stats longer than the actions are cut to them.
    np.testing.assert_array_equal(quantile_unnormalize(actions[:, :4], stats), expected[:, :4])
    norm = NormStats(state=_stats(8), actions=stats)
    np.testing.assert_array_equal(droid_actions(torch.from_numpy(actions), norm), expected)
    assert droid_actions(actions, norm, robot_dof=7).shape == (15, 7)


def _stats_doc() -> dict[str, Any]:
    entry = {"mean": [0.0, 1.0], "std": [1.0, 2.0], "q01": [-1.0, 0.0], "q99": [1.0, 3.0]}
    return {"norm_stats": {"state": entry, "actions": dict(entry), "extra": {"mean": [0.0]}}}


def test_norm_stats_load_and_write_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "assets" / "droid" / "norm_stats.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_stats_doc()))
    stats = NormStats.load(path)
    np.testing.assert_array_equal(stats.state.q99, [1.0, 3.0])
    assert stats.actions.mean is not None and stats.actions.std is not None
    written = write_norm_stats(tmp_path / "out" / "norm_stats.json", stats)
    document = json.loads(written.read_text())
    assert document["norm_stats"]["state"] == _stats_doc()["norm_stats"]["state"]
    again = NormStats.load(written)
    np.testing.assert_array_equal(again.actions.q01, stats.actions.q01)
    # Quantiles only (no mean/std) write and load too.
    bare = NormStats(state=_stats(3), actions=_stats(4))
    assert NormStats.load(write_norm_stats(tmp_path / "bare.json", bare)).actions.num_dims == 4


def _broken(doc: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    node = doc
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return doc


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: _broken(d, ("norm_stats",)), "'norm_stats'"),
        (lambda d: _broken(d, ("norm_stats", "actions")), "norm_stats.actions"),
        (lambda d: _broken(d, ("norm_stats", "state", "q01")), "norm_stats.state.q01"),
        (lambda d: _broken(d, ("norm_stats", "actions", "q99")), "norm_stats.actions.q99"),
        (lambda d: d["norm_stats"]["state"].update(q99=[1.0]) or d, "norm_stats.state"),
        (lambda d: d["norm_stats"]["state"].update(q01=["a", "b"]) or d, "not a list of numbers"),
        (lambda d: [], "'norm_stats'"),
    ],
)
def test_norm_stats_errors_name_the_key(tmp_path: Path, edit: Any, match: str) -> None:
    path = tmp_path / "norm_stats.json"
    path.write_text(json.dumps(edit(_stats_doc())))
    with pytest.raises(CheckpointError, match=re.escape(match)):
        NormStats.load(path)


def test_norm_stats_missing_or_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        NormStats.load(tmp_path / "norm_stats.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        NormStats.load(bad)


# -- DROID observations ----------------------------------------------------------------------


def _obs(**overrides: Any) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    obs: dict[str, Any] = {
        EXTERIOR_IMAGE_KEY: rng.integers(0, 256, (180, 320, 3), dtype=np.uint8),
        WRIST_IMAGE_KEY: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        JOINT_POSITION_KEY: np.linspace(-1, 1, 7),
        GRIPPER_POSITION_KEY: np.array([0.25]),
        PROMPT_KEY: "pick up the red cup",
    }
    obs.update(overrides)
    return obs


def test_parse_a_droid_observation() -> None:
    obs = _obs()
    parsed = DroidObservation.parse(obs)
    assert parsed.exterior_image.shape == (180, 320, 3) and parsed.exterior_image.dtype == np.uint8
    np.testing.assert_array_equal(parsed.state, [*np.linspace(-1, 1, 7), 0.25])
    assert parsed.state.dtype == np.float64
    assert parsed.prompt == "pick up the red cup"


def test_parse_accepts_openpi_variants() -> None:
    floats = np.full((3, 16, 24), 0.5, dtype=np.float32)  # float [0, 1], channels first
    parsed = DroidObservation.parse(
        _obs(
            **{WRIST_IMAGE_KEY: floats, GRIPPER_POSITION_KEY: 0.75, PROMPT_KEY: b"open the drawer"}
        )
    )
    assert parsed.wrist_image.shape == (16, 24, 3) and parsed.wrist_image.dtype == np.uint8
    assert (parsed.wrist_image == 127).all()  # 0.5 * 255 = 127.5, truncated as openpi does
    assert parsed.state[-1] == 0.75 and parsed.prompt == "open the drawer"
    assert DroidObservation.parse(_obs(**{JOINT_POSITION_KEY: list(range(7))})).state[
        :7
    ].tolist() == list(range(7))


MALFORMED = [
    (EXTERIOR_IMAGE_KEY, None, "no"),
    (WRIST_IMAGE_KEY, None, "no"),
    (JOINT_POSITION_KEY, None, "no"),
    (GRIPPER_POSITION_KEY, None, "no"),
    (PROMPT_KEY, None, "no"),
    (EXTERIOR_IMAGE_KEY, np.zeros((224, 224), np.uint8), "shape"),
    (EXTERIOR_IMAGE_KEY, np.zeros((224, 224, 4), np.uint8), "shape"),
    (EXTERIOR_IMAGE_KEY, np.zeros((0, 224, 3), np.uint8), "shape"),
    (WRIST_IMAGE_KEY, np.full((8, 8, 3), 300, np.int64), "uint8"),  # integers must be pixel values
    (WRIST_IMAGE_KEY, np.full((8, 8, 3), 1.5, np.float32), r"\[0, 1\]"),
    (WRIST_IMAGE_KEY, np.full((8, 8, 3), np.nan, np.float32), "finite"),
    (WRIST_IMAGE_KEY, "an image", "shape"),
    (WRIST_IMAGE_KEY, np.full((8, 8, 3), "a"), "dtype"),
    (JOINT_POSITION_KEY, np.zeros(6), "shape"),
    (JOINT_POSITION_KEY, np.zeros((1, 7)), "shape"),
    (JOINT_POSITION_KEY, 0.0, "shape"),
    (JOINT_POSITION_KEY, np.array(["a"] * 7), "dtype"),
    (JOINT_POSITION_KEY, np.ones(7, dtype=bool), "dtype"),
    (JOINT_POSITION_KEY, [[1, 2], [3]], "7 numbers"),
    (JOINT_POSITION_KEY, np.array([0, 0, 0, 0, 0, 0, np.nan]), "finite"),
    (GRIPPER_POSITION_KEY, np.zeros(2), "shape"),
    (GRIPPER_POSITION_KEY, np.inf, "finite"),
    (PROMPT_KEY, "", "non-empty"),
    (PROMPT_KEY, "  \n", "non-empty"),
    (PROMPT_KEY, 42, "string"),
    (PROMPT_KEY, b"\xff\xfe", "UTF-8"),
]


@pytest.mark.parametrize(("key", "value", "match"), MALFORMED)
def test_parse_rejects_malformed_input_naming_the_key(key: str, value: Any, match: str) -> None:
    obs = _obs()
    if value is None:
        del obs[key]
    else:
        obs[key] = value
    with pytest.raises(ValueError, match=re.escape(repr(key))) as info:
        DroidObservation.parse(obs)
    assert re.search(match, str(info.value)), str(info.value)


def test_parse_rejects_a_non_mapping() -> None:
    with pytest.raises(ValueError, match="mapping"):
        DroidObservation.parse([("prompt", "x")])  # type: ignore[arg-type]


# -- images ----------------------------------------------------------------------------------


def test_prepare_image_maps_uint8_to_minus_one_one() -> None:
    image = np.arange(224 * 224 * 3, dtype=np.int64).reshape(224, 224, 3).astype(np.uint8)
    out = prepare_image(image, 224)
    assert out.shape == (3, 224, 224) and out.dtype == torch.float32
    expected = torch.from_numpy(image).permute(2, 0, 1).float() / 255.0 * 2.0 - 1.0
    assert torch.equal(out, expected)  # same size: no resize at all
    assert out.min() == -1.0 and out.max() == 1.0


def test_resize_with_pad_geometry_100x200_to_224() -> None:
    white = np.full((100, 200, 3), 255, dtype=np.uint8)
    out = prepare_image(white, 224)
    # ratio 200/224: resized to 112x224, 56 black rows above and below.
    assert (out[:, :56] == -1).all() and (out[:, 168:] == -1).all()
    assert (out[:, 56:168] == 1).all()
    tall = prepare_image(np.full((200, 100, 3), 255, dtype=np.uint8), 224)
    assert (
        (tall[:, :, :56] == -1).all()
        and (tall[:, :, 168:] == -1).all()
        and (tall[:, :, 56:168] == 1).all()
    )


def test_resize_with_pad_puts_the_odd_pixel_after() -> None:
    # 10x8 to 32: ratio 10/32, resized 32 x int(25.6) = 25; 7 columns of pad: 3 left, 4 right.
    out = resize_with_pad(np.full((10, 8, 3), 200, dtype=np.uint8), 32)
    assert out.shape == (32, 32, 3)
    assert (out[:, :3] == 0).all() and (out[:, 28:] == 0).all() and (out[:, 3:28] == 200).all()


def test_resize_is_pil_bilinear() -> None:
    image = np.random.default_rng(4).integers(0, 256, (180, 320, 3), dtype=np.uint8)
    out = resize_with_pad(image, 224)
    # ratio 320/224: 126 x 224, 49 rows above.
    reference = np.asarray(
        Image.fromarray(image).resize((224, 126), resample=Image.Resampling.BILINEAR)
    )
    np.testing.assert_array_equal(out[49:175], reference)
    assert (out[:49] == 0).all() and (out[175:] == 0).all()


def test_prepare_image_rejects_non_uint8_hwc() -> None:
    with pytest.raises(ValueError, match="uint8"):
        prepare_image(np.zeros((8, 8, 3), np.float32), 8)
    with pytest.raises(ValueError, match="uint8"):
        prepare_image(np.zeros((3, 8, 8), np.uint8), 8)


def test_camera_images_mark_the_missing_right_wrist() -> None:
    parsed = DroidObservation.parse(_obs())
    config = get_pi05_config("pi05-tiny")
    size = config.vision.image_size
    images, mask = parsed.camera_images(config.cameras, size)
    assert images.shape == (3, 3, size, size) and images.dtype == torch.float32
    assert mask.tolist() == [True, True, False]
    assert torch.equal(images[0], prepare_image(parsed.exterior_image, size))
    assert torch.equal(images[1], prepare_image(parsed.wrist_image, size))
    assert torch.equal(images[2], absent_image(size)) and (images[2] == -1).all()
    assert images.min() >= -1 and images.max() <= 1
