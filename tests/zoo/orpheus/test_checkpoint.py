"""Random Orpheus checkpoints in the real formats, and loading them (configs included)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.llama import LlamaCausalLM
from mstar.zoo.orpheus import (
    ORPHEUS_CONFIGS,
    OrpheusConfig,
    SnacConfig,
    get_orpheus_config,
    load_orpheus_codec,
    load_orpheus_llm,
    make_random_checkpoint,
)

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> OrpheusConfig:
    return make_random_checkpoint(
        get_orpheus_config("orpheus-tiny"), tmp_path_factory.mktemp("tiny")
    )


def test_configs_have_the_published_sizes() -> None:
    real = ORPHEUS_CONFIGS["orpheus-3b"]
    llm = real.llm
    assert (llm.hidden_size, llm.num_hidden_layers, llm.intermediate_size) == (3072, 28, 8192)
    assert (llm.num_attention_heads, llm.num_key_value_heads, llm.head_dim) == (24, 8, 128)
    assert (llm.vocab_size, llm.rope_theta, llm.rms_norm_eps) == (156940, 500000.0, 1e-5)
    assert llm.rope_scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert real.snac == SnacConfig()
    assert (real.snac.hop_length, real.snac.samples_per_frame) == (512, 2048)
    assert real.layout.audio_start == 128266 and not real.constrained
    small = ORPHEUS_CONFIGS["orpheus-small"]
    assert (small.llm.hidden_size, small.llm.num_hidden_layers) == (512, 8)
    assert small.layout == real.layout and small.snac == real.snac and small.constrained
    tiny = ORPHEUS_CONFIGS["orpheus-tiny"]
    assert tiny.llm.vocab_size == tiny.layout.num_ids == 1024 + 10 + 7 * 4096
    assert (tiny.snac.hop_length, tiny.snac.samples_per_frame) == (512, 2048) and tiny.constrained


def test_config_validation() -> None:
    with pytest.raises(
        UnsupportedModelError, match=r"unknown Orpheus config 'orpheus-7b'.*orpheus-tiny"
    ):
        get_orpheus_config("orpheus-7b")
    with pytest.raises(UnsupportedModelError, match="vq_strides"):
        SnacConfig(vq_strides=(8, 4, 2, 1))
    with pytest.raises(UnsupportedModelError, match="same product"):
        SnacConfig(decoder_rates=(8, 8, 4))
    with pytest.raises(CheckpointError, match="both"):
        get_orpheus_config("orpheus-tiny", llm_dir="x")


def test_tiny_checkpoint_is_in_the_published_formats(tiny: OrpheusConfig) -> None:
    assert tiny.llm_dir is not None and tiny.snac_dir is not None
    assert {p.name for p in tiny.llm_dir.iterdir()} >= {"config.json", "model.safetensors"}
    assert {p.name for p in tiny.snac_dir.iterdir()} == {"config.json", "pytorch_model.bin"}
    hf = json.loads((tiny.llm_dir / "config.json").read_text())
    assert (hf["model_type"], hf["vocab_size"], hf["eos_token_id"]) == ("llama", 29706, 1026)
    state = torch.load(tiny.snac_dir / "pytorch_model.bin", weights_only=True)
    assert "decoder.model.0.parametrizations.weight.original0" in state
    assert "encoder.block.0.parametrizations.weight.original1" in state


def test_llm_loads_into_mstars_llama_with_transformers_weights(tiny: OrpheusConfig) -> None:
    model = load_orpheus_llm(tiny)
    assert isinstance(model, LlamaCausalLM)
    reference = HFLlamaForCausalLM.from_pretrained(tiny.llm_dir)
    theirs = reference.state_dict()
    ours = model.state_dict()
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_codec_loads_and_decodes(tiny: OrpheusConfig) -> None:
    codec = load_orpheus_codec(tiny)
    audio = codec.decode(torch.zeros(1, 4, 7, dtype=torch.long), [0])
    assert audio.shape == (1, 8192) and torch.isfinite(audio).all()


def test_same_seed_same_weights(tiny: OrpheusConfig, tmp_path: Path) -> None:
    again = make_random_checkpoint(get_orpheus_config("orpheus-tiny"), tmp_path)
    assert again.snac_dir is not None and tiny.snac_dir is not None
    assert again.llm_dir is not None and tiny.llm_dir is not None
    a = torch.load(again.snac_dir / "pytorch_model.bin", weights_only=True)
    b = torch.load(tiny.snac_dir / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(
        load_orpheus_llm(again).model.embed_tokens.weight,
        load_orpheus_llm(tiny).model.embed_tokens.weight,
    )


def test_missing_checkpoints_say_how_to_fix(tiny: OrpheusConfig, tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"orpheus-3b has no checkpoint directories.*make_orpheus_checkpoint"
    ):
        load_orpheus_llm(get_orpheus_config("orpheus-3b"))
    assert tiny.llm_dir is not None and tiny.snac_dir is not None
    config = tiny.with_checkpoints(tiny.llm_dir, tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"absent' does not exist.*SNAC 24 kHz"):
        load_orpheus_codec(config)
    snac_dir = tmp_path / "snac"
    snac_dir.mkdir()
    (snac_dir / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin' is missing"):
        load_orpheus_codec(tiny.with_checkpoints(tiny.llm_dir, snac_dir))
    llm_dir = tmp_path / "llm"
    llm_dir.mkdir()
    (llm_dir / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no \*.safetensors"):
        load_orpheus_llm(tiny.with_checkpoints(llm_dir, tiny.snac_dir))


def test_a_checkpoint_of_another_size_is_refused(tiny: OrpheusConfig) -> None:
    assert tiny.llm_dir is not None and tiny.snac_dir is not None
    small = get_orpheus_config("orpheus-small", llm_dir=tiny.llm_dir, snac_dir=tiny.snac_dir)
    with pytest.raises(
        CheckpointError,
        match=r"vocab_size 29706 \(expected 156940\).*hidden_size 64 \(expected 512\)",
    ):
        load_orpheus_llm(small)
    with pytest.raises(CheckpointError, match="expected"):
        load_orpheus_codec(small)


def test_script_writes_a_loadable_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location(
        "make_orpheus_checkpoint", ROOT / "scripts" / "make_orpheus_checkpoint.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "ckpt"
    assert script.main(["--config", "orpheus-tiny", "--out", str(out), "--seed", "3"]) == 0
    assert "orpheus-tiny (seed 3)" in capsys.readouterr().out
    config = get_orpheus_config("orpheus-tiny", llm_dir=out / "llm", snac_dir=out / "snac")
    assert load_orpheus_llm(config).config.vocab_size == 29706
    load_orpheus_codec(config)
