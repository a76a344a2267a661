"""BAGEL's parts against their twins on shared random weights: the NaViT against transformers'
SigLIP, diffusers' VAE (fed BFL names) against FLUX's formulas, and the flow schedule's passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import SiglipVisionConfig, SiglipVisionModel

from mstar.zoo.bagel.checkpoint import random_tensors
from mstar.zoo.bagel.config import ImageSizing, get_bagel_config
from mstar.zoo.bagel.flow import FlowSpec, guidance
from mstar.zoo.bagel.llm import sincos_2d
from mstar.zoo.bagel.vae import FluxVAE
from mstar.zoo.bagel.vision import NaViT, flattened_positions, patchify, resize_for, unpatchify

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = get_bagel_config("bagel-tiny")


def test_navit_equals_transformers_siglip_on_a_full_grid() -> None:
    torch.manual_seed(0)
    vit = CFG.vit
    ours = NaViT(vit).eval()
    twin = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=vit.hidden_size,
            intermediate_size=vit.intermediate_size,
            num_hidden_layers=vit.num_layers,
            num_attention_heads=vit.num_heads,
            image_size=vit.image_size,
            patch_size=vit.patch_size,
            hidden_act="gelu_pytorch_tanh",
            vision_use_head=False,
        )
    ).eval()
    twin.load_state_dict(ours.state_dict())
    image = torch.rand(1, 3, vit.image_size, vit.image_size) * 2 - 1
    side = vit.max_patches_per_side
    with torch.no_grad():
        want = twin(pixel_values=image).last_hidden_state[0]
        got = ours.encode(patchify(image[0], vit.patch_size), flattened_positions(side, side, side))
        # a smaller image takes the table's rows r * side + c (no interpolation)
        small = ours.encode(
            patchify(image[0, :, :16, :24], vit.patch_size), flattened_positions(2, 3, side)
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert small.shape == (6, vit.hidden_size)


def test_patchify_round_trips_and_orders_row_col_channel() -> None:
    x = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6)
    tokens = patchify(x, 2)
    assert tokens.shape == (6, 12)
    assert tokens[0, :3].tolist() == [x[0, 0, 0], x[1, 0, 0], x[2, 0, 0]]  # channels innermost
    assert torch.equal(unpatchify(tokens, 2, 3, 2, 3), x)


def test_sincos_table_is_upstreams() -> None:
    dim, side = 16, 5
    grid = np.stack(
        np.meshgrid(np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32)), axis=0
    )

    def one_d(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    want = np.concatenate([one_d(dim // 2, grid[0]), one_d(dim // 2, grid[1])], axis=1)
    torch.testing.assert_close(sincos_2d(dim, side), torch.from_numpy(want).float())


def test_resize_keeps_sides_in_range_and_on_the_stride() -> None:
    sizing = ImageSizing(128, 32, 16)
    assert resize_for(Image.new("RGB", (300, 100)), sizing).size == (128, 48)
    assert resize_for(Image.new("RGB", (20, 20)), sizing).size == (32, 32)
    assert resize_for(Image.new("RGB", (64, 48)), sizing).size == (64, 48)


# --- the FLUX autoencoder's formulas, written out on BFL names (the VAE's twin) -------------


def _gn(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, groups: int) -> torch.Tensor:
    return F.group_norm(x, groups, sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-6)


def _conv(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, **kw: int) -> torch.Tensor:
    return F.conv2d(x, sd[f"{name}.weight"], sd[f"{name}.bias"], **kw)


def _resnet(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, g: int) -> torch.Tensor:
    h = _conv(F.silu(_gn(x, sd, f"{name}.norm1", g)), sd, f"{name}.conv1", padding=1)
    h = _conv(F.silu(_gn(h, sd, f"{name}.norm2", g)), sd, f"{name}.conv2", padding=1)
    if f"{name}.nin_shortcut.weight" in sd:
        x = _conv(x, sd, f"{name}.nin_shortcut")
    return x + h


def _attn(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, g: int) -> torch.Tensor:
    h = _gn(x, sd, f"{name}.norm", g)
    b, c, hh, ww = h.shape
    q, k, v = (_conv(h, sd, f"{name}.{p}").reshape(b, 1, c, hh * ww).transpose(2, 3) for p in "qkv")
    out = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, hh, ww)
    return x + _conv(out, sd, f"{name}.proj_out")


def _mid(x: torch.Tensor, sd: dict[str, torch.Tensor], p: str, g: int) -> torch.Tensor:
    return _resnet(
        _attn(_resnet(x, sd, f"{p}.mid.block_1", g), sd, f"{p}.mid.attn_1", g),
        sd,
        f"{p}.mid.block_2",
        g,
    )


def _flux_encode_mean(x: torch.Tensor, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    vae, g = CFG.vae, CFG.vae.norm_groups
    h = _conv(x, sd, "encoder.conv_in", padding=1)
    for i in range(len(vae.ch_mult)):
        for j in range(vae.num_res_blocks):
            h = _resnet(h, sd, f"encoder.down.{i}.block.{j}", g)
        if i != len(vae.ch_mult) - 1:
            h = _conv(F.pad(h, (0, 1, 0, 1)), sd, f"encoder.down.{i}.downsample.conv", stride=2)
    h = _mid(h, sd, "encoder", g)
    h = _conv(F.silu(_gn(h, sd, "encoder.norm_out", g)), sd, "encoder.conv_out", padding=1)
    return h[:, : vae.z_channels]


def _flux_decode(z: torch.Tensor, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    vae, g = CFG.vae, CFG.vae.norm_groups
    h = _mid(_conv(z, sd, "decoder.conv_in", padding=1), sd, "decoder", g)
    for i in reversed(range(len(vae.ch_mult))):
        for j in range(vae.num_res_blocks + 1):
            h = _resnet(h, sd, f"decoder.up.{i}.block.{j}", g)
        if i != 0:
            h = _conv(
                F.interpolate(h, scale_factor=2.0, mode="nearest"),
                sd,
                f"decoder.up.{i}.upsample.conv",
                padding=1,
            )
    return _conv(F.silu(_gn(h, sd, "decoder.norm_out", g)), sd, "decoder.conv_out", padding=1)


def test_diffusers_vae_fed_bfl_names_equals_fluxs_formulas() -> None:
    _, ae = random_tensors(CFG, seed=5)
    vae = FluxVAE(CFG.vae).eval()
    vae.load_bfl(ae)
    x = torch.rand(2, 3, 32, 48) * 2 - 1
    scale, shift = CFG.vae.scale_factor, CFG.vae.shift_factor
    with torch.no_grad():
        z = vae.encode(x)
        torch.testing.assert_close(
            z, (_flux_encode_mean(x, ae) - shift) * scale, rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(
            vae.decode(z), _flux_decode(z / scale + shift, ae), rtol=1e-4, atol=1e-4
        )


# --- the flow -----------------------------------------------------------------------------------


def test_the_default_text_to_image_schedule_costs_90_passes_not_147() -> None:
    t2i = FlowSpec.of(64, 64, CFG.t2i)
    assert t2i.num_steps == 49
    assert sum(len(t2i.branches(k)) == 2 for k in range(49)) == 41  # steps with t in (0.4, 1]
    assert t2i.num_passes() == 90
    assert FlowSpec.of(64, 64, CFG.edit).num_passes() == 147  # editing: 3 branches every step
    assert FlowSpec.of(64, 64, CFG.t2i, cfg_text_scale=1.0).num_passes() == 49
    # image guidance needs text guidance: alone it is skipped (upstream computes it and drops it)
    assert FlowSpec.of(64, 64, CFG.t2i, cfg_text_scale=1.0, cfg_img_scale=2.0).num_passes() == 49


def test_guidance_modes() -> None:
    g = torch.Generator().manual_seed(0)
    v, vt, vi = (torch.randn(6, 16, generator=g) for _ in range(3))
    spec = FlowSpec(2, 3, cfg_text_scale=4.0, cfg_img_scale=2.0, cfg_renorm_type="global")
    mixed = vi + 2.0 * (vt + 4.0 * (v - vt) - vi)
    torch.testing.assert_close(
        guidance(spec, v, vt, vi), mixed * (v.norm() / (mixed.norm() + 1e-8)).clamp(max=1.0)
    )
    chan = FlowSpec(2, 3, cfg_text_scale=4.0, cfg_img_scale=2.0, cfg_renorm_type="text_channel")
    text = vt + 4.0 * (v - vt)
    text = text * (v.norm(dim=-1, keepdim=True) / (text.norm(dim=-1, keepdim=True) + 1e-8)).clamp(
        max=1.0
    )
    torch.testing.assert_close(guidance(chan, v, vt, vi), vi + 2.0 * (text - vi))
    assert guidance(spec, v, None, None) is v


@pytest.mark.parametrize("fused", [False, True])
def test_repeated_queries_projected_once_equal_each_projected_alone(fused: bool) -> None:
    """Three branches' queries of one step (the same latents, three RoPE positions and contexts)."""
    from mstar.zoo.bagel.llm import Repeats, Routing
    from mstar.zoo.bagel.weights import BagelWeights, ImageInput

    torch.manual_seed(0)
    dtype = torch.float32 if fused else torch.float64
    weights = BagelWeights(CFG).to(dtype).eval()
    if fused:
        weights.fuse_for_inference()
    llm = CFG.llm
    n = 6
    query = ImageInput(
        "flow", torch.randn(n - 2, CFG.patch_latent_dim), 0, torch.arange(n - 2), 0.7
    )
    x, _, is_gen = weights.embed_input(query)
    contexts = [
        (torch.randn(ctx, llm.num_kv_heads, llm.head_dim, dtype=dtype),) * 2 for ctx in (5, 3, 0)
    ]

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = []
        for b, (ck, cv) in enumerate(contexts):  # each branch: its own context, then its own rows
            rows = slice(b * n, (b + 1) * n)
            keys, values = torch.cat([ck, k[rows]]), torch.cat([cv, v[rows]])
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                enable_gqa=True,
            )
            out.append(o.transpose(0, 1))
        return torch.cat(out)

    rows, rope = torch.cat([x] * 3), torch.tensor([9] * n + [4] * n + [2] * n)
    gen = torch.cat([is_gen] * 3)
    distinct, expand = torch.arange(n), torch.arange(n).repeat(3)
    repeats = Repeats(distinct, expand, Routing.of(is_gen))
    with torch.inference_mode():
        alone = weights.run(rows, rope, gen, attend)
        once = weights.run(rows, rope, gen, attend, repeats)
    if fused:  # oneDNN's packed products may round a row differently at another row count
        torch.testing.assert_close(once, alone, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(once, alone)
