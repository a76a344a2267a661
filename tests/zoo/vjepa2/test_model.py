"""V-JEPA 2-AC pieces: RoPE, pose integration, encoder and predictor against an upstream-style
re-statement, the native rollout, checkpoints and request inputs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mstar.baselines.vjepa2 import native_rollout
from mstar.engines import layers
from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.vjepa2 import (
    ACPredictor,
    VJepa2Encoder,
    block_causal_mask,
    get_vjepa2_config,
    integrate_pose,
    load_encoder,
    load_predictor,
    make_random_checkpoint,
    random_state_dicts,
    read_part,
)
from mstar.zoo.vjepa2.inputs import as_actions, as_latent, prepare_image
from mstar.zoo.vjepa2.pose import euler_to_matrix, matrix_to_euler
from mstar.zoo.vjepa2.rope import apply_rope, axis_angles

CFG = get_vjepa2_config("vjepa2-tiny")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(CFG, tmp_path_factory.mktemp("vjepa2") / "tiny.pt", seed=1)


# --- an upstream-style re-statement (separate action tokens, per-axis rotation) ---------------


def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, N, D] by positions ``pos`` [N] the way V-JEPA 2 does."""
    d = x.shape[-1]
    omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float32) / (d / 2.0))
    freq = pos.float()[:, None] * omega[None]
    sin, cos = freq.sin().repeat(1, 2), freq.cos().repeat(1, 2)
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos + turned * sin


