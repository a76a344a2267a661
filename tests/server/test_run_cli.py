"""`mstar run`: the default task, flags checked before the model loads, errors naming the
flags, robot observations from a JSON file, and what was written and how long each phase took."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from mstar.cli import main
from mstar.runtime.async_engine import AsyncEngine
from tests.server.models import save_tiny_chat_llama

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pi05_observation.json"
PHASES = re.compile(r"mstar run: load \d+\.\d+ s · run \d+\.\d+ s · write \d+\.\d+ s\n")


def _greedy(path: Path, prompt: list[int], num_tokens: int) -> list[int]:
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    ids = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [int(i) for i in ids[0, len(prompt) :]]


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Make loading a model fail the test; return the list of attempts (empty if none)."""
    attempts: list[Any] = []

    async def start(*args: Any, **kwargs: Any) -> AsyncEngine:
        attempts.append(args)
        raise AssertionError("mstar run loaded the model")

    monkeypatch.setattr(AsyncEngine, "start", start)
    return attempts


def test_run_sends_a_chat_to_an_instruct_model_without_a_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = save_tiny_chat_llama(tmp_path / "llama")
    argv = [
        "run",
        str(path),
        "--text",
        "Why?",
        "--param",
        "max_tokens=5",
        "--param",
        "ignore_eos=true",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Why?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # Greedy by default: the same answer as transformers' greedy decoding of the chat prompt;
    # standard output holds only the answer, standard error where it went and the phases.
    assert (
        captured.out == tokenizer.decode(_greedy(path, prompt, 5), skip_special_tokens=True) + "\n"
    )
    assert "mstar run: wrote 5 tokens of text to standard output\n" in captured.err
    assert PHASES.search(captured.err), captured.err


def test_run_asks_for_text_in_flags_not_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_loading: list[Any]
) -> None:
    path = save_tiny_chat_llama(tmp_path / "llama")
    capsys.readouterr()
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    # The model's own message speaks of prompt, messages and prompt_token_ids.
    assert err == f"mstar run: error: task 'generate' of {path} needs --text\n"
    assert main(["run", str(path), "--text", "hi", "--param", "max_tokens=100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mstar run: error: --param max_tokens: "), err
    assert "the model's length is 4096" in err
    assert no_loading == []


@pytest.mark.parametrize(
    ("task", "suffix", "expected"),
    [(None, ".wav", r"\d+\.\d\d s of 16 kHz audio"), ("image", ".png", r"8 x 8 L image")],
)
def test_run_writes_the_output_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], task: str | None, suffix: str, expected: str
) -> None:
    out = tmp_path / f"out{suffix}"
    # No --task: the model's first task (toy-composite's are speech, image, image_edit).
    argv = ["run", "toy-composite", "--text", "Hello", "--out", str(out)]
    assert main(argv + (["--task", task] if task else [])) == 0
    err = capsys.readouterr().err
    assert re.search(rf"mstar run: wrote {re.escape(str(out))} \({expected}\)", err), err
    assert PHASES.search(err), err
    if suffix == ".wav":
        with wave.open(str(out)) as f:
            assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 16000)
            seconds = f.getnframes() / f.getframerate()
        assert seconds > 0 and f"wrote {out} ({seconds:.2f} s of 16 kHz audio)" in err
    else:
        with Image.open(out) as image:
            assert (image.width, image.height, image.mode) == (8, 8, "L")


