"""`mstar serve PATH` on checkpoints whose sizes are no preset's, asked through the real clients.

Each checkpoint is written as its upstream publishes it (Qwen3-Omni by transformers'
``save_pretrained``); the server started by the command line must answer exactly what the
model built in Python from the same files with an explicit config answers.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from mstar.client import Client, GenerateOutput, ImageOutput, TensorOutput, image_url
from mstar.runtime.model import ModelSpec
from mstar.zoo import resolve_model
from mstar.zoo.bagel.checkpoint import make_random_checkpoint as make_bagel
from mstar.zoo.qwen3_omni.checkpoint import make_random_checkpoint
from mstar.zoo.qwen3_omni.config import Qwen3OmniConfig, get_qwen3_omni_config
from tests.server.conftest import running_server
from tests.zoo.bagel.test_checkpoint_config import CUSTOM as BAGEL_CUSTOM
from tests.zoo.bagel.test_checkpoint_config import write_published_jsons
from tests.zoo.vjepa2.test_checkpoint_config import CUSTOM as VJEPA_CUSTOM
from tests.zoo.vjepa2.test_checkpoint_config import write_upstream

SETTINGS = {"temperature": 0.0, "max_tokens": 8, "seed": 1}
MESSAGES = [{"role": "user", "content": "Say something about checkpoints."}]


def _custom_config() -> Qwen3OmniConfig:
    """The tiny Qwen3-Omni with a thinker of 3 layers and 6 experts: no preset's sizes."""
    hf = copy.deepcopy(get_qwen3_omni_config("qwen3-omni-tiny").hf)
    text = hf["thinker_config"]["text_config"]
    text["num_hidden_layers"], text["num_experts"] = 3, 6
    return Qwen3OmniConfig(name="omni-custom", hf=hf, speaker="ethan")


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        _custom_config(), tmp_path_factory.mktemp("ckpt") / "omni-custom", seed=4
    )


def _read_lines(stream: io.TextIOBase, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


@contextlib.contextmanager
def serve_cli(*args: str) -> Iterator[str]:
    """``mstar serve ARGS`` in a process of its own; yields its URL once the model is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mstar.cli", "serve", *args, "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ},
    )  # fmt: skip
    assert proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        url = None
        while url is None:
            event = json.loads(lines.get(timeout=120))
            url = event.get("url") if event["event"] == "server_bound" else None
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "the server exited while loading"
            try:
                if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def served(omni_dir: Path) -> Iterator[str]:
    with serve_cli(
        str(omni_dir), "--dtype", "auto", "--model-option", "max_audio_frames=40"
    ) as url:
        yield url


def _answer(url: str, model: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=model, messages=MESSAGES, **SETTINGS)  # type: ignore[arg-type]
    assert reply.choices[0].message.content and reply.usage is not None
    return reply.choices[0].message.content, reply.usage.completion_tokens


def test_a_qwen3_omni_checkpoint_of_its_own_sizes_serves_from_its_path(
    served: str, omni_dir: Path
) -> None:
    models = openai.OpenAI(base_url=f"{served}/v1", api_key="unused").models.list()
    assert [m.id for m in models.data] == [str(omni_dir)]
    got = _answer(served, str(omni_dir))
    explicit = ModelSpec(
        "mstar.zoo.qwen3_omni.model:Qwen3OmniModel",
        {"config": _custom_config(), "checkpoint": str(omni_dir), "max_audio_frames": 40},
    )
    with running_server(explicit, names=("omni-custom",)) as reference:
        assert got == _answer(reference.url, "omni-custom")


def test_serve_names_the_options_a_checkpoint_takes(omni_dir: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mstar.cli",
            "serve",
            str(omni_dir),
            "--port",
            "0",
            "--snac-dir",
            "snac",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "takes no option 'snac_dir'" in done.stderr and "max_audio_frames" in done.stderr


# --- BAGEL and V-JEPA 2 through the native client: served by path as by their explicit config ---


def _generate(url: str, task: str, data: dict[str, Any]) -> dict[str, GenerateOutput]:
    with Client(url) as client:
        return {out.name: out for out in client.generate(task, data)}


def _same_outputs(
    by_path: ModelSpec, explicit: ModelSpec, task: str, data: dict[str, Any]
) -> dict[str, GenerateOutput]:
    with running_server(by_path, names=("by-path",)) as server:
        got = _generate(server.url, task, data)
    with running_server(explicit, names=("explicit",)) as server:
        expected = _generate(server.url, task, data)
    assert got.keys() == expected.keys()
    for name, out in got.items():
        other = expected[name]
        assert type(out) is type(other)
        if isinstance(out, ImageOutput):
            assert isinstance(other, ImageOutput)
            np.testing.assert_array_equal(out.image, other.image)
        elif isinstance(out, TensorOutput):
            assert isinstance(other, TensorOutput)
            np.testing.assert_array_equal(out.array, other.array)
    return got


def test_a_bagel_checkpoint_of_its_own_sizes_draws_as_its_explicit_config(tmp_path: Path) -> None:
    directory = make_bagel(BAGEL_CUSTOM, tmp_path / "my-bagel", seed=5)
    write_published_jsons(BAGEL_CUSTOM, directory)
    by_path = resolve_model(str(directory))
    assert by_path.factory == "mstar.zoo.bagel.model:BagelModel"
    explicit = ModelSpec(by_path.factory, {"config": BAGEL_CUSTOM, "checkpoint": str(directory)})
    got = _same_outputs(
        by_path, explicit, "image", {"text": "a red square", "seed": 3, "num_timesteps": 3}
    )
    image = got["image"]
    assert isinstance(image, ImageOutput) and image.image.shape == (48, 48, 3)


def test_a_vjepa2_file_of_its_own_sizes_encodes_as_its_explicit_config(tmp_path: Path) -> None:
    path = write_upstream(VJEPA_CUSTOM, tmp_path / "droid-ac-small.pt", seed=5)
    by_path = resolve_model(str(path), kv={"num_blocks": 16})
    assert by_path.factory == "mstar.zoo.vjepa2.model:VJepa2Model"
    explicit = ModelSpec(
        by_path.factory, {"config": VJEPA_CUSTOM, "checkpoint": str(path), "kv": {"num_blocks": 16}}
    )
    picture = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    got = _same_outputs(by_path, explicit, "encode", {"image": image_url(picture)})
    latents = got["latents"]
    assert isinstance(latents, TensorOutput) and latents.array.shape == (1, 256, 192)


# --- pi0.5 through the openpi robot client: a LIBERO fine-tune of its own sizes, by path ---


@pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
)
def test_a_pi05_libero_checkpoint_serves_the_openpi_client_from_its_path(tmp_path: Path) -> None:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from mstar.zoo.pi05.checkpoint import make_random_checkpoint as make_pi05
    from mstar.zoo.pi05.model import Pi05Model
    from tests.zoo.pi05.test_robots import custom, robot_observation, run_model

    directory = make_pi05(custom("libero"), tmp_path / "pi05-libero-ft", config_format="lerobot")
    observation = robot_observation("libero", 7)
    with serve_cli(str(directory)) as url:
        host, port = url.removeprefix("http://").split(":")
        policy = WebsocketClientPolicy(host, int(port))
        metadata = policy.get_server_metadata()
        actions = policy.infer(observation)["actions"]
    assert metadata == {
        "model": directory.name,
        "robot": "libero",
        "action_horizon": 6,
        "action_dim": 7,
    }
    expected = run_model(Pi05Model(None, checkpoint=str(directory)), observation)
    np.testing.assert_allclose(actions, expected, rtol=1e-5, atol=1e-5)
