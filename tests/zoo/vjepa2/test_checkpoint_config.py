"""V-JEPA 2-AC sizes read from an upstream ``.pt``: a checkpoint no preset matches is served as
the explicit config serves it, and a malformed file fails naming the file and the tensor."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar.errors import CheckpointError
from mstar.runtime import AsyncEngine, Output, Request
from mstar.zoo.vjepa2 import (
    ENCODER_NUM_HEADS,
    EncoderConfig,
    PredictorConfig,
    VJepa2Config,
    VJepa2Encoder,
    VJepa2Model,
    checkpoint_dtype,
    config_from_checkpoint,
    config_from_parts,
    get_vjepa2_config,
    is_vjepa2_checkpoint,
    random_state_dicts,
)
from mstar.zoo.vjepa2.predictor import ACPredictor
from tests.helpers import wait_until_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# No preset has these: a 192-wide, 3-block ViT (upstream's vit_tiny width: 3 heads) with the
# ViT-g MLP ratio, and a 2-block, 128-wide predictor (2 heads of 64).
CUSTOM = VJepa2Config(
    "custom",
    EncoderConfig(
        img_size=256,
        patch_size=16,
        tubelet_size=2,
        embed_dim=192,
        depth=3,
        num_heads=3,
        mlp_ratio=48 / 11,
    ),
    PredictorConfig(embed_dim=192, pred_dim=128, depth=2, num_heads=2, mlp_ratio=4.0, grid_size=16),
)
# A 5-D action space, 96 wide (no upstream width, not a multiple of 64: heads must be given).
FIVE_D = VJepa2Config(
    "five-d",
    EncoderConfig(
        img_size=256,
        patch_size=16,
        tubelet_size=2,
        embed_dim=96,
        depth=3,
        num_heads=4,
        mlp_ratio=4.0,
    ),
    PredictorConfig(embed_dim=96, pred_dim=64, depth=2, num_heads=1, action_dim=5, grid_size=16),
)
KV = {"num_blocks": 16}


def write_upstream(
    config: VJepa2Config, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """Write ``config``'s random weights as upstream's training loop saves them (``module.``
    keys)."""
    parts = random_state_dicts(config, seed)
    encoder = {f"module.{k}": v.to(dtype) for k, v in parts["encoder"].items()}
    predictor = {f"module.backbone.{k}": v.to(dtype) for k, v in parts["predictor"].items()}
    extras = {
        "target_encoder": encoder,
        "epoch": 315,
        "loss": 0.125,
        "batch_size": 8,
        "world_size": 32,
        "lr": 4.25e-4,
    }
    torch.save({"encoder": encoder, "predictor": predictor, **extras}, path)
    return path


def write_parts(parts: dict[str, dict[str, torch.Tensor]], path: Path) -> Path:
    torch.save(parts, path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_upstream(CUSTOM, tmp_path_factory.mktemp("vjepa2") / "droid-ac-small.pt", seed=5)


def by_name(outputs: list[Output]) -> dict[str, Any]:
    return {o.name: o.data for o in outputs}


# --- sizes ----------------------------------------------------------------------------------------


def test_sizes_come_back_from_the_tensors(checkpoint: Path) -> None:
    config = config_from_checkpoint(checkpoint)
    assert config == dataclasses.replace(CUSTOM, name="droid-ac-small")
    assert (
        config.encoder.mlp_hidden,
        config.predictor.frame_tokens,
        config.predictor.max_horizon,
    ) == (837, 258, 31)
    again = config_from_checkpoint(
        checkpoint, img_size=128, num_frames=16, num_heads=6, pred_num_heads=4
    )
    assert (again.encoder.grid_size, again.predictor.grid_size, again.predictor.max_frames) == (
        8,
        8,
        8,
    )
    assert (again.encoder.num_heads, again.predictor.num_heads) == (6, 4)


def meta_parts(config: VJepa2Config) -> dict[str, dict[str, torch.Tensor]]:
    """State dicts of ``config`` as meta tensors: shapes alone decide the config, no data needed."""
    with torch.device("meta"):
        return {
            "encoder": VJepa2Encoder(config.encoder).state_dict(),
            "predictor": ACPredictor(config.predictor).state_dict(),
        }


def test_published_sizes_come_back_exactly() -> None:
    vitg = get_vjepa2_config("vjepa2-ac-vitg")
    # planning defaults too
    assert config_from_parts(meta_parts(vitg), "/ckpt/vjepa2-ac-vitg.pt") == vitg
    assert ENCODER_NUM_HEADS[1408] == 22  # vit_giant_xformers, not vit_giant's 16
    small = get_vjepa2_config("vjepa2-small")
    config = config_from_parts(meta_parts(small), "/ckpt/vjepa2-small.pt", img_size=128)
    assert (config.name, config.encoder, config.predictor) == (
        "vjepa2-small",
        small.encoder,
        small.predictor,
    )


def test_the_file_is_read_once_memory_mapped(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    load = torch.load

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    model = VJepa2Model(None, checkpoint=checkpoint, dtype="auto")  # sizes and dtype from one load
    assert model.dtype == torch.float32
    assert [(c.get("mmap"), c.get("weights_only")) for c in calls] == [(True, True)]


def test_heads_of_an_unknown_width_must_be_given(tmp_path: Path) -> None:
    path = write_upstream(FIVE_D, tmp_path / "five.pt")
    with pytest.raises(
        CheckpointError, match=re.escape(f"{str(path)!r}: the encoder's heads cannot be read")
    ) as info:
        config_from_checkpoint(path)
    assert "width 96" in str(info.value) and "num_heads=N" in str(info.value)
    assert config_from_checkpoint(path, num_heads=4) == dataclasses.replace(FIVE_D, name="five")


def test_dtype_auto_is_the_stored_dtype(tmp_path: Path, checkpoint: Path) -> None:
    half = write_upstream(CUSTOM, tmp_path / "half.pt", dtype=torch.bfloat16)
    assert (
        checkpoint_dtype(half) == torch.bfloat16 and checkpoint_dtype(checkpoint) == torch.float32
    )
    assert VJepa2Model(None, checkpoint=half, dtype="auto").dtype == torch.bfloat16
    assert VJepa2Model(CUSTOM, checkpoint=half, dtype="auto").dtype == torch.bfloat16
    assert VJepa2Model(None, checkpoint=half, dtype="float16").dtype == torch.float16
    parts = random_state_dicts(CUSTOM)
    parts["encoder"]["norm.weight"] = parts["encoder"]["norm.weight"].half()
    assert checkpoint_dtype(write_parts(parts, tmp_path / "mixed.pt")) == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        VJepa2Model(None, checkpoint=checkpoint, dtype="int8")


def test_recognised_cheaply(tmp_path: Path, checkpoint: Path) -> None:
    assert is_vjepa2_checkpoint(checkpoint)
    (tmp_path / "text.pt").write_text("not a checkpoint")
    torch.save({"model": {"w": torch.zeros(2)}}, tmp_path / "other.pt")
    torch.save(
        {"encoder": {"w": torch.zeros(2)}, "predictor": {"w": torch.zeros(2)}},
        tmp_path / "lookalike.pt",
    )
    for name in ("text.pt", "other.pt", "lookalike.pt", "missing.pt"):
        assert not is_vjepa2_checkpoint(tmp_path / name), name


# --- serving
# ---------------------------------------------------------------------------------------


async def serve(
    model: VJepa2Model, image: torch.Tensor, actions: torch.Tensor, goal: torch.Tensor
) -> list[dict[str, Any]]:
    async with await AsyncEngine.start(model) as engine:
        encoded = by_name(await engine.run(Request("encode", {"images": [image, goal]})))
        rolled = by_name(
            await engine.run(
                Request(
                    "rollout", {"image": image, "actions": actions, "pose": torch.full((7,), 0.1)}
                )
            )
        )
        plan = {
            "image": image,
            "goal_image": goal,
            "samples": 8,
            "topk": 2,
            "cem_steps": 2,
            "rollout": 2,
            "seed": 3,
        }
        planned = by_name(await engine.run(Request("plan", plan)))
        await wait_until_idle(engine)
    return [encoded, rolled, planned]


async def test_served_from_the_file_alone_as_the_explicit_config(checkpoint: Path) -> None:
    g = torch.Generator().manual_seed(0)
    image, goal = ((torch.rand(300, 260, 3, generator=g) * 255).to(torch.uint8) for _ in range(2))
    actions = torch.randn(3, 7, generator=g) * 0.05
    inferred = VJepa2Model(None, checkpoint=checkpoint, kv=KV)
    assert inferred.name == "droid-ac-small" and inferred.checkpoint == str(checkpoint)
    explicit = VJepa2Model(CUSTOM, checkpoint=str(checkpoint), kv=KV)
    assert explicit.name == "custom"
    got, expected = (
        await serve(inferred, image, actions, goal),
        await serve(explicit, image, actions, goal),
    )
    assert got[0]["latents"].shape == (2, 256, 192)
    assert got[1]["latents"].shape == (3, 256, 192) and got[1]["poses"].shape == (3, 7)
    assert got[2]["action"].shape == (7,)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.keys() == theirs.keys()
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0)
    assert not torch.equal(got[0]["latents"][0], got[0]["latents"][1])  # the two images differ


def test_a_custom_config_without_a_file_gets_its_own_random_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))
    model = VJepa2Model(CUSTOM)
    assert model.name == "custom" and Path(model.checkpoint).parent == tmp_path / "vjepa2"
    assert config_from_checkpoint(model.checkpoint) == dataclasses.replace(
        CUSTOM, name=Path(model.checkpoint).stem
    )
    other = VJepa2Model(
        dataclasses.replace(CUSTOM, predictor=dataclasses.replace(CUSTOM.predictor, depth=3))
    )
    assert other.checkpoint != model.checkpoint  # same name, other sizes: another file
    with pytest.raises(CheckpointError, match="needs checkpoint="):
        VJepa2Model(dataclasses.replace(CUSTOM, name="vjepa2-ac-vitg"))


def test_other_action_widths_serve_encode_only(tmp_path: Path) -> None:
    path = write_upstream(FIVE_D, tmp_path / "five.pt")
    model = VJepa2Model(config_from_checkpoint(path, num_heads=4), checkpoint=path, kv=KV)
    assert model.config.predictor.action_dim == 5 and model.tasks() == ("encode",)
    assert (
        model.preprocess(Request("encode", {"image": torch.zeros(3, 256, 256)})).state == "encode"
    )
    with pytest.raises(
        ValueError,
        match=r"rollout integrates 7-D poses .* five's actions are 5-D: this model serves "
        r"encode only",
    ):
        model.preprocess(
            Request("rollout", {"latent": torch.zeros(256, 96), "actions": torch.zeros(2, 5)})
        )


# --- errors ---------------------------------------------------------------------------------------


def test_no_checkpoint_and_no_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"needs config= .* or checkpoint="):
        VJepa2Model(None)
    with pytest.raises(
        CheckpointError, match=re.escape(f"{str(tmp_path / 'nope.pt')!r} does not exist")
    ):
        VJepa2Model(None, checkpoint=tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        config_from_checkpoint(tmp_path / "nope.pt")


def broken(tmp_path: Path, edit: Any) -> Path:
    parts = random_state_dicts(CUSTOM)
    edit(parts)
    return write_parts(parts, tmp_path / "broken.pt")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda p: p.pop("predictor"),
            r"expected a dict with 'encoder' and 'predictor' state dicts, found "
            r"\['encoder'\] \(no 'predictor'\)",
        ),
        (
            lambda p: [
                p["encoder"].pop(k) for k in list(p["encoder"]) if k.startswith("blocks.1.")
            ],
            r"the encoder has blocks up to blocks.2 but blocks.1.\* is missing",
        ),
        (
            lambda p: p["predictor"].pop("predictor_blocks.1.mlp.fc2.bias"),
            r"does not match this predictor: missing \['predictor_blocks.1.mlp.fc2.bias'\], "
            r"unexpected \[\] \(inconsistent",
        ),
        (
            lambda p: p["encoder"].pop("patch_embed.proj.weight"),
            r"the encoder lacks 'patch_embed.proj.weight', which gives its sizes",
        ),
        (
            lambda p: p["predictor"].update({"predictor_embed.weight": torch.zeros(128, 100)}),
            r"predictor 'predictor_embed.weight' takes 100 features but the encoder's width "
            r"\('patch_embed.proj.weight'\) is 192",
        ),
        (
            lambda p: p["encoder"].update({"blocks.2.mlp.fc1.weight": torch.zeros(700, 192)}),
            r"encoder weight 'blocks.2.mlp.fc1.weight' has shape \[700, 192\], the config "
            r"expects \[837, 192\] \(inconsistent",
        ),
        (
            lambda p: p["predictor"].update({"state_encoder.weight": torch.zeros(128, 6)}),
            r"predictor weight 'state_encoder.weight' has shape \[128, 6\], the config "
            r"expects \[128, 7\]",
        ),
        (
            lambda p: p["encoder"].update(
                {"patch_embed.proj.weight": torch.zeros(192, 3, 2, 16, 8)}
            ),
            r"non-square patches 16x8",
        ),
    ],
    ids=[
        "no-predictor",
        "missing-block",
        "missing-tensor",
        "no-patch-embed",
        "embed-width",
        "block-shape",
        "state-width",
        "patch",
    ],
)
def test_malformed_files_name_the_file_and_the_tensor(
    tmp_path: Path, edit: Any, message: str
) -> None:
    path = broken(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message) as info:
        config_from_checkpoint(path)
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError, match=message):
        VJepa2Model(None, checkpoint=path)


def test_sizes_that_make_no_model(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(
        CheckpointError,
        match=r"patch size 16 .* does not divide the image size 100: pass .*img_size=",
    ):
        config_from_checkpoint(checkpoint, img_size=100)
    with pytest.raises(CheckpointError, match=r"not a V-JEPA 2 model: num_frames 2 leaves no room"):
        config_from_checkpoint(checkpoint, num_frames=2)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="cannot read V-JEPA 2 checkpoint"):
        config_from_checkpoint(tmp_path / "junk.pt")