def rotate_3d(x: torch.Tensor, t: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    r = 2 * ((x.shape[-1] // 3) // 2)
    parts = [
        rotate(x[..., :r], t),
        rotate(x[..., r : 2 * r], h),
        rotate(x[..., 2 * r : 3 * r], w),
        x[..., 3 * r :],
    ]
    return torch.cat(parts, dim=-1)


def reference_predictor(
    pred: ACPredictor, z: torch.Tensor, actions: torch.Tensor, states: torch.Tensor
) -> torch.Tensor:
    """Upstream's predictor forward: action/state tokens rotated by time only, merged per frame."""
    cfg = pred.config
    b, t = actions.shape[:2]
    hw, g, heads = cfg.num_patches, cfg.grid_size, cfg.num_heads
    x = pred.predictor_embed(z).view(b, t, hw, -1)
    a = pred.action_encoder(actions).unsqueeze(2)
    s = pred.state_encoder(states).unsqueeze(2)
    x = torch.cat([a, s, x], dim=2).flatten(1, 2)
    n_t = hw + 2
    mask = torch.zeros(t * n_t, t * n_t, dtype=torch.bool)
    for t1 in range(t):
        for t2 in range(t1 + 1):
            mask[t1 * n_t : (t1 + 1) * n_t, t2 * n_t : (t2 + 1) * n_t] = True
    ids = torch.arange(t * hw)
    tt, hh, ww = ids // hw, (ids % hw) // g, ids % g
    for blk in pred.predictor_blocks:
        y = blk.norm1(x).view(b, t, n_t, -1)
        # 3,B,H,T,2,hd
        qkv_c = blk.attn.qkv(y[:, :, :2]).unflatten(-1, (3, heads, -1)).permute(3, 0, 4, 1, 2, 5)
        qkv_p = (
            blk.attn.qkv(y[:, :, 2:].flatten(1, 2))
            .unflatten(-1, (3, heads, -1))
            .permute(2, 0, 3, 1, 4)
        )
        r = 2 * ((qkv_p.shape[-1] // 3) // 2)
        merged = []
        for i in range(3):
            cond = qkv_c[i]  # [B, H, T, 2, hd]
            patch = qkv_p[i]  # [B, H, T*hw, hd]
            if i < 2:
                rot = [rotate(cond[:, :, :, j][..., :r], torch.arange(t)) for j in range(2)]
                cond = torch.stack(
                    [torch.cat([rot[j], cond[:, :, :, j][..., r:]], -1) for j in range(2)], dim=3
                )
                patch = rotate_3d(patch, tt, hh, ww)
            merged.append(torch.cat([cond, patch.view(b, heads, t, hw, -1)], dim=3).flatten(2, 3))
        o = F.scaled_dot_product_attention(*merged, attn_mask=mask)
        x = x + blk.attn.proj(o.transpose(1, 2).flatten(2))
        x = x + blk.mlp(blk.norm2(x))
    x = x.view(b, t, n_t, -1)[:, :, 2:].flatten(1, 2)
    return pred.predictor_proj(pred.predictor_norm(x))


def test_predictor_matches_the_upstream_computation(checkpoint: Path) -> None:
    pred = load_predictor(checkpoint, CFG)
    torch.manual_seed(0)
    t = 3
    z = torch.randn(2, t * CFG.predictor.num_patches, CFG.predictor.embed_dim)
    actions, states = torch.randn(2, t, 7), torch.randn(2, t, 7)
    with torch.no_grad():
        torch.testing.assert_close(
            pred(z, actions, states),
            reference_predictor(pred, z, actions, states),
            rtol=1e-4,
            atol=1e-5,
        )


def test_later_frames_do_not_change_earlier_predictions(checkpoint: Path) -> None:
    pred = load_predictor(checkpoint, CFG)
    n = CFG.predictor.num_patches
    z, actions, states = torch.randn(1, 4 * n, 64), torch.randn(1, 4, 7), torch.randn(1, 4, 7)
    with torch.no_grad():
        full = pred(z, actions, states)
        first = pred(z[:, : 2 * n], actions[:, :2], states[:, :2])
    torch.testing.assert_close(full[:, : 2 * n], first, rtol=1e-5, atol=1e-5)
    mask = block_causal_mask(3, 2)
    assert mask.tolist()[2] == [True, True, True, True, False, False]


@pytest.mark.parametrize("layout", [layers.OUT_IN, layers.IN_OUT, layers.PACKED])
def test_fused_layouts_compute_what_the_loaded_weights_do(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    if layout == layers.PACKED and not layers.can_pack(torch.zeros(1)):
        pytest.skip("this torch build has no oneDNN")
    plain_enc, plain_pred = VJepa2Encoder(CFG.encoder), ACPredictor(CFG.predictor)
    plain_enc.load_state_dict(read_part(checkpoint, "encoder"))
    plain_pred.load_state_dict(read_part(checkpoint, "predictor"))
    monkeypatch.setattr(layers, "choose_layout", lambda weight, rows=layers.DECODE_ROWS: layout)
    enc, pred = load_encoder(checkpoint, CFG), load_predictor(checkpoint, CFG)
    fused = [
        m.fused for m in [*enc.modules(), *pred.modules()] if isinstance(m, layers.FusableLinear)
    ]
    assert len(fused) == 4 * (CFG.encoder.depth + CFG.predictor.depth)
    assert all(f is not None and f.layout == layout for f in fused)
    torch.manual_seed(5)
    clip, z = torch.randn(2, 3, 2, 32, 32), torch.randn(3, 2 * CFG.predictor.num_patches, 64)
    actions, states = torch.randn(3, 2, 7), torch.randn(3, 2, 7)
    with torch.no_grad():
        torch.testing.assert_close(enc(clip), plain_enc(clip), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            pred(z, actions, states), plain_pred(z, actions, states), rtol=1e-4, atol=1e-5
        )


def test_encoder_rope_matches_per_axis_rotation(checkpoint: Path) -> None:
    enc = load_encoder(checkpoint, CFG)
    torch.manual_seed(1)
    clip = torch.randn(1, 3, 4, 32, 32)  # two tubelets
    with torch.no_grad():
        got = enc(clip)
        x = enc.patch_embed(clip)
        g, hw = CFG.encoder.grid_size, CFG.encoder.num_patches
        ids = torch.arange(2 * hw)
        tt, hh, ww = ids // hw, (ids % hw) // g, ids % g
        for blk in enc.blocks:
            q, k, v = blk.attn.qkv(blk.norm1(x)).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(
                rotate_3d(q, tt, hh, ww), rotate_3d(k, tt, hh, ww), v
            )
            x = x + blk.attn.proj(o.transpose(1, 2).flatten(2))
            x = x + blk.mlp(blk.norm2(x))
        torch.testing.assert_close(got, enc.norm(x), rtol=1e-4, atol=1e-5)
        latents = enc.encode_frames(torch.randn(3, 3, 32, 32))
    assert latents.shape == (3, 16, 64)
    torch.testing.assert_close(latents.mean(-1), torch.zeros(3, 16), atol=1e-5, rtol=0)


def test_rope_pairs_turn_by_the_upstream_angles() -> None:
    x = torch.randn(5, 8)
    pos = torch.arange(5.0)
    angles = axis_angles(pos, 8).float()
    got = apply_rope(x, angles.cos(), angles.sin())
    torch.testing.assert_close(got, rotate(x[None, None], pos)[0, 0])
    torch.testing.assert_close(apply_rope(x, torch.ones(8), torch.zeros(8)), x)


# --- pose ------------------------------------------------------------------------------------


def test_euler_round_trip_and_composition() -> None:
    torch.manual_seed(2)
    angles = (torch.rand(64, 3) * 2 - 1) * torch.tensor([math.pi, math.pi / 2 * 0.99, math.pi])
    torch.testing.assert_close(matrix_to_euler(euler_to_matrix(angles.double())), angles.double())
    rz = euler_to_matrix(torch.tensor([0.0, 0.0, 0.3], dtype=torch.float64))
    torch.testing.assert_close(
        rz[:2, :2],
        torch.tensor(
            [[math.cos(0.3), -math.sin(0.3)], [math.sin(0.3), math.cos(0.3)]], dtype=torch.float64
        ),
    )
    locked = euler_to_matrix(torch.tensor([0.4, math.pi / 2, 0.1], dtype=torch.float64))
    torch.testing.assert_close(euler_to_matrix(matrix_to_euler(locked)), locked)


def test_integrate_pose_moves_rotates_and_clips_the_gripper() -> None:
    pose = torch.tensor([[0.1, 0.2, 0.3, 0.0, 0.0, 0.5, 0.9]])
    action = torch.tensor([[0.01, -0.02, 0.03, 0.0, 0.0, 0.25, 0.5]])
    new = integrate_pose(pose, action)
    torch.testing.assert_close(new[0, :3], torch.tensor([0.11, 0.18, 0.33]))
    torch.testing.assert_close(new[0, 3:6], torch.tensor([0.0, 0.0, 0.75]), atol=1e-6, rtol=0)
    assert new[0, 6].item() == 1.0  # clipped to [0, 1]
    rotated = integrate_pose(
        torch.tensor([0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0]),
        torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.2, -1.0]),
    )
    expected = euler_to_matrix(torch.tensor([0.0, 0.0, 0.2]).double()) @ euler_to_matrix(
        torch.tensor([0.3, 0.0, 0.0]).double()
    )
    torch.testing.assert_close(euler_to_matrix(rotated[3:6].double()), expected, atol=1e-6, rtol=0)
    assert rotated[6].item() == 0.0


# --- native rollout ----------------------------------------------------------------------------


def test_native_rollout_is_the_step_loop(checkpoint: Path) -> None:
    pred = load_predictor(checkpoint, CFG)
    torch.manual_seed(3)
    z0 = F.layer_norm(torch.randn(2, 16, 64), (64,))
    pose0, actions = torch.rand(2, 7) * 0.1, torch.randn(2, 3, 7) * 0.05
    latents, poses = native_rollout(pred, z0, pose0, actions)
    z, s = z0[:, None], pose0[:, None]
    with torch.no_grad():
        for n in range(3):
            out = pred(z.flatten(1, 2), actions[:, : n + 1], s)[:, -16:]
            z = torch.cat([z, F.layer_norm(out, (64,))[:, None]], dim=1)
            s = torch.cat([s, integrate_pose(s[:, -1], actions[:, n])[:, None]], dim=1)
    torch.testing.assert_close(latents, z[:, 1:])
    torch.testing.assert_close(poses, s[:, 1:])
    with pytest.raises(ValueError, match=r"horizon must be in 1\.\.31"):
        native_rollout(pred, z0, pose0, torch.zeros(2, 32, 7))


# --- checkpoints --------------------------------------------------------------------------------


def test_checkpoint_has_the_upstream_layout(checkpoint: Path) -> None:
    raw = torch.load(checkpoint, weights_only=True)
    assert set(raw) == {"encoder", "predictor"}
    keys = {k.removeprefix("module.") for k in raw["predictor"]}
    for key in (
        "predictor_embed.weight",
        "action_encoder.weight",
        "state_encoder.bias",
        "extrinsics_encoder.weight",
        "predictor_blocks.1.attn.qkv.weight",
        "predictor_blocks.0.mlp.fc2.bias",
        "predictor_norm.weight",
        "predictor_proj.weight",
    ):
        assert key in keys
    assert raw["predictor"]["module.extrinsics_encoder.weight"].shape == (64, 6)
    enc = {k.removeprefix("module.") for k in raw["encoder"]}
    assert {"patch_embed.proj.weight", "blocks.0.attn.qkv.bias", "norm.weight"} <= enc
    assert raw["encoder"]["module.patch_embed.proj.weight"].shape == (64, 3, 2, 8, 8)


def test_loading_strips_prefixes_and_ignores_pos_embed(tmp_path: Path) -> None:
    sd = random_state_dicts(CFG, seed=4)
    enc = {f"backbone.{k}": v for k, v in sd["encoder"].items()} | {
        "pos_embed": torch.zeros(1, 16, 64)
    }
    path = tmp_path / "ck.pt"
    torch.save({"encoder": enc, "predictor": sd["predictor"], "epoch": 3}, path)
    encoder = load_encoder(path, CFG)
    x = torch.randn(3, 64)
    expected = F.linear(
        x, sd["encoder"]["blocks.1.attn.qkv.weight"], sd["encoder"]["blocks.1.attn.qkv.bias"]
    )
    with torch.no_grad():  # the weight itself may live packed inside the fused layer
        torch.testing.assert_close(encoder.blocks[1].attn.qkv(x), expected, rtol=1e-5, atol=1e-5)
    assert isinstance(load_predictor(path, CFG), ACPredictor)
    assert set(read_part(path, "encoder")) == set(sd["encoder"]) | {"pos_embed"}


def test_checkpoint_errors_are_clear(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_encoder(tmp_path / "nope.pt", CFG)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_predictor(bad, CFG)
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="'encoder' and 'predictor'"):
        load_predictor(tmp_path / "other.pt", CFG)
    small = get_vjepa2_config("vjepa2-small")
    with pytest.raises(CheckpointError, match="wrong config"):
        load_predictor(checkpoint, small)
    sd = random_state_dicts(CFG)
    del sd["predictor"]["predictor_norm.bias"]
    torch.save(sd, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match=r"missing \['predictor_norm.bias'\]"):
        load_predictor(tmp_path / "partial.pt", CFG)


def test_configs() -> None:
    vitg = get_vjepa2_config("vjepa2-ac-vitg")
    assert (vitg.encoder.mlp_hidden, vitg.encoder.num_patches, vitg.predictor.frame_tokens) == (
        6144,
        256,
        258,
    )
    assert (vitg.predictor.max_frames, vitg.predictor.max_horizon, vitg.predictor.head_dim) == (
        32,
        31,
        64,
    )
    small = get_vjepa2_config("vjepa2-small")
    assert (small.predictor.depth, small.predictor.pred_dim, small.predictor.num_patches) == (
        6,
        256,
        64,
    )
    with pytest.raises(UnsupportedModelError, match="vjepa2-tiny"):
        get_vjepa2_config("vjepa2-huge")
    assert isinstance(VJepa2Encoder(CFG.encoder), VJepa2Encoder)


# --- request inputs -------------------------------------------------------------------------------


def test_images_are_resized_cropped_and_normalised(tmp_path: Path) -> None:
    from PIL import Image

    white = torch.full((48, 64, 3), 255, dtype=torch.uint8)
    image = prepare_image(white, CFG)
    assert image.shape == (3, 32, 32)
    torch.testing.assert_close(
        image[:, 5, 5], (1 - torch.tensor(CFG.image_mean)) / torch.tensor(CFG.image_std)
    )
    Image.fromarray(white.numpy()).save(tmp_path / "w.png")
    torch.testing.assert_close(prepare_image(str(tmp_path / "w.png"), CFG), image)
    torch.testing.assert_close(prepare_image(torch.ones(3, 32, 32), CFG), image)
    with pytest.raises(ValueError, match=r"\[H, W, 3\] uint8"):
        prepare_image(torch.zeros(32, 32), CFG)
    with pytest.raises(ValueError, match="does not exist"):
        prepare_image(str(tmp_path / "missing.png"), CFG)


def test_actions_and_latents_are_checked() -> None:
    assert as_actions([[0.0] * 7] * 4, CFG).shape == (4, 7)
    with pytest.raises(ValueError, match="1 to 31 frames"):
        as_actions(torch.zeros(32, 7), CFG)
    with pytest.raises(ValueError, match=r"\[H, 7\]"):
        as_actions(torch.zeros(3, 6), CFG)
    with pytest.raises(ValueError, match="non-finite"):
        as_actions(torch.full((2, 7), float("nan")), CFG)
    with pytest.raises(ValueError, match=r"\[16, 64\]"):
        as_latent(torch.zeros(16, 32), CFG)
