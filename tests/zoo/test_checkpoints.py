"""Which family a checkpoint is, read from its files; the model options of `mstar serve` / `mstar
run`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mstar.cli.model_args import add_model_arguments, model_kwargs
from mstar.errors import CheckpointError, ModelLoadError
from mstar.runtime.async_engine import AsyncEngine
from mstar.runtime.model import Request
from mstar.zoo import model_options, resolve_model
from mstar.zoo.checkpoints import FAMILY_FILES, checkpoint_spec
from mstar.zoo.orpheus.checkpoint import make_random_checkpoint as make_orpheus
from mstar.zoo.orpheus.config import LLAMA3_VOCAB_SIZE, config_from_checkpoint, get_orpheus_config
from mstar.zoo.orpheus.model import OrpheusModel


def _dir(tmp_path: Path, name: str, files: dict[str, object]) -> Path:
    root = tmp_path / name
    root.mkdir()
    for file, content in files.items():
        (root / file).write_text(content if isinstance(content, str) else json.dumps(content))
    return root


def test_each_family_is_recognised_by_its_files(tmp_path: Path) -> None:
    cases = {
        "mstar.zoo.llm:TextLLM": {"config.json": {"model_type": "llama"}, "model.safetensors": ""},
        "mstar.zoo.qwen3_omni.model:Qwen3OmniModel": {
            "config.json": {"model_type": "qwen3_omni_moe"}
        },
        "mstar.zoo.bagel.model:BagelModel": dict.fromkeys(
            ("llm_config.json", "vit_config.json", "ema.safetensors", "ae.safetensors"), ""
        ),
        "mstar.zoo.pi05.model:Pi05Model": {
            "config.json": {"type": "pi05"},
            "model.safetensors": "",
        },
    }
    for i, (factory, files) in enumerate(cases.items()):
        spec = checkpoint_spec(_dir(tmp_path, f"c{i}", files), dtype="auto")
        assert spec.factory == factory
        assert spec.kwargs["dtype"] == "auto"
        assert Path(spec.kwargs["checkpoint"]).name == f"c{i}"
    # openpi's converted layout names its variants instead of a type
    openpi = _dir(tmp_path, "openpi", {"config.json": {"paligemma_variant": "gemma_2b"}})
    assert checkpoint_spec(openpi).factory == "mstar.zoo.pi05.model:Pi05Model"
    # a Llama served with a SNAC codec is Orpheus
    llama = tmp_path / "c0"
    assert checkpoint_spec(llama, snac_dir="snac").factory == "mstar.zoo.orpheus.model:OrpheusModel"


def test_a_qwen3_omni_directory_is_not_served_as_a_llama(tmp_path: Path) -> None:
    path = _dir(
        tmp_path, "omni", {"config.json": {"model_type": "qwen3_omni_moe"}, "model.safetensors": ""}
    )
    spec = resolve_model(str(path))
    assert spec.factory == "mstar.zoo.qwen3_omni.model:Qwen3OmniModel"
    assert spec.kwargs == {"config": None, "checkpoint": str(path.resolve())}


def test_a_vjepa2_file_is_recognised_by_its_state_dicts(tmp_path: Path) -> None:
    good, other = tmp_path / "vitg.pt", tmp_path / "other.pt"
    torch.save(
        {
            "encoder": {"patch_embed.proj.weight": torch.zeros(1)},
            "predictor": {"predictor_embed.weight": torch.zeros(1)},
        },
        good,
    )
    torch.save({"model": {"w": torch.zeros(1)}}, other)
    assert checkpoint_spec(good).factory == "mstar.zoo.vjepa2.model:VJepa2Model"
    with pytest.raises(ModelLoadError, match="without V-JEPA 2's 'encoder'"):
        checkpoint_spec(other)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (
            {"llm_config.json": "{}", "ema.safetensors": ""},
            "looks like a BAGEL checkpoint but lacks vit_config.json, ae.safetensors",
        ),
        (
            {
                "config.json": {
                    "encoder_dim": 64,
                    "decoder_dim": 64,
                    "encoder_rates": [2],
                    "decoder_rates": [2],
                }
            },
            "is a SNAC codec",
        ),
        (
            {
                "config.json": {"model_type": "llama"},
                "tokenizer.json": '{"added": "<custom_token_7>"}',
            },
            "--snac-dir",
        ),
        ({"config.json": {"model_type": "mistral"}}, "config.json with model_type 'mistral'"),
        ({"weights.bin": ""}, "found files weights.bin"),
        ({"config.json": "[1, 2]"}, "must hold a JSON object"),
    ],
)
def test_what_matches_no_family_says_what_was_found(
    tmp_path: Path, files: dict[str, object], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message) as info:
        checkpoint_spec(_dir(tmp_path, "ckpt", files))
    if "found" in message or "model_type" in message:
        for family in FAMILY_FILES:  # and what each family needs
            assert family in str(info.value)


def test_paths_that_do_not_exist_and_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model(str(tmp_path / "absent"))
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")


def test_an_option_the_model_does_not_take_names_the_ones_it_does() -> None:
    with pytest.raises(
        ModelLoadError, match=r"toy-composite takes no option 'dtype' \(its options: seed\)"
    ):
        resolve_model("toy-composite", dtype="auto")
    assert resolve_model("qwen3-omni-tiny", dtype="bfloat16").kwargs == {
        "config": "qwen3-omni-tiny",
        "dtype": "bfloat16",
    }
    options = model_options("mstar.zoo.orpheus.model:OrpheusModel")
    assert {"checkpoint", "snac_dir", "dtype", "constrained"} <= set(options) and options[
        "codec_batch_size"
    ] == 4


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_flags_become_keyword_arguments() -> None:
    assert model_kwargs(_flags()) == {}
    args = _flags(
        "--checkpoint", "ckpt", "--dtype", "auto", "--snac-dir", "snac", "--robot", "libero",
        "--norm-stats", "stats.json", "--asset-id", "libero", "--tokenizer", "tok.model",
        "--model-option", "constrained=true", "--model-option", "engine_config={\"num_blocks\": "
                                                                "64}",
        "--model-option", "name=my model",
    )  # fmt: skip
    assert model_kwargs(args) == {
        "checkpoint": "ckpt",
        "dtype": "auto",
        "snac_dir": "snac",
        "robot": "libero",
        "norm_stats": "stats.json",
        "asset_id": "libero",
        "tokenizer": "tok.model",
        "constrained": True,
        "engine_config": {"num_blocks": 64},
        "name": "my model",
    }
    with pytest.raises(ModelLoadError, match="write KEY=VALUE"):
        model_kwargs(_flags("--model-option", "constrained"))
    with pytest.raises(ModelLoadError, match="repeats --dtype"):
        model_kwargs(_flags("--dtype", "auto", "--model-option", "dtype=float32"))
    with pytest.raises(SystemExit):
        _flags("--dtype", "int8")


# --- Orpheus: its config from the two checkpoints' config.json ---------------------------------


@pytest.fixture(scope="module")
def custom_orpheus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A speech LM of sizes no preset has (3 layers, 96 wide) beside a tiny SNAC."""
    tiny = get_orpheus_config("orpheus-tiny")
    llm = dataclasses.replace(tiny.llm, hidden_size=96, num_hidden_layers=3, head_dim=24)
    cfg = make_orpheus(
        dataclasses.replace(tiny, name="custom", llm=llm),
        tmp_path_factory.mktemp("orpheus"),
        seed=3,
    )
    assert cfg.llm_dir is not None and cfg.snac_dir is not None
    return cfg.llm_dir, cfg.snac_dir


