"""BAGEL configs read from a checkpoint's own files: sizes no preset has, the Qwen2 tokenizer, the
VAE posterior.

The checkpoint is written in the published layout (``llm_config.json`` and ``vit_config.json``
with the fields BAGEL-7B-MoT's files carry, ``ema.safetensors``, ``ae.safetensors``) with
sizes of no preset: a model read from it (``config=None``) serves exactly what the same
config given explicitly serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

from mstar.baselines.bagel import reference_generate, reference_understand
from mstar.errors import CheckpointError
from mstar.runtime import AsyncEngine, Output, Request
from mstar.zoo.bagel.checkpoint import (
    config_from_checkpoint,
    make_random_checkpoint,
    to_checkpoint_name,
)
from mstar.zoo.bagel.config import (
    BAGEL_CONFIGS,
    BagelConfig,
    ImageSizing,
    LLMConfig,
    SpecialTokens,
    VAEConfig,
    ViTConfig,
    get_bagel_config,
    toy_tokens,
)
from mstar.zoo.bagel.model import BagelModel
from mstar.zoo.bagel.nodes import VaeEncoderNode, VaeLatents
from mstar.zoo.bagel.vae import bfl_vae_shapes
from mstar.zoo.bagel.vision import patchify
from mstar.zoo.bagel.weights import BagelWeights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")

# No preset has these: 3 layers of width 48 (6 q / 2 kv heads of 8), a 3-layer ViT of width 24
# over a 12 x 12 grid of 8 px patches, a FLUX VAE of widths 32-64-32-64 with 8 latent channels,
# one latent cell per token (latent_patch_size 1) on a 6 x 6 table, a 128-wide timestep sinusoid.
CUSTOM = BagelConfig(
    name="custom",
    llm=LLMConfig(
        hidden_size=48,
        num_layers=3,
        num_heads=6,
        num_kv_heads=2,
        intermediate_size=80,
        vocab_size=300,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        max_position=512,
        torch_dtype="bfloat16",
    ),
    vit=ViTConfig(
        hidden_size=24,
        intermediate_size=40,
        num_layers=2,
        num_heads=2,
        patch_size=8,
        max_patches_per_side=12,
        layer_norm_eps=1e-5,
    ),
    vae=VAEConfig(ch=32, ch_mult=(1, 2, 1, 2), num_res_blocks=1, z_channels=8),
    tokens=toy_tokens(300),
    latent_patch_size=1,
    max_latent_size=6,
    # what the checkpoint's tables allow of upstream's serving sizes
    image_size=(48, 48),
    vae_image=ImageSizing(48, 24, 8),
    vit_image=ImageSizing(96, 48, 8),
    timestep_frequencies=128,
    max_text_tokens=256,
)


def write_published_jsons(config: BagelConfig, directory: Path) -> None:
    """Write both JSON configs with every field BAGEL-7B-MoT's own files carry (Qwen2's and
    SigLIP's)."""
    llm, vit = config.llm, config.vit
    (directory / "llm_config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "attention_dropout": 0.0,
                "bos_token_id": 151643,
                "eos_token_id": 151645,
                "hidden_act": "silu",
                "hidden_size": llm.hidden_size,
                "initializer_range": 0.02,
                "intermediate_size": llm.intermediate_size,
                "max_position_embeddings": llm.max_position,
                "max_window_layers": llm.num_layers,
                "model_type": "qwen2",
                "num_attention_heads": llm.num_heads,
                "num_hidden_layers": llm.num_layers,
                "num_key_value_heads": llm.num_kv_heads,
                "rms_norm_eps": llm.rms_norm_eps,
                "rope_scaling": None,
                "rope_theta": llm.rope_theta,
                "sliding_window": 131072,
                "tie_word_embeddings": False,
                "torch_dtype": llm.torch_dtype,
                "transformers_version": "4.43.1",
                "use_cache": True,
                "use_sliding_window": False,
                "vocab_size": llm.vocab_size,
            },
            indent=2,
        )
    )
    (directory / "vit_config.json").write_text(
        json.dumps(
            {
                "attention_dropout": 0.0,
                "hidden_act": "gelu_pytorch_tanh",
                "hidden_size": vit.hidden_size,
                "image_size": vit.image_size,
                "intermediate_size": vit.intermediate_size,
                "layer_norm_eps": vit.layer_norm_eps,
                "model_type": "siglip_vision_model",
                "num_attention_heads": vit.num_heads,
                "num_channels": 3,
                "num_hidden_layers": vit.num_layers + 1,
                "patch_size": vit.patch_size,
            },
            indent=2,
        )
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = make_random_checkpoint(
        CUSTOM, tmp_path_factory.mktemp("bagel") / "my-bagel", seed=5
    )
    write_published_jsons(CUSTOM, directory)
    return directory


@pytest.fixture(scope="module")
def read_model(checkpoint: Path) -> BagelModel:
    return BagelModel(None, checkpoint=str(checkpoint), dtype="float64")


@pytest.fixture(scope="module")
def explicit_model(checkpoint: Path) -> BagelModel:
    return BagelModel(CUSTOM, checkpoint=str(checkpoint), dtype="float64")


# -- the config ----------------------------------------------------------------------------


def test_every_size_is_read_from_the_files(checkpoint: Path) -> None:
    assert not any(dataclasses.replace(c, name="custom") == CUSTOM for c in BAGEL_CONFIGS.values())
    assert config_from_checkpoint(checkpoint) == dataclasses.replace(CUSTOM, name="my-bagel")
    assert config_from_checkpoint(str(checkpoint)).name == "my-bagel"
    assert (checkpoint / "ae.safetensors").exists() and not any(
        p.name.startswith("vocab") for p in checkpoint.iterdir()
    )


@pytest.mark.parametrize("preset", ["bagel-tiny", "bagel-small"])
def test_a_preset_round_trips(tmp_path: Path, preset: str) -> None:
    config = get_bagel_config(preset)
    got = config_from_checkpoint(make_random_checkpoint(config, tmp_path / preset))
    sizes = (
        "llm",
        "vit",
        "vae",
        "tokens",
        "latent_patch_size",
        "max_latent_size",
        "timestep_frequencies",
    )
    assert {f: getattr(got, f) for f in sizes} == {f: getattr(config, f) for f in sizes}
    # tiny's 4 groups: ae.safetensors' metadata
    assert got.vae.norm_groups == config.vae.norm_groups


def _write_header_only(
    path: Path, shapes: dict[str, tuple[int, ...]], metadata: dict[str, str] | None = None
) -> None:
    """Write a bf16 safetensors file whose data is a hole (a sparse file: the header is all that is
    written)."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def test_the_real_layout_gives_the_7b_preset_and_upstreams_serving_sizes(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    with probe.open("wb") as f:
        f.truncate(1 << 30)
    if os.stat(probe).st_blocks * 512 > 1 << 20:
        pytest.skip("this filesystem has no sparse files (the 7B layout would be written out)")
    real = BAGEL_CONFIGS["bagel-7b-mot"]
    directory = tmp_path / "BAGEL-7B-MoT"
    directory.mkdir()
    write_published_jsons(real, directory)
    with torch.device("meta"):
        ours = BagelWeights(real).state_dict()
    shapes = {to_checkpoint_name(n): tuple(t.shape) for n, t in ours.items()}
    p = real.vit.patch_size
    shapes["vit_model.vision_model.embeddings.patch_embedding.weight"] = (
        real.vit.hidden_size,
        p * p * 3,
    )
    _write_header_only(directory / "ema.safetensors", shapes)
    _write_header_only(directory / "ae.safetensors", bfl_vae_shapes(real.vae))
    got = config_from_checkpoint(directory)
    # no tokenizer files here: the toy tokens; the rest is the preset, serving sizes included
    assert got == dataclasses.replace(real, name="BAGEL-7B-MoT", tokens=toy_tokens(152_064))


# -- the model ------------------------------------------------------------------------------


async def serve(model: BagelModel, requests: list[Request]) -> list[list[Output]]:
    async with await AsyncEngine.start(model) as engine:
        return list(await asyncio.gather(*(engine.run(r) for r in requests)))


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def _requests() -> list[Request]:
    return [
        Request("image", {"prompt": "a red cube", "seed": 4, "num_timesteps": 3}),
        Request(
            "image_edit",
            {"prompt": "make it blue", "image": _image(1, (40, 56)), "seed": 9, "num_timesteps": 3},
        ),
        Request(
            "understand", {"prompt": "what is this?", "image": _image(2, (30, 50)), "max_tokens": 5}
        ),
    ]


def _by_name(outputs: list[Output], name: str) -> list[Any]:
    return [o.data for o in outputs if o.name == name]


async def test_the_model_read_from_the_checkpoint_serves_as_the_explicit_config(
    read_model: BagelModel, explicit_model: BagelModel
) -> None:
    assert read_model.name == "my-bagel" and read_model.config == dataclasses.replace(
        CUSTOM, name="my-bagel"
    )
    requests = _requests()
    read, explicit = await serve(read_model, requests), await serve(explicit_model, requests)
    weights, vae = read_model.load(CPU)
    for request, got, want in zip(requests, read, explicit, strict=True):
        if request.task == "understand":
            tokens = _by_name(got, "token")
            assert len(tokens) >= 1 and tokens == _by_name(want, "token")
            items = read_model.preprocess(request).state.items
            assert tokens == reference_understand(weights, vae, items, 5)
            continue
        (latents,) = _by_name(got, "latents")
        assert torch.equal(latents, _by_name(want, "latents")[0])
        assert _by_name(got, "image") == _by_name(want, "image")
        prepared = read_model.preprocess(request)
        dense, pixels, _ = reference_generate(
            weights,
            vae,
            prepared.state.items,
            prepared.state.spec,
            prepared.inputs["cfg_combine"]["flow"].x,
        )
        torch.testing.assert_close(latents, dense, rtol=0, atol=1e-6)
        # 8 px per latent token of 8 values: 48 x 48 (text-to-image) or the edit's 48 x 32 after
        # resizing
        height, width = (48, 48) if request.task == "image" else (32, 48)
        assert latents.shape == (height // 8 * width // 8, 8) and pixels.shape == (height, width, 3)


async def test_the_checkpoints_bfloat16_draws_within_bfloat16_tolerance_of_float32(
    checkpoint: Path,
) -> None:
    """``dtype="auto"`` runs as upstream does, in ``llm_config.json``'s bfloat16 (here: through 3
    flow steps)."""
    requests = _requests()[:2]
    low = BagelModel(None, checkpoint=str(checkpoint), dtype="auto")
    assert low.dtype == torch.bfloat16
    got = await serve(low, requests)
    want = await serve(BagelModel(None, checkpoint=str(checkpoint), dtype="float32"), requests)
    for mine, theirs in zip(got, want, strict=True):
        (a,), (b,) = _by_name(mine, "latents"), _by_name(theirs, "latents")
        error = float((a.float() - b).norm() / b.norm())
        # bfloat16 ran (not equal), within its precision (2**-8 a rounding)
        assert 0 < error < 0.05, error


def test_dtype_auto_and_the_arguments(checkpoint: Path) -> None:
    # llm_config.json's
    assert BagelModel(None, checkpoint=str(checkpoint), dtype="auto").dtype == torch.bfloat16
    # a random checkpoint names none
    assert BagelModel("bagel-tiny", dtype="auto").dtype == torch.float32
    assert BagelModel(None, checkpoint=str(checkpoint), dtype=None).dtype == torch.float32
    with pytest.raises(CheckpointError, match=r"config=None reads its config from checkpoint="):
        BagelModel(None)
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        BagelModel(None, checkpoint=str(checkpoint), dtype="int8")
    with pytest.raises(CheckpointError, match=r"hidden_size is 48 but config 'bagel-tiny' has 64"):
        BagelModel("bagel-tiny", checkpoint=str(checkpoint)).load(CPU)


def test_a_config_instance_without_a_checkpoint_gets_cached_random_weights() -> None:
    config = dataclasses.replace(CUSTOM, name="custom-random")
    model = BagelModel(config)
    assert (
        model.name == "custom-random" and config_from_checkpoint(model.checkpoint).llm == CUSTOM.llm
    )


# -- the VAE posterior ----------------------------------------------------------------------


def _encoded(model: BagelModel, request: Request) -> tuple[Any, torch.Tensor]:
    prepared = model.preprocess(request)
    weights, vae = model.load(CPU)
    item = prepared.state.items[0]
    node = VaeEncoderNode(weights, vae)
    inputs = {
        "segments": prepared.inputs["vae_encoder"]["segments"],
        "context": prepared.inputs["vae_encoder"]["context"],
    }
    latents = node([inputs])[0]["vae_latents"]
    assert isinstance(latents, VaeLatents)
    return item, latents.tokens


def test_an_edit_samples_the_posterior_seeded_by_the_request(read_model: BagelModel) -> None:
    cfg = read_model.config
    data = {"prompt": "make it blue", "image": _image(3, (40, 56)), "seed": 21, "num_timesteps": 3}
    item, tokens = _encoded(read_model, Request("image_edit", data))
    height, width = item.vae.shape[1:]
    # by hand: the encoder's moments, mean + std * noise, the noise drawn first from the request's
    # generator
    generator = torch.Generator().manual_seed(21)
    noise = torch.randn((cfg.vae.z_channels, height // 8, width // 8), generator=generator)
    flow_noise = torch.randn((height // 8 * width // 8, cfg.patch_latent_dim), generator=generator)
    assert torch.equal(item.vae_noise, noise)
    assert torch.equal(
        read_model.preprocess(Request("image_edit", data)).inputs["cfg_combine"]["flow"].x,
        flow_noise,
    )
    _, vae = read_model.load(CPU)
    with torch.inference_mode():
        moments = vae.ae.encoder(item.vae[None].double())
    mean, logvar = moments.chunk(2, dim=1)
    sample = mean + torch.exp(0.5 * logvar) * noise[None].double()
    want = patchify(
        (cfg.vae.scale_factor * (sample - cfg.vae.shift_factor))[0].float(), cfg.latent_patch_size
    )
    torch.testing.assert_close(tokens, want, rtol=0, atol=1e-6)
    mean_tokens = patchify(
        (cfg.vae.scale_factor * (mean - cfg.vae.shift_factor))[0].float(), cfg.latent_patch_size
    )
    assert (tokens - mean_tokens).abs().max() > 1e-3  # a sample, not the mean
    # deterministic for a seed, different for another
    assert torch.equal(_encoded(read_model, Request("image_edit", data))[1], tokens)
    assert not torch.equal(
        _encoded(read_model, Request("image_edit", {**data, "seed": 22}))[1], tokens
    )


def test_the_posterior_mean_is_an_option(read_model: BagelModel) -> None:
    data = {
        "prompt": "make it blue",
        "image": _image(3, (40, 56)),
        "seed": 21,
        "vae_posterior": "mean",
    }
    item, tokens = _encoded(read_model, Request("image_edit", data))
    assert item.vae_noise is None
    _, vae = read_model.load(CPU)
    cfg = read_model.config
    with torch.inference_mode():
        mean = vae.ae.encoder(item.vae[None].double()).chunk(2, dim=1)[0]
    want = patchify(
        (cfg.vae.scale_factor * (mean - cfg.vae.shift_factor))[0].float(), cfg.latent_patch_size
    )
    torch.testing.assert_close(tokens, want, rtol=0, atol=1e-6)
    # without a posterior draw, the flow's noise is the generator's first draw, as text-to-image's
    flow = read_model.preprocess(Request("image_edit", data)).inputs["cfg_combine"]["flow"].x
    assert torch.equal(flow, torch.randn(flow.shape, generator=torch.Generator().manual_seed(21)))
    with pytest.raises(
        ValueError, match=r"vae_posterior: must be one of 'mean', 'sample', got 'mode'"
    ):
        read_model.preprocess(Request("image_edit", {**data, "vae_posterior": "mode"}))


# -- the Qwen2 tokenizer --------------------------------------------------------------------

QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "a red cube on a blue table",
    "What's this? The cat sat  on the mat.\n\nOK",
    "héllo wörld 1234 ✓",
    "",
]


def _qwen2_pipeline(model: BPE) -> Tokenizer:
    """Qwen2's tokenizer.json pipeline: NFC, its regex split, byte-level BPE."""
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def write_qwen2_tokenizer(directory: Path, *, chat_template_file: bool = False) -> dict[str, int]:
    """Write vocab.json, merges.txt and tokenizer_config.json as Qwen2 publishes them; return the
    special ids."""
    tokenizer = _qwen2_pipeline(BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=270, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([*TEXTS, "make it blue, please"] * 5, trainer)
    tokenizer.model.save(str(directory))
    first = len(json.loads((directory / "vocab.json").read_text()))
    ids = {name: first + i for i, name in enumerate(QWEN2_SPECIALS)}
    config: dict[str, Any] = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for name, i in ids.items()
        },
        "additional_special_tokens": QWEN2_SPECIALS[1:],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # no tokenizer_class: AutoTokenizer then asks for sentencepiece or tiktoken
        "unk_token": None,
    }
    if chat_template_file:
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    else:
        config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


