"""BAGEL checkpoints: the published layout and names, random ones written in it, loading and its
errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mstar.errors import CheckpointError
from mstar.zoo.bagel.checkpoint import (
    LLM_PARTS,
    from_checkpoint_name,
    load_bagel,
    make_random_checkpoint,
    random_tensors,
    to_checkpoint_name,
)
from mstar.zoo.bagel.config import BagelConfig, get_bagel_config
from mstar.zoo.bagel.vae import bfl_vae_shapes
from mstar.zoo.bagel.weights import BagelWeights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def config() -> BagelConfig:
    return get_bagel_config("bagel-tiny")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, config: BagelConfig) -> Path:
    return make_random_checkpoint(config, tmp_path_factory.mktemp("bagel") / "tiny", seed=3)


def _shapes(path: Path) -> dict[str, list[int]]:
    with safe_open(str(path), framework="pt") as f:
        return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def test_the_files_have_the_published_names_and_shapes(written: Path, config: BagelConfig) -> None:
    assert sorted(p.name for p in written.iterdir()) == [
        "ae.safetensors",
        "ema.safetensors",
        "llm_config.json",
        "vit_config.json",
    ]
    ema = _shapes(written / "ema.safetensors")
    h, p = config.llm.hidden_size, config.vit.patch_size
    layer = "language_model.model.layers.1."
    for suffix in ("", "_moe_gen"):
        assert ema[f"{layer}self_attn.q_proj{suffix}.weight"] == [h, h]
        assert ema[f"{layer}self_attn.q_proj{suffix}.bias"] == [h]
        assert f"{layer}self_attn.o_proj{suffix}.bias" not in ema
        assert ema[f"{layer}self_attn.k_norm{suffix}.weight"] == [config.llm.head_dim]
        assert ema[f"{layer}mlp{suffix}.gate_proj.weight"] == [config.llm.intermediate_size, h]
        assert ema[f"{layer}input_layernorm{suffix}.weight"] == [h]
    assert ema["language_model.model.norm_moe_gen.weight"] == [h]
    assert ema["language_model.lm_head.weight"] == [config.llm.vocab_size, h]
    assert ema["time_embedder.mlp.0.weight"] == [h, 256]
    assert ema["vae2llm.weight"] == [h, config.patch_latent_dim]
    assert ema["llm2vae.weight"] == [config.patch_latent_dim, h]
    assert ema["latent_pos_embed.pos_embed"] == [config.max_latent_size**2, h]
    assert ema["vit_pos_embed.pos_embed"] == [config.vit.max_patches_per_side**2, h]
    assert ema["connector.fc1.weight"] == [h, config.vit.hidden_size]
    # upstream converts the patch conv to a linear over (row, col, channel)
    assert ema["vit_model.vision_model.embeddings.patch_embedding.weight"] == [
        config.vit.hidden_size,
        p * p * 3,
    ]
    assert (
        f"vit_model.vision_model.encoder.layers.{config.vit.num_layers - 1}.mlp.fc1.weight" in ema
    )
    assert (
        f"vit_model.vision_model.encoder.layers.{config.vit.num_layers}.mlp.fc1.weight" not in ema
    )
    assert not any("head" in n and n.startswith("vit_model") for n in ema)
    ae = _shapes(written / "ae.safetensors")
    assert ae["encoder.conv_out.weight"] == [
        2 * config.vae.z_channels,
        config.vae.ch * config.vae.ch_mult[-1],
        3,
        3,
    ]
    assert ae["encoder.mid.attn_1.q.weight"][2:] == [1, 1]
    assert (
        "decoder.up.3.upsample.conv.weight" in ae and "decoder.up.0.upsample.conv.weight" not in ae
    )
    vit = json.loads((written / "vit_config.json").read_text())
    assert vit["num_hidden_layers"] == config.vit.num_layers + 1  # upstream drops the last one


def test_the_real_layout() -> None:
    real = get_bagel_config("bagel-7b-mot")
    with torch.device("meta"):
        names = {
            to_checkpoint_name(n): tuple(t.shape)
            for n, t in BagelWeights(real).state_dict().items()
        }
    assert names["language_model.model.embed_tokens.weight"] == (152_064, 3584)
    assert names["language_model.model.layers.27.self_attn.k_proj_moe_gen.weight"] == (512, 3584)
    assert names["language_model.model.layers.27.mlp_moe_gen.down_proj.weight"] == (3584, 18_944)
    assert names["vit_model.vision_model.embeddings.position_embedding.weight"] == (4900, 1152)
    assert "vit_model.vision_model.encoder.layers.25.self_attn.q_proj.weight" in names
    assert "vit_model.vision_model.encoder.layers.26.self_attn.q_proj.weight" not in names
    assert names["latent_pos_embed.pos_embed"] == (64 * 64, 3584)
    assert names["vit_pos_embed.pos_embed"] == (70 * 70, 3584)
    ae = bfl_vae_shapes(real.vae)
    assert ae["encoder.conv_out.weight"] == (32, 512, 3, 3)
    assert ae["decoder.conv_in.weight"] == (512, 16, 3, 3)
    assert ae["decoder.up.0.block.2.conv2.weight"] == (128, 128, 3, 3)


def test_names_rename_both_ways() -> None:
    for ours, theirs in [
        (
            "vit_model.encoder.layers.0.mlp.fc1.weight",
            "vit_model.vision_model.encoder.layers.0.mlp.fc1.weight",
        ),
        ("language_model.model.norm.weight", "language_model.model.norm.weight"),
        ("connector.fc2.bias", "connector.fc2.bias"),
    ]:
        assert to_checkpoint_name(ours) == theirs and from_checkpoint_name(theirs) == ours


def test_round_trip(written: Path, config: BagelConfig) -> None:
    weights, vae = load_bagel(written, config)
    ema, _ = random_tensors(config, seed=3)
    ours = weights.state_dict()
    for name, tensor in ours.items():
        stored = ema[to_checkpoint_name(name)]
        if name.endswith("patch_embedding.weight"):
            assert torch.equal(weights.vit_model.patch_weight(), stored)
        else:
            assert torch.equal(tensor, stored), name
    assert sum(t.numel() for t in ours.values()) == sum(t.numel() for t in ema.values())
    assert not any(p.requires_grad for p in weights.parameters())
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    assert vae.decode(vae.encode(x)).shape == x.shape


def _copy(src: Path, dst: Path, filename: str, edit: dict[str, torch.Tensor | None]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / filename))
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(dst / filename))
    return dst


def test_clear_errors(written: Path, config: BagelConfig, tmp_path: Path) -> None:
    name = "language_model.model.layers.0.mlp_moe_gen.up_proj.weight"
    bad = _copy(written, tmp_path / "missing", "ema.safetensors", {name: None})
    with pytest.raises(CheckpointError, match=rf"missing 1 tensors.*{name}"):
        load_bagel(bad, config)
    bad = _copy(
        written,
        tmp_path / "extra",
        "ema.safetensors",
        {"vit_model.vision_model.head.probe": torch.zeros(1)},
    )
    with pytest.raises(CheckpointError, match=r"unexpected 1.*head.probe"):
        load_bagel(bad, config)
    bad = _copy(
        written, tmp_path / "shape", "ema.safetensors", {"vae2llm.weight": torch.zeros(3, 3)}
    )
    with pytest.raises(CheckpointError, match=r"vae2llm.weight has shape \[3, 3\]"):
        load_bagel(bad, config)
    bad = _copy(written, tmp_path / "ae", "ae.safetensors", {"encoder.conv_in.weight": None})
    with pytest.raises(CheckpointError, match=r"ae.safetensors.*missing.*encoder.conv_in.weight"):
        load_bagel(bad, config)
    with pytest.raises(CheckpointError, match="hidden_size is 64 but config 'bagel-small' has 256"):
        load_bagel(written, get_bagel_config("bagel-small"))
    shutil.copytree(written, tmp_path / "nojson")
    (tmp_path / "nojson" / "vit_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no vit_config.json"):
        load_bagel(tmp_path / "nojson", config)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_bagel(tmp_path / "nowhere", config)


def test_each_rank_loads_only_its_nodes_weights(
    written: Path, config: BagelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank holding only the VAE nodes reads no ``ema.safetensors`` tensor; one adding the ViT
    reads the ViT's; the LLM's nodes read the rest; the result equals a whole load."""
    from mstar.zoo.bagel import checkpoint as module
    from mstar.zoo.bagel.model import NODE_PARTS, BagelModel

    read: list[str] = []
    real = module.safe_open

    class Counted:
        def __init__(self, path: str, **kwargs: object) -> None:
            self.path, self.handle = Path(path).name, real(path, **kwargs)

        def __enter__(self) -> Counted:
            self.handle.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.handle.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(f"{self.path}:{name}")
            return self.handle.get_tensor(name)

    monkeypatch.setattr(module, "safe_open", Counted)
    model = BagelModel("bagel-tiny", checkpoint=str(written))
    assert set(NODE_PARTS) == set(model.graph().nodes)
    cpu = torch.device("cpu")
    model.submodule("vae_decoder", cpu)
    weights, vae = model.load(cpu, ["vae_encoder"])  # nothing new
    assert read and all(r.startswith("ae.safetensors:") for r in read)
    assert all(p.is_meta for p in weights.parameters()) and not any(
        p.is_meta for p in vae.parameters()
    )
    read.clear()
    model.submodule("vit", cpu)
    assert {r.split(":")[1].split(".")[0] for r in read} == {
        "vit_model",
        "connector",
        "vit_pos_embed",
    }
    assert weights.language_model.model.embed_tokens.weight.is_meta
    image = torch.rand(3, 2 * config.vit.patch_size, 3 * config.vit.patch_size) * 2 - 1
    vit_tokens = weights.embed_vit(image)
    read.clear()
    model.submodule("denoise_cfg_text", cpu)
    assert model.load(cpu)[0] is weights
    assert not any(p.is_meta for p in weights.parameters())
    assert {r.split(":")[1].split(".")[0] for r in read} == set(LLM_PARTS) and len(read) == len(
        set(read)
    )
    whole, whole_vae = load_bagel(written, config)
    whole.fuse_for_inference()  # as the model does once the LLM's weights are in
    assert weights.state_dict().keys() == whole.state_dict().keys()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(weights.state_dict()[name], tensor), name
    for name, tensor in whole_vae.state_dict().items():
        assert torch.equal(vae.state_dict()[name], tensor), name
    assert torch.equal(vit_tokens, whole.embed_vit(image))
    with pytest.raises(ValueError, match="no weights"):
        load_bagel(written, config, parts=["vit", "talker"])
