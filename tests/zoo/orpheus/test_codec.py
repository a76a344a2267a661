"""SNAC through the `snac` package: frame layout, seeded noise, batching, folding, loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from snac import SNAC

from mstar.errors import CheckpointError
from mstar.zoo.orpheus import SnacCodec, SnacConfig, frames_to_codes, load_snac

TINY = SnacConfig(encoder_dim=4, decoder_dim=64)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _snac(config: SnacConfig, seed: int = 0) -> SNAC:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SNAC(**config.to_json_dict()).eval()


def _frames(batch: int, num_frames: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (batch, num_frames, 7), generator=gen)


def test_frames_map_to_levels_as_the_reference_decoder() -> None:
    frames = torch.arange(2 * 7).view(1, 2, 7)  # frame f position p holds 7f + p
    c0, c1, c2 = frames_to_codes(frames)
    assert c0.tolist() == [[0, 7]]
    assert c1.tolist() == [[1, 4, 8, 11]]
    assert c2.tolist() == [[2, 3, 5, 6, 9, 10, 12, 13]]
    with pytest.raises(ValueError, match=r"\[batch, frames, 7\]"):
        frames_to_codes(torch.zeros(2, 7, dtype=torch.long))


def test_decode_gives_2048_samples_per_frame() -> None:
    codec = SnacCodec(_snac(TINY), TINY)
    assert (codec.sample_rate, codec.samples_per_frame) == (24000, 2048)
    for num_frames in (1, 2, 3, 4, 6):
        audio = codec.decode(_frames(2, num_frames), seeds=[1, 2])
        assert audio.shape == (2, num_frames * 2048)
        assert audio.dtype == torch.float32
        assert float(audio.abs().max()) <= 1.0  # SNAC ends in tanh


def test_seeded_noise_equals_snacs_own_decode() -> None:
    # One row seeded s draws the noise SNAC's NoiseBlocks draw from the global RNG seeded s.
    model = _snac(TINY)
    codec = SnacCodec(_snac(TINY), TINY, fold_weight_norm=False)
    frames = _frames(1, 4)
    ours = codec.decode(frames, seeds=[1234])
    torch.manual_seed(1234)
    with torch.inference_mode():
        theirs = model.decode(frames_to_codes(frames)).reshape(1, -1)
    assert torch.equal(ours, theirs)


def test_noise_is_per_row_seeded_and_batching_keeps_each_row() -> None:
    codec = SnacCodec(_snac(TINY), TINY)
    frames = _frames(5, 4)
    seeds = [7, 8, 9, 10, 11]
    batched = codec.decode(frames, seeds)
    alone = torch.cat([codec.decode(frames[i : i + 1], [seeds[i]]) for i in range(5)])
    # The same noise per row; only float rounding of the batched convolutions differs.
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-5)
    assert torch.equal(codec.decode(frames[:1], [7]), codec.decode(frames[:1], [7]))
    assert not torch.allclose(codec.decode(frames[:1], [7]), codec.decode(frames[:1], [8]))
    with pytest.raises(ValueError, match="one seed per row"):
        codec.decode(frames)


def test_noise_off_is_deterministic_without_seeds() -> None:
    codec = SnacCodec(_snac(TINY), TINY, noise="off")
    frames = _frames(2, 4)
    assert torch.equal(codec.decode(frames), codec.decode(frames))
    seeded = SnacCodec(_snac(TINY), TINY).decode(frames, [0, 1])
    assert not torch.allclose(codec.decode(frames), seeded)
    with pytest.raises(ValueError, match="'seeded' or 'off'"):
        SnacCodec(_snac(TINY), TINY, noise="random")  # type: ignore[arg-type]


def test_folded_weight_norm_decodes_the_same() -> None:
    folded = SnacCodec(_snac(TINY), TINY, noise="off")
    plain = SnacCodec(_snac(TINY), TINY, noise="off", fold_weight_norm=False)
    assert not any("parametrizations" in name for name in folded.module.state_dict())
    frames = _frames(3, 4)
    torch.testing.assert_close(folded.decode(frames), plain.decode(frames), rtol=0, atol=1e-5)


def test_out_of_range_codes_are_rejected() -> None:
    codec = SnacCodec(_snac(TINY), TINY, noise="off")
    with pytest.raises(ValueError, match=r"\[0, 4096\)"):
        codec.decode(torch.full((1, 1, 7), 4096))
    with pytest.raises(ValueError, match=r"\[0, 4096\)"):
        codec.decode(torch.full((1, 1, 7), -1))


def test_real_size_codec_matches_snac() -> None:
    # The one real-size (24 kHz, 19.8 M parameters) decode: one 4-frame window.
    real = SnacConfig()
    codec = SnacCodec(_snac(real), real)
    frames = _frames(1, 4)
    ours = codec.decode(frames, seeds=[5])
    torch.manual_seed(5)
    with torch.inference_mode():
        theirs = _snac(real).decode(frames_to_codes(frames)).reshape(1, -1)
    assert ours.shape == (1, 8192)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)  # folded weight norm: rounding only


def _save(directory: Path, config: SnacConfig, state: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_json_dict()))
    torch.save(state, directory / "pytorch_model.bin")
    return directory


def test_load_snac_reads_a_local_directory(tmp_path: Path) -> None:
    model = _snac(TINY, seed=3)
    state = model.state_dict()
    assert any(k.endswith("parametrizations.weight.original0") for k in state)
    directory = _save(tmp_path / "snac", TINY, state)
    codec = load_snac(directory, expected=TINY, noise="off")
    reference = SnacCodec(_snac(TINY, seed=3), TINY, noise="off")
    frames = _frames(1, 4)
    assert torch.equal(codec.decode(frames), reference.decode(frames))


def test_load_snac_accepts_old_weight_norm_keys(tmp_path: Path) -> None:
    # Checkpoints written with torch.nn.utils.weight_norm name the parts weight_g / weight_v.
    state = {
        k.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        ): v
        for k, v in _snac(TINY, seed=4).state_dict().items()
    }
    codec = load_snac(_save(tmp_path / "old", TINY, state), noise="off")
    reference = SnacCodec(_snac(TINY, seed=4), TINY, noise="off")
    frames = _frames(1, 4)
    assert torch.equal(codec.decode(frames), reference.decode(frames))


def test_load_snac_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"lacks config.json.*make_orpheus_checkpoint"):
        load_snac(tmp_path / "nowhere")
    directory = _save(tmp_path / "snac", TINY, _snac(TINY).state_dict())
    (directory / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match=r"lacks pytorch_model\.bin"):
        load_snac(directory)
    directory = _save(tmp_path / "other", TINY, _snac(TINY).state_dict())
    with pytest.raises(CheckpointError, match="expected"):
        load_snac(directory, expected=SnacConfig())
    (directory / "config.json").write_text(json.dumps({**TINY.to_json_dict(), "bogus": 1}))
    with pytest.raises(CheckpointError, match=r"unknown fields \['bogus'\]"):
        load_snac(directory)
    wrong = SnacConfig(encoder_dim=4, decoder_dim=32)
    _save(tmp_path / "wrong", wrong, _snac(TINY).state_dict())
    with pytest.raises(CheckpointError, match="does not match the SNAC config"):
        load_snac(tmp_path / "wrong")
    (tmp_path / "wrong" / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_snac(tmp_path / "wrong")