def _reference(directory: Path, ids: dict[str, int]) -> Tokenizer:
    vocab = json.loads((directory / "vocab.json").read_text())
    merges = [
        tuple(line.split(" "))
        for line in (directory / "merges.txt").read_text().splitlines()[1:]
        if line
    ]
    tokenizer = _qwen2_pipeline(
        BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in ids])
    assert all(tokenizer.token_to_id(name) == i for name, i in ids.items())
    return tokenizer


@pytest.fixture(scope="module")
def with_tokenizer(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, int]]:
    directory = tmp_path_factory.mktemp("tok") / "bagel-qwen2"
    shutil.copytree(checkpoint, directory)
    return directory, write_qwen2_tokenizer(directory)


def test_a_qwen2_tokenizer_directory(with_tokenizer: tuple[Path, dict[str, int]]) -> None:
    directory, ids = with_tokenizer
    tokens = SpecialTokens(
        bos=ids["<|im_start|>"],
        eos=ids["<|im_end|>"],
        start_of_image=ids["<|vision_start|>"],
        end_of_image=ids["<|vision_end|>"],
    )
    config = config_from_checkpoint(directory)
    assert config == dataclasses.replace(CUSTOM, name="bagel-qwen2", tokens=tokens)
    model = BagelModel(None, checkpoint=str(directory))
    reference = _reference(directory, ids)
    for text in TEXTS:
        assert model.tokenize(text) == reference.encode(text, add_special_tokens=False).ids
        assert model.detokenize(model.tokenize(text)) == text
    marked = "<|im_start|>a red cube<|vision_start|><|vision_end|><|im_end|>"
    got = model.tokenize(marked)
    assert got == reference.encode(marked, add_special_tokens=False).ids
    assert got[0] == tokens.bos and got[-3:] == [
        tokens.start_of_image,
        tokens.end_of_image,
        tokens.eos,
    ]
    assert model.detokenize(got) == "a red cube" and model.tokenizer.decode(got) == marked
    assert model.eos_token_ids == (tokens.eos,)
    assert model.chat_prompts
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # an explicit config with other special ids does not fit this tokenizer
    with pytest.raises(
        CheckpointError, match=r"its tokenizer's special ids .* differ from config 'custom'"
    ):
        BagelModel(CUSTOM, checkpoint=str(directory))
    assert BagelModel(
        dataclasses.replace(CUSTOM, tokens=tokens), checkpoint=str(directory)
    ).tokenize("a red") == model.tokenize("a red")


