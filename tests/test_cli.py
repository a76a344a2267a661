"""The `mstar` command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import pytest

from mstar.cli import main


def test_demo_prints_the_graph_and_writes_audio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo.wav"
    assert main(["demo", "--model", "toy-composite", "--text", "hi", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model toy-composite" in text
    assert "partition Vocoder" in text
    assert "request 'speech'" in text and "request 'image'" in text
    assert "request 'speech' on orpheus-tiny" in text and "identical to the reference" in text
    with wave.open(str(out)) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24000)
        assert f.getnframes() > 0


@pytest.mark.slow  # starts `mstar serve assistant` with real weights
def test_the_main_demo_speaks_the_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "answer.wav"
    assert main(["demo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    answer = printed.split("answer:", 1)[1].splitlines()[0].strip()
    assert len(answer.split()) >= 5, printed  # a real answer, streamed as text
    with wave.open(str(out)) as f:
        # as OpenAI's clients play it
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24_000)
        seconds = f.getnframes() / f.getframerate()
    # English speech runs about 12-16 characters a second: the WAV speaks the printed answer.
    assert 0.035 <= seconds / len(answer) <= 0.12, (answer, seconds)


def test_models_lists_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    assert "toy-composite" in capsys.readouterr().out


def test_entry_point_help_and_bad_usage() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "mstar.cli", "--help"], capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0 and "demo" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "mstar.cli", "nope"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_run_plans_an_action_with_the_world_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(0)
    for name in ("ctx", "goal"):
        Image.fromarray((rng.rand(64, 64, 3) * 255).astype("uint8")).save(tmp_path / f"{name}.png")
    out = tmp_path / "plan.json"
    args = ["run", "vjepa2-tiny", "--task", "plan", "--image", str(tmp_path / "ctx.png")]
    assert (
        main(
            [
                *args,
                "--param",
                f"goal_image={tmp_path / 'goal.png'}",
                "--param",
                "seed=1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (action,) = json.loads(out.read_text())["action:action"]
    assert len(action) == 7 and all(isinstance(x, float) for x in action)


def test_run_help_documents_the_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "--observation FILE.json" in text and "examples/pi05_observation.json" in text
    assert "default: the model's first task" in text
    # The help shows the example file as it is, and the images it names are beside it.
    import json

    example = Path(__file__).resolve().parents[1] / "examples" / "pi05_observation.json"
    doc = json.loads(example.read_text())
    shown = text[text.index("{", text.index("examples/pi05_observation.json")) :]
    assert json.loads(shown[: shown.index("}") + 1]) == doc
    assert all((example.parent / doc[key]).is_file() for key in doc if key.endswith("_left"))
