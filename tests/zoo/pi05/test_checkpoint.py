"""pi0.5 checkpoints: the published names, random ones in that layout, and loading them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mstar.errors import CheckpointError
from mstar.zoo.pi05.checkpoint import (
    cached_random_checkpoint,
    from_checkpoint_names,
    load_pi05,
    make_random_checkpoint,
    to_checkpoint_names,
)
from mstar.zoo.pi05.config import Pi05Config, get_pi05_config
from mstar.zoo.pi05.modules import Pi05Weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VLM = "paligemma_with_expert.paligemma."
EXPERT = "paligemma_with_expert.gemma_expert."
LM_HEAD = VLM + "lm_head.weight"
EXPERT_LM_HEAD = EXPERT + "lm_head.weight"


@pytest.fixture(scope="module")
def config() -> Pi05Config:
    return get_pi05_config("pi05-tiny")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, config: Pi05Config) -> Path:
    return make_random_checkpoint(config, tmp_path_factory.mktemp("pi05") / "tiny", seed=3)


def _copy(src: Path, dst: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    """Copy a checkpoint directory, setting (or, for None, deleting) some tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_the_file_has_the_published_names_and_shapes(written: Path, config: Pi05Config) -> None:
    width = config.expert.width
    with safe_open(str(written / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        shape = {name: list(f.get_slice(name).get_shape()) for name in names}
    patch = VLM + "model.vision_tower.vision_model.embeddings.patch_embedding.weight"
    assert shape[patch] == [
        config.vision.width,
        3,
        config.vision.patch_size,
        config.vision.patch_size,
    ]
    assert shape[EXPERT + "model.layers.0.input_layernorm.dense.weight"] == [3 * width, width]
    assert shape[EXPERT + "model.norm.dense.bias"] == [3 * width]
    assert shape[VLM + "model.multi_modal_projector.linear.weight"] == [
        config.vlm.width,
        config.vision.width,
    ]
    assert shape[LM_HEAD] == [config.vocab_size, config.vlm.width]
    assert shape[EXPERT_LM_HEAD] == [config.vocab_size, width]
    assert shape["time_mlp_in.weight"] == [width, width]
    assert VLM + "model.language_model.embed_tokens.weight" not in names
    assert VLM + "model.language_model.layers.0.input_layernorm.weight" in names
    assert not any(n.startswith(EXPERT + "model.embed_tokens") for n in names)
    with torch.device("meta"):
        ours = Pi05Weights(config).state_dict()
    assert names == set(to_checkpoint_names(ours)) | {EXPERT_LM_HEAD}
    assert json.loads((written / "config.json").read_text()) | {"image_resolution": None} == {
        "type": "pi05",
        "paligemma_variant": "dummy",
        "action_expert_variant": "dummy",
        "dtype": "float32",
        "chunk_size": 10,
        "n_action_steps": 10,
        "action_horizon": 10,
        "action_dim": 32,
        "max_state_dim": 32,
        "max_action_dim": 32,
        "num_inference_steps": 10,
        "min_period": 0.004,
        "max_period": 4.0,
        "tokenizer_max_length": 48,
        "image_resolution": None,
    }
    stats = json.loads((written / "assets" / "droid" / "norm_stats.json").read_text())["norm_stats"]
    assert set(stats) == {"state", "actions"}
    for value in stats.values():
        assert set(value) == {"mean", "std", "q01", "q99"}
        assert all(len(v) == 8 for v in value.values())
        assert all(lo < hi for lo, hi in zip(value["q01"], value["q99"], strict=True))
    assert not list(written.rglob("*.tmp-*"))


def test_round_trip(written: Path, config: Pi05Config) -> None:
    model = load_pi05(written, config)
    stored = load_file(str(written / "model.safetensors"))
    loaded = model.state_dict()
    assert loaded.keys() == from_checkpoint_names(stored).keys()
    assert torch.equal(loaded["language_model.embed_tokens.weight"], stored[LM_HEAD])
    for name, tensor in to_checkpoint_names(loaded).items():
        assert torch.equal(tensor, stored[name]), name
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = model.vision_tower.embeddings.position_ids  # not in the file: refilled after to_empty
    assert torch.equal(ids, torch.arange(config.vision.num_patches)[None])
    # Random weights at sensible scales: distinct tensors, zero-centred Gemma norms.
    assert len({float(t.float().std()) for t in loaded.values() if t.numel() > 1}) > 0.9 * len(
        loaded
    )
    assert loaded["language_model.norm.weight"].abs().max() < 0.2
    assert (
        0.5
        < float(
            loaded["language_model.layers.0.mlp.down_proj.weight"].std() * config.vlm.mlp_dim**0.5
        )
        < 1.5
    )


def test_each_node_loads_only_its_weights(written: Path, config: Pi05Config) -> None:
    whole = load_pi05(written, config, dtype=torch.bfloat16)
    vision = load_pi05(written, config, dtype=torch.bfloat16, nodes=["vision"])
    loaded = {n for n, p in vision.named_parameters() if not p.is_meta}
    assert loaded and all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in loaded)
    assert vision.vision_tower.embeddings.position_ids.device.type == "cpu"
    both = load_pi05(written, config, dtype=torch.bfloat16, nodes=["llm"], into=vision)
    assert both is vision
    want = whole.state_dict()
    for name, tensor in both.state_dict().items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name


def test_load_casts_and_is_deterministic(written: Path, config: Pi05Config, tmp_path: Path) -> None:
    model = load_pi05(written, config, dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["language_model.layers.0.mlp.up_proj.weight"] == torch.bfloat16
    # openpi's mixed policy
    assert dtypes["language_model.layers.0.input_layernorm.weight"] == torch.float32
    assert (
        dtypes["time_mlp_in.weight"]
        == dtypes["vision_tower.embeddings.patch_embedding.weight"]
        == torch.float32
    )
    stored = load_file(str(written / "model.safetensors"))
    for name, tensor in to_checkpoint_names(model.state_dict()).items():
        assert torch.equal(tensor, stored[name].to(tensor.dtype)), name
    assert model.vision_tower.embeddings.position_ids.dtype == torch.int64
    again = make_random_checkpoint(config, tmp_path / "again", seed=3)
    assert (again / "model.safetensors").read_bytes() == (
        written / "model.safetensors"
    ).read_bytes()
    other = make_random_checkpoint(config, tmp_path / "other", seed=4)
    assert (other / "model.safetensors").read_bytes() != (
        written / "model.safetensors"
    ).read_bytes()


def test_names_rename_both_ways() -> None:
    ours = {
        "vision_tower.post_layernorm.weight": 1,
        "multi_modal_projector.linear.bias": 2,
        "language_model.embed_tokens.weight": 3,
        "language_model.layers.1.mlp.up_proj.weight": 4,
        "gemma_expert.norm.dense.weight": 5,
        "action_out_proj.bias": 6,
    }
    theirs = to_checkpoint_names(ours)
    assert theirs == {
        VLM + "model.vision_tower.vision_model.post_layernorm.weight": 1,
        VLM + "model.multi_modal_projector.linear.bias": 2,
        LM_HEAD: 3,
        VLM + "model.language_model.layers.1.mlp.up_proj.weight": 4,
        EXPERT + "model.norm.dense.weight": 5,
        "action_out_proj.bias": 6,
    }
    assert from_checkpoint_names(theirs | {EXPERT_LM_HEAD: 7}) == ours
    # Both embedding names present: embed_tokens wins, whatever the order.
    both = {LM_HEAD: 8, VLM + "model.language_model.embed_tokens.weight": 9}
    assert from_checkpoint_names(both) == {"language_model.embed_tokens.weight": 9}
    assert from_checkpoint_names(dict(reversed(both.items()))) == {
        "language_model.embed_tokens.weight": 9
    }
    with pytest.raises(CheckpointError, match=r"model\.backbone"):
        from_checkpoint_names({"model.backbone.weight": 0})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        to_checkpoint_names({"lm_head.weight": 0})


def test_embed_tokens_is_preferred_and_the_expert_lm_head_ignored(
    written: Path, config: Pi05Config, tmp_path: Path
) -> None:
    embed = torch.randn(config.vocab_size, config.vlm.width)
    edited = _copy(
        written,
        tmp_path / "both",
        {VLM + "model.language_model.embed_tokens.weight": embed, EXPERT_LM_HEAD: torch.zeros(3)},
    )
    assert torch.equal(load_pi05(edited, config).language_model.embed_tokens.weight, embed)
    only_embed = _copy(
        written,
        tmp_path / "embed",
        {VLM + "model.language_model.embed_tokens.weight": embed, LM_HEAD: None},
    )
    assert torch.equal(load_pi05(only_embed, config).language_model.embed_tokens.weight, embed)
    no_junk = _copy(written, tmp_path / "no_junk", {EXPERT_LM_HEAD: None})
    load_pi05(no_junk, config)  # the unused head is optional too


def test_missing_tensor(written: Path, config: Pi05Config, tmp_path: Path) -> None:
    name = EXPERT + "model.layers.1.post_attention_layernorm.dense.bias"
    edited = _copy(written, tmp_path / "missing", {name: None})
    with pytest.raises(
        CheckpointError,
        match=r"missing 1 tensors \[.*layers\.1\.post_attention_layernorm\.dense\.bias",
    ):
        load_pi05(edited, config)
    edited = _copy(written, tmp_path / "no_embedding", {LM_HEAD: None})
    with pytest.raises(CheckpointError, match=r"missing 1 tensors .*lm_head\.weight"):
        load_pi05(edited, config)


def test_unexpected_tensor(written: Path, config: Pi05Config, tmp_path: Path) -> None:
    edited = _copy(written, tmp_path / "unexpected", {"state_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(
        CheckpointError, match=r"missing 0 tensors .*unexpected 1 tensors \['state_proj\.weight'\]"
    ):
        load_pi05(edited, config)
    # In the layout's namespace but not a parameter of the model: still unexpected.
    extra = EXPERT + "model.embed_tokens.weight"
    edited = _copy(written, tmp_path / "expert_embed", {extra: torch.zeros(4, 4)})
    with pytest.raises(
        CheckpointError, match=r"unexpected 1 tensors .*gemma_expert\.model\.embed_tokens"
    ):
        load_pi05(edited, config)


def test_wrong_shape(written: Path, config: Pi05Config, tmp_path: Path) -> None:
    name = "action_in_proj.weight"
    edited = _copy(written, tmp_path / "shape", {name: torch.zeros(config.expert.width, 7)})
    with pytest.raises(
        CheckpointError,
        match=r"action_in_proj\.weight has shape \[64, 7\], the config expects \[64, 32\]",
    ):
        load_pi05(edited, config)


def test_config_json_must_agree(written: Path, config: Pi05Config, tmp_path: Path) -> None:
    cases = {
        "paligemma_variant": ("gemma_2b", r"paligemma_variant 'gemma_2b'.*has vlm 'dummy'"),
        "action_expert_variant": ("gemma_300m_lora", r"action_expert_variant 'gemma_300m_lora'"),
        "action_dim": (24, r"action_dim=24.*action_dim=32"),
    }
    for i, (key, (value, message)) in enumerate(cases.items()):
        directory = tmp_path / str(i)
        shutil.copytree(written, directory)
        found = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(found | {key: value}))
        with pytest.raises(CheckpointError, match=message):
            load_pi05(directory, config)
    # A checkpoint trained with another chunk size (lerobot/pi05_base: 50) serves this horizon:
    # no weight depends on it.
    shutil.copytree(written, tmp_path / "chunks")
    found = json.loads((tmp_path / "chunks" / "config.json").read_text())
    (tmp_path / "chunks" / "config.json").write_text(
        json.dumps(found | {"chunk_size": 50, "n_action_steps": 50})
    )
    load_pi05(tmp_path / "chunks", config)
    # An unknown variant name cannot be checked: the shapes decide. No config.json is fine too.
    shutil.copytree(written, tmp_path / "custom")
    (tmp_path / "custom" / "config.json").write_text(json.dumps({"paligemma_variant": "custom"}))
    load_pi05(tmp_path / "custom", config)
    (tmp_path / "custom" / "config.json").unlink()
    load_pi05(tmp_path / "custom", config)


def test_wrong_config_and_missing_directory(written: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pi05(tmp_path / "nowhere", get_pi05_config("pi05-tiny"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_pi05(tmp_path / "empty", get_pi05_config("pi05-tiny"))
    with pytest.raises(CheckpointError, match="paligemma_variant 'dummy'"):
        load_pi05(written, get_pi05_config("pi05-small"))


def test_given_norm_stats_are_written(config: Pi05Config, tmp_path: Path) -> None:
    stats = {
        "state": {"mean": [0.0, 1.0], "std": [1.0, 1.0], "q01": [-1.0, 0.0], "q99": [1.0, 2.0]}
    }
    directory = make_random_checkpoint(
        config, tmp_path / "stats", norm_stats=stats, asset_id="libero"
    )
    assert json.loads((directory / "assets" / "libero" / "norm_stats.json").read_text()) == {
        "norm_stats": stats
    }


def test_cached_random_checkpoint(
    config: Pi05Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))
    first = cached_random_checkpoint(config)
    assert first.parent == tmp_path / "pi05" and first.name.startswith("pi05-tiny-seed0-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_random_checkpoint(config) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # written once
    assert cached_random_checkpoint(config, seed=1) != first
    assert sorted(p.name for p in (tmp_path / "pi05").iterdir() if ".tmp-" in p.name) == []
    load_pi05(first, config)