async def test_the_tokenizer_checkpoint_answers(
    with_tokenizer: tuple[Path, dict[str, int]],
) -> None:
    directory, _ = with_tokenizer
    model = BagelModel(None, checkpoint=str(directory), dtype="float64")
    request = Request(
        "understand", {"prompt": "what is this?", "image": _image(2, (30, 50)), "max_tokens": 4}
    )
    (out,) = await serve(model, [request])
    weights, vae = model.load(CPU)
    items = model.preprocess(request).state.items
    assert items[-1].token_ids.tolist() == [
        model.config.tokens.bos,
        *model.tokenize("what is this?"),
        model.config.tokens.eos,
    ]
    assert _by_name(out, "token") == reference_understand(weights, vae, items, 4)


def test_the_chat_template_of_chat_template_json(checkpoint: Path, tmp_path: Path) -> None:
    directory = tmp_path / "bagel-template"
    shutil.copytree(checkpoint, directory)
    write_qwen2_tokenizer(directory, chat_template_file=True)
    model = BagelModel(None, checkpoint=str(directory))
    assert model.chat_prompts and model.tokenizer.chat_template == CHAT_TEMPLATE


def test_tokenizer_errors(checkpoint: Path, tmp_path: Path) -> None:
    half = tmp_path / "half"
    shutil.copytree(checkpoint, half)
    write_qwen2_tokenizer(half)
    (half / "merges.txt").unlink()
    with pytest.raises(CheckpointError, match=r"has vocab.json but no merges.txt"):
        config_from_checkpoint(half)
    small = tmp_path / "small-vocab"
    shutil.copytree(checkpoint, small)
    ids = write_qwen2_tokenizer(small)
    raw = json.loads((small / "llm_config.json").read_text())
    bad_vocab = ids["<|vision_start|>"]
    raw["vocab_size"] = bad_vocab
    (small / "llm_config.json").write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError,
        match=f"the tokenizer's <\\|vision_start\\|> is id {bad_vocab}, outside "
        f"llm_config.json's vocab_size {bad_vocab}",
    ):
        config_from_checkpoint(small)


