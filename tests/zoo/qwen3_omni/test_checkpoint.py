"""Qwen3-Omni checkpoints: configs, the Hugging Face layout, per-expert or fused experts, clear
errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.qwen3_omni.checkpoint import (
    checkpoint_name,
    load_qwen3_omni,
    make_random_checkpoint,
    our_name,
)
from mstar.zoo.qwen3_omni.config import QWEN3_OMNI_CONFIGS, Qwen3OmniConfig, get_qwen3_omni_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXPERT = "thinker.model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def config() -> Qwen3OmniConfig:
    return get_qwen3_omni_config("qwen3-omni-tiny")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, config: Qwen3OmniConfig) -> Path:
    return make_random_checkpoint(config, tmp_path_factory.mktemp("qwen3_omni") / "tiny", seed=1)


def _copy(src: Path, dst: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    # Read the source and write a new file: never overwrite a file its own tensors may map.
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("name", list(QWEN3_OMNI_CONFIGS))
def test_named_configs_keep_the_published_structure(name: str) -> None:
    config = get_qwen3_omni_config(name)
    assert config.samples_per_frame == 1920 and config.sample_rate == 24_000
    assert config.num_code_groups == 16 == config.code_predictor.num_code_groups
    talker = config.talker_text
    assert talker.vocab_size == config.codebook_size + 1024
    assert config.codec_id("codec_eos_token_id") == config.codebook_size + 102
    assert talker.shared_expert_intermediate_size > 0 and all(
        talker.is_moe_layer(i) for i in range(talker.num_layers)
    )
    assert config.make_hf_config().talker_config.accept_hidden_layer == config.accept_hidden_layer


def test_the_real_config_has_the_published_sizes() -> None:
    config = get_qwen3_omni_config("qwen3-omni-30b-a3b")
    thinker, talker, predictor = config.thinker_text, config.talker_text, config.code_predictor
    assert (
        thinker.num_layers,
        thinker.hidden_size,
        thinker.num_heads,
        thinker.num_kv_heads,
        thinker.head_dim,
    ) == (48, 2048, 32, 4, 128)
    assert (
        thinker.num_experts,
        thinker.num_experts_per_tok,
        thinker.moe_intermediate_size,
        thinker.vocab_size,
    ) == (128, 8, 768, 152_064)
    assert thinker.mrope_section == (24, 20, 20) and thinker.rope_theta == 1e6
    assert (
        talker.num_layers,
        talker.hidden_size,
        talker.num_experts_per_tok,
        talker.shared_expert_intermediate_size,
    ) == (20, 1024, 6, 768)
    assert (
        predictor.num_layers,
        predictor.num_kv_heads,
        predictor.intermediate_size,
        predictor.vocab_size,
    ) == (5, 8, 3072, 2048)
    assert config.accept_hidden_layer == 24
    assert config.codec_id("codec_bos_id") == 2149 and config.speaker_ids["ethan"] == 2302
    assert (
        config.token_id("tts_pad_token_id") == 151671
        and config.token_id("audio_token_id") == 151675
    )


def test_bad_configs_say_what_is_wrong() -> None:
    with pytest.raises(UnsupportedModelError, match="unknown Qwen3-Omni config"):
        get_qwen3_omni_config("qwen3-omni-huge")
    with pytest.raises(UnsupportedModelError, match="speaker"):
        get_qwen3_omni_config("qwen3-omni-tiny", speaker="nobody")
    hf = get_qwen3_omni_config("qwen3-omni-tiny").hf
    hf["thinker_config"]["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        _ = Qwen3OmniConfig("bad", hf).thinker_text


def test_the_file_is_in_the_published_layout_with_one_tensor_per_expert(
    written: Path, config: Qwen3OmniConfig
) -> None:
    names = set(load_file(str(written / "model.safetensors")))
    assert f"{EXPERT}.0.gate_proj.weight" in names and f"{EXPERT}.gate_up_proj" not in names
    for prefix in (
        "thinker.audio_tower.",
        "thinker.visual.",
        "thinker.lm_head.",
        "talker.code_predictor.",
        "code2wav.",
    ):
        assert any(n.startswith(prefix) for n in names), prefix
    assert our_name("talker.codec_head.weight") == "talker_text.codec_head.weight"
    assert (
        checkpoint_name("code_predictor.lm_head.0.weight")
        == "talker.code_predictor.lm_head.0.weight"
    )
    assert json.loads((written / "config.json").read_text())["model_type"] == "qwen3_omni_moe"


def test_per_expert_and_fused_checkpoints_load_the_same(
    written: Path, tmp_path: Path, config: Qwen3OmniConfig
) -> None:
    tensors = load_file(str(written / "model.safetensors"))
    num = config.thinker_text.num_experts
    gate_up = torch.stack(
        [
            torch.cat(
                (tensors[f"{EXPERT}.{e}.gate_proj.weight"], tensors[f"{EXPERT}.{e}.up_proj.weight"])
            )
            for e in range(num)
        ]
    )
    down = torch.stack([tensors[f"{EXPERT}.{e}.down_proj.weight"] for e in range(num)])
    edit: dict[str, torch.Tensor | None] = {
        f"{EXPERT}.{e}.{p}.weight": None
        for e in range(num)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    fused_dir = _copy(
        written,
        tmp_path / "fused",
        {**edit, f"{EXPERT}.gate_up_proj": gate_up, f"{EXPERT}.down_proj": down},
    )
    per_expert = load_qwen3_omni(written)  # the config comes from config.json
    fused = load_qwen3_omni(fused_dir, config)
    a, b = per_expert.state_dict(), fused.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    torch.testing.assert_close(a["thinker_text.model.layers.0.mlp.experts.gate_up_proj"], gate_up)
    assert (
        load_qwen3_omni(written, config, dtype=torch.bfloat16).thinker_text.model.norm.weight.dtype
        == torch.bfloat16
    )


def test_missing_unexpected_and_misshapen_tensors_are_checkpoint_errors(
    written: Path, tmp_path: Path, config: Qwen3OmniConfig
) -> None:
    missing = _copy(
        written,
        tmp_path / "missing",
        {f"{EXPERT}.3.up_proj.weight": None, "code2wav.code_embedding.weight": None},
    )
    with pytest.raises(
        CheckpointError, match=r"missing 3 tensors .*code2wav\.code_embedding\.weight"
    ):
        load_qwen3_omni(missing, config)
    extra = _copy(
        written, tmp_path / "extra", {"thinker.model.layers.0.mlp.bogus.weight": torch.zeros(2)}
    )
    with pytest.raises(
        CheckpointError,
        match=r"unexpected 1 tensors \[thinker\.model\.layers\.0\.mlp\.bogus\.weight\]",
    ):
        load_qwen3_omni(extra, config)
    wide = _copy(written, tmp_path / "wide", {"talker.codec_head.weight": torch.zeros(7, 32)})
    with pytest.raises(
        CheckpointError,
        match=r"'talker\.codec_head\.weight' .* shape \[7, 32\] but config 'qwen3-omni-tiny' "
        r"needs \[1056, 32\]",
    ):
        load_qwen3_omni(wide, config)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_qwen3_omni(tmp_path / "nowhere", config)
    small = get_qwen3_omni_config("qwen3-omni-small")
    with pytest.raises(CheckpointError, match="does not match config 'qwen3-omni-small'"):
        load_qwen3_omni(written, small)