def test_orpheus_sizes_and_id_layout_come_from_the_files(custom_orpheus: tuple[Path, Path]) -> None:
    llm_dir, snac_dir = custom_orpheus
    cfg = config_from_checkpoint(llm_dir, snac_dir)
    tiny = get_orpheus_config("orpheus-tiny")
    assert (cfg.llm.hidden_size, cfg.llm.num_hidden_layers, cfg.llm.head_dim) == (96, 3, 24)
    assert cfg.snac == tiny.snac
    # 29,706 ids: 1,024 text ids below 10 special and 7 x 4,096 audio ids
    assert cfg.layout == tiny.layout
    assert cfg.name == llm_dir.name and not cfg.constrained
    real = get_orpheus_config("orpheus-3b")
    assert (
        real.llm.vocab_size >= LLAMA3_VOCAB_SIZE + 10 + 7 * 4096
        and real.layout.tokeniser_length == LLAMA3_VOCAB_SIZE
    )


async def _speak(model: OrpheusModel) -> torch.Tensor:
    data = {
        "text": "a checkpoint of its own",
        "voice": "tara",
        "max_tokens": 56,
        "temperature": 0.0,
        "seed": 1,
    }
    async with await AsyncEngine.start(model) as engine:
        outputs = await engine.run(Request("speech", data))
    return torch.cat([o.data for o in outputs])


async def test_orpheus_read_from_its_files_speaks_as_the_explicit_config(
    custom_orpheus: tuple[Path, Path],
) -> None:
    llm_dir, snac_dir = custom_orpheus
    read = OrpheusModel(None, checkpoint=str(llm_dir), snac_dir=str(snac_dir), constrained=True)
    explicit = OrpheusModel(
        dataclasses.replace(config_from_checkpoint(llm_dir, snac_dir), constrained=True),
        checkpoint=str(llm_dir), snac_dir=str(snac_dir),
    )  # fmt: skip
    assert read.config == explicit.config and read.name == llm_dir.name
    audio = await _speak(read)
    assert audio.numel() == 2048 * 8  # 56 constrained audio tokens: 8 frames
    torch.testing.assert_close(audio, await _speak(explicit), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="checkpoint= \\(the speech LM\\) and snac_dir="):
        OrpheusModel(None, checkpoint=str(llm_dir))
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        OrpheusModel(None, checkpoint=str(llm_dir), snac_dir=str(snac_dir), dtype="int8")


def test_orpheus_vocabulary_too_small_for_its_audio_ids(
    custom_orpheus: tuple[Path, Path], tmp_path: Path
) -> None:
    llm_dir, snac_dir = custom_orpheus
    small = tmp_path / "llm"
    small.mkdir()
    hf = json.loads((llm_dir / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**hf, "vocab_size": 1000}))
    with pytest.raises(CheckpointError, match="vocab_size 1000 leaves no room for text ids"):
        config_from_checkpoint(small, snac_dir)
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        config_from_checkpoint(llm_dir, tmp_path)