# -- errors ---------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(directory: Path, filename: str, **changes: Any) -> None:
    raw = json.loads((directory / filename).read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    (directory / filename).write_text(json.dumps(raw))


def _edit_tensors(directory: Path, filename: str, **changes: torch.Tensor | None) -> None:
    tensors = load_file(str(directory / filename))
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(directory / filename), metadata={"format": "pt"})


def test_missing_files_and_fields(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"does not exist"):
        config_from_checkpoint(tmp_path / "nowhere")
    for filename in ("llm_config.json", "vit_config.json", "ema.safetensors", "ae.safetensors"):
        bad = _copy(checkpoint, tmp_path / f"no-{filename}")
        (bad / filename).unlink()
        with pytest.raises(CheckpointError, match=f"has no {filename}"):
            config_from_checkpoint(bad)
    for filename, field in [
        ("llm_config.json", "hidden_size"),
        ("llm_config.json", "vocab_size"),
        ("vit_config.json", "patch_size"),
        ("vit_config.json", "num_hidden_layers"),
    ]:
        bad = _copy(checkpoint, tmp_path / f"no-{field}-{filename}")
        _edit_json(bad, filename, **{field: None})
        with pytest.raises(CheckpointError, match=f"{filename}: field '{field}' is missing"):
            config_from_checkpoint(bad)
    # absent: Qwen2Config's default, all heads (the weights disagree)
    bad = _copy(checkpoint, tmp_path / "no-kv-heads")
    _edit_json(bad, "llm_config.json", num_key_value_heads=None)
    with pytest.raises(
        CheckpointError, match=r"k_proj.weight has shape \[16, 48\], the config expects \[48, 48\]"
    ):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "no-latent-table")
    _edit_tensors(bad, "ema.safetensors", latent_pos_embed__pos_embed=None)
    with pytest.raises(
        CheckpointError, match=r"ema.safetensors has no tensor latent_pos_embed.pos_embed"
    ):
        config_from_checkpoint(bad)