def _png(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path)
    return path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["toy-composite"], "task 'speech' of toy-composite needs --text"),
        (
            ["toy-composite", "--task", "paint", "--text", "x"],
            "--task: model 'toy-composite' has no task 'paint' "
            "(its tasks: speech, image, image_edit; the default is speech)",
        ),
        (
            ["toy-composite", "--task", "image_edit", "--text", "x"],
            "task 'image_edit' of toy-composite needs --image",
        ),
        (["orpheus-tiny", "--text", ""], "--text must be a non-empty string"),
        (
            ["orpheus-tiny", "--text", "hi", "--image", "{tmp}/none.png"],
            "--image {tmp}/none.png: '{tmp}/none.png' does not exist",
        ),
        (
            ["orpheus-tiny", "--text", "hi", "--image", "{tmp}/obs.json"],
            "--image {tmp}/obs.json: cannot read '{tmp}/obs.json' as an image",
        ),
        (
            ["orpheus-tiny", "--text", "hi", "--image", "{tmp}/a.png"],
            "--image: task 'speech' of orpheus-tiny does not take it",
        ),
        (
            ["orpheus-tiny", "--text", "hi", "--param", "max_tokens=0"],
            "--param max_tokens: must be an integer >= 1, got 0",
        ),
        (
            ["orpheus-tiny", "--text", "hi", "--param", "speed=2"],
            "--param speed: task 'speech' of orpheus-tiny does not take it",
        ),
        (
            ["orpheus-tiny", "--text", "hi", "--observation", "{tmp}/good.json"],
            "task 'speech' of orpheus-tiny does not take --observation",
        ),
        (
            ["orpheus-tiny", "--text", "hi", "--no-chat-template"],
            "task 'speech' of orpheus-tiny does not take --no-chat-template",
        ),
        (
            ["pi05-tiny"],
            "task 'act' of pi05-tiny needs --observation FILE.json: DROID observation has no "
            "'observation/joint_position'",
        ),
        (["pi05-tiny", "--text", "go"], "task 'act' of pi05-tiny needs --observation FILE.json"),
        (
            ["pi05-tiny", "--observation", "{tmp}/a.png"],
            "--observation {tmp}/a.png: not a JSON file",
        ),
        (
            ["pi05-tiny", "--observation", "{tmp}/good.json"],
            "--observation {tmp}/good.json: DROID observation has no 'observation/joint_position'",
        ),
        (
            ["pi05-tiny", "--observation", "{tmp}/obs.json"],
            "--observation {tmp}/obs.json: key 'observation/wrist_image_left': "
            "'{tmp}/missing.png' does not exist",
        ),
        (["vjepa2-tiny"], "task 'encode' of vjepa2-tiny needs --image"),
        (
            ["vjepa2-tiny", "--task", "plan", "--image", "{tmp}/a.png"],
            "task 'plan' of vjepa2-tiny needs --param goal_image=VALUE",
        ),
    ],
)
def test_flags_are_checked_before_the_model_loads(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_loading: list[Any],
    argv: list[str],
    expected: str,
) -> None:
    _png(tmp_path / "a.png")
    obs = {
        "observation/exterior_image_1_left": "a.png",
        "observation/wrist_image_left": "missing.png",
    }
    (tmp_path / "obs.json").write_text(json.dumps(obs))
    (tmp_path / "good.json").write_text(json.dumps({"prompt": "pick up the cup"}))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mstar run: error: "), err
    assert expected.replace("{tmp}", str(tmp_path)) in err, err
    assert no_loading == []  # refused before any weights load


def _actions(path: Path) -> np.ndarray:
    doc = json.loads(path.read_text())
    assert list(doc) == ["action:actions"]
    return np.asarray(doc["action:actions"], dtype=np.float32)


@pytest.mark.slow  # two pi05-tiny runs, one of them a fresh `python -m mstar.cli` process
def test_run_acts_on_the_example_observation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "actions.json"
    argv = [
        "run",
        "pi05-tiny",
        "--observation",
        str(EXAMPLE),
        "--param",
        "seed=1",
        "--out",
        str(out),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "mstar.cli", *argv],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert f"mstar run: wrote {out} (JSON: action:actions [10, 8])\n" in done.stderr
    assert PHASES.search(done.stderr), done.stderr
    actions = _actions(out)
    assert actions.shape == (1, 10, 8) and np.isfinite(actions).all()

    # The same observation as .npy and nested lists, in another folder: the same actions.
    doc = json.loads(EXAMPLE.read_text())
    folder = tmp_path / "obs"
    folder.mkdir()
    with Image.open(EXAMPLE.parent / doc["observation/exterior_image_1_left"]) as image:
        np.save(folder / "exterior.npy", np.array(image.convert("RGB")))
    with Image.open(EXAMPLE.parent / doc["observation/wrist_image_left"]) as image:
        wrist = np.array(image.convert("RGB")).tolist()
    (folder / "obs.json").write_text(
        json.dumps(
            {
                **doc,
                "observation/exterior_image_1_left": "exterior.npy",
                "observation/wrist_image_left": wrist,
            }
        )
    )
    again = tmp_path / "again.json"
    argv = [
        "run",
        "pi05-tiny",
        "--observation",
        str(folder / "obs.json"),
        "--param",
        "seed=1",
        "--out",
        str(again),
    ]
    assert main(argv) == 0
    # (Another process may sum in another order: equal to float32 rounding, not bit for bit.)
    np.testing.assert_allclose(_actions(again), actions, rtol=1e-4, atol=1e-5)
    # --text is the instruction of an observation without one.
    # absolute paths
    images = {k: str(EXAMPLE.parent / v) for k, v in doc.items() if k.endswith("_left")}
    untold = {k: v for k, v in doc.items() if k != "prompt"}
    (folder / "obs.json").write_text(json.dumps({**untold, **images}))
    told = tmp_path / "told.json"
    assert main([*argv[:-1], str(told), "--text", doc["prompt"]]) == 0
    np.testing.assert_allclose(_actions(told), actions, rtol=1e-4, atol=1e-5)
    # Another joint state is another prompt: other actions.
    (folder / "obs.json").write_text(
        json.dumps({**doc, **images, "observation/joint_position": [0.5] * 7})
    )
    assert main([*argv[:-1], str(tmp_path / "other.json")]) == 0
    assert np.abs(_actions(tmp_path / "other.json") - actions).max() > 1e-2
    capsys.readouterr()


@pytest.mark.slow
def test_run_answers_a_question_with_smollm2(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        from mstar.zoo.smollm2 import smollm2_checkpoint_dir

        smollm2_checkpoint_dir()
    except Exception as exc:  # the weights package is not installed here
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")
    assert main(["run", "smollm2-135m", "--text", "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out, captured.out
    assert "tokens of text to standard output" in captured.err