def test_malformed_and_unsupported_fields(checkpoint: Path, tmp_path: Path) -> None:
    bad = _copy(checkpoint, tmp_path / "json")
    (bad / "vit_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot read .*vit_config.json"):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "type")
    _edit_json(bad, "llm_config.json", num_hidden_layers="3")
    with pytest.raises(
        CheckpointError,
        match=r"llm_config.json: num_hidden_layers must be a positive integer, got '3'",
    ):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "rope")
    _edit_json(bad, "llm_config.json", rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match=r"llm_config.json: rope_scaling .* is not supported"):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "heads")
    _edit_json(bad, "llm_config.json", num_key_value_heads=4)
    with pytest.raises(
        CheckpointError, match=r"llm_config.json: .*num_kv_heads 4 must divide evenly"
    ):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "garbage")
    (bad / "ema.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(
        CheckpointError, match=r"ema.safetensors is not a readable safetensors file"
    ):
        config_from_checkpoint(bad)


def test_inconsistent_files(checkpoint: Path, tmp_path: Path) -> None:
    bad = _copy(checkpoint, tmp_path / "vocab")
    _edit_json(bad, "llm_config.json", vocab_size=301)
    with pytest.raises(
        CheckpointError,
        match=r"ema.safetensors does not fit config 'vocab': .*embed_tokens.weight has shape "
        r"\[300, 48\], "
        r"the config expects \[301, 48\]",
    ):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "layers")
    _edit_json(bad, "llm_config.json", num_hidden_layers=4)
    with pytest.raises(
        CheckpointError,
        match=r"ema.safetensors does not match config 'layers': missing \d+ tensors .*layers\.3\.",
    ):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "vit-grid")
    _edit_json(bad, "vit_config.json", image_size=104)
    with pytest.raises(
        CheckpointError,
        match=r"vit_pos_embed.pos_embed covers 12 x 12 patches .* vit_config.json's "
        r"image_size / patch_size is 13",
    ):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "table")
    _edit_tensors(bad, "ema.safetensors", latent_pos_embed__pos_embed=torch.zeros(35, 48))
    with pytest.raises(
        CheckpointError, match=r"latent_pos_embed.pos_embed has 35 rows, not a square grid"
    ):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "token-width")
    _edit_tensors(bad, "ema.safetensors", vae2llm__weight=torch.zeros(48, 12))
    with pytest.raises(
        CheckpointError, match=r"vae2llm.weight takes latent tokens of 12 values, not p \* p \* 8"
    ):
        config_from_checkpoint(bad)
    bad = _copy(checkpoint, tmp_path / "ae")
    _edit_tensors(bad, "ae.safetensors", decoder__conv_out__bias=None)
    with pytest.raises(
        CheckpointError,
        match=r"ae.safetensors is not a FLUX autoencoder .* missing \['decoder.conv_out.bias'\]",
    ):
        config_from_checkpoint(bad)
    narrow = make_random_checkpoint(get_bagel_config("bagel-tiny"), tmp_path / "narrow")
    _edit_tensors(narrow, "ae.safetensors")  # rewritten without the metadata of its 4 groups
    with pytest.raises(
        CheckpointError,
        match=r"ae.safetensors: VAE widths \[8, 16, 16, 16\] must be multiples of 32",
    ):
        config_from_checkpoint(narrow)
