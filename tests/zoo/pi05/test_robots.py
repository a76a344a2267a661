"""pi0.5 checkpoints of their own sizes, for the robots openpi's policies define (DROID, LIBERO,
ALOHA), in openpi's and LeRobot's layouts: the config read back from the files, each robot's
observation parsed and its actions shaped and mapped as openpi's transforms do, norm stats from
openpi's ``norm_stats.json`` or LeRobot's normalizer, and a checkpoint served by its path to the
real openpi robot client."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from mstar.errors import CheckpointError
from mstar.graph import Emission
from mstar.runtime import AsyncEngine, Output, Request
from mstar.zoo import resolve_model
from mstar.zoo.pi05.checkpoint import make_random_checkpoint
from mstar.zoo.pi05.checkpoint_config import config_from_checkpoint
from mstar.zoo.pi05.config import Pi05Config, get_pi05_config
from mstar.zoo.pi05.model import Pi05Model
from mstar.zoo.pi05.policy import NormStats, quantile_unnormalize
from mstar.zoo.pi05.robots import ALOHA, aloha_actions_from_pi, aloha_state_to_pi, get_robot_layout

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = get_pi05_config("pi05-tiny")


def custom(robot: str, **changes: Any) -> Pi05Config:
    """The tiny pi0.5 with an action dim and horizon no preset has, for ``robot``."""
    layout = get_robot_layout(robot)
    fields: dict[str, Any] = {
        "name": f"pi05-{robot}-custom",
        "action_dim": 24,
        "action_horizon": 6,
        "robot": robot,
        "robot_dof": layout.action_dim,
        "discrete_state_input": layout.discrete_state_input,
    }
    return dataclasses.replace(TINY, **(fields | changes))


def robot_observation(robot: str, seed: int) -> dict[str, Any]:
    """An observation as each robot's openpi client sends it."""
    g = np.random.default_rng(seed)

    def image(h: int = 30, w: int = 40) -> np.ndarray:
        return g.integers(0, 256, (h, w, 3), dtype=np.uint8)

    if robot == "droid":
        return {
            "observation/exterior_image_1_left": image(),
            "observation/wrist_image_left": image(),
            "observation/joint_position": g.uniform(-1, 1, 7),
            "observation/gripper_position": g.uniform(0, 1, 1),
            "prompt": "put the cup away",
            "seed": seed,
        }
    if robot == "libero":
        return {
            "observation/image": image(),
            "observation/wrist_image": image(),
            "observation/state": g.uniform(-1, 1, 8),
            "prompt": "open the drawer",
            "seed": seed,
        }
    state = g.uniform(-0.5, 0.5, 14)
    state[[6, 13]] = g.uniform(0.2, 0.8, 2)  # grippers: ALOHA's normalized linear position
    return {
        "images": {
            "cam_high": image().transpose(2, 0, 1),
            "cam_left_wrist": image().transpose(2, 0, 1),
        },
        "state": state,
        "prompt": "fold the towel",
        "seed": seed,
    }


def run_model(model: Pi05Model, obs: dict[str, Any]) -> np.ndarray:
    async def run() -> np.ndarray:
        async with await AsyncEngine.start(model) as engine:
            outputs = await engine.run(Request("act", obs))
        return np.asarray(next(o.data for o in outputs if o.name == "actions"))

    return asyncio.run(run())


@pytest.mark.parametrize("config_format", ["openpi", "lerobot"])
@pytest.mark.parametrize("robot", ["droid", "libero", "aloha"])
def test_the_config_reads_back_from_the_checkpoint(
    robot: str, config_format: str, tmp_path: Path
) -> None:
    config = custom(robot)
    if config_format == "lerobot":
        config = dataclasses.replace(config, prompt_state_dim=32, discrete_state_input=True)
    directory = make_random_checkpoint(config, tmp_path / "ckpt", config_format=config_format)
    found = config_from_checkpoint(directory, name=config.name)
    fields = ("vision", "vlm", "expert", "vocab_size", "action_dim", "action_horizon", "num_steps")
    fields += ("max_token_len", "robot", "robot_dof", "discrete_state_input", "prompt_state_dim")
    for field in fields:
        assert getattr(found, field) == getattr(config, field), field


@pytest.mark.parametrize("robot", ["droid", "libero", "aloha"])
def test_a_checkpoint_serves_its_robot_by_path(robot: str, tmp_path: Path) -> None:
    config = custom(robot)
    directory = make_random_checkpoint(config, tmp_path / f"my-{robot}", config_format="openpi")
    spec = resolve_model(str(directory))
    assert spec.factory == "mstar.zoo.pi05.model:Pi05Model"
    model = Pi05Model(**spec.kwargs)
    assert model.config.robot == robot and model.config.action_horizon == 6
    assert model.policy_metadata() == {
        "model": f"my-{robot}", "robot": robot, "action_horizon": 6, "action_dim": config.robot_dof,
    }  # fmt: skip
    actions = run_model(model, robot_observation(robot, 0))
    assert actions.shape == (6, config.robot_dof) and actions.dtype == np.float32
    assert np.isfinite(actions).all() and actions.std() > 0
    other = "libero" if robot != "libero" else "droid"
    with pytest.raises(ValueError, match="observation has no"):
        model.preprocess(Request("act", robot_observation(other, 0)))


def test_libero_prompts_carry_no_state(tmp_path: Path) -> None:
    """pi05_libero sets discrete_state_input=False: the prompt is the task and a newline alone."""
    model = Pi05Model(
        None, checkpoint=str(make_random_checkpoint(custom("libero"), tmp_path / "libero"))
    )
    a, b = robot_observation("libero", 1), robot_observation("libero", 2)
    b["prompt"] = a["prompt"]
    ids = [
        model.preprocess(Request("act", obs)).inputs["vision"]["token_ids"].tolist()
        for obs in (a, b)
    ]
    assert ids[0] == ids[1]  # different states, the same prompt
    assert ids[0] == model.tokenizer.token_ids(a["prompt"], None)
    droid = Pi05Model(
        None, checkpoint=str(make_random_checkpoint(custom("droid"), tmp_path / "droid"))
    )
    c, d = robot_observation("droid", 1), robot_observation("droid", 2)
    d["prompt"] = c["prompt"]
    tokens = [
        droid.preprocess(Request("act", obs)).inputs["vision"]["token_ids"].tolist()
        for obs in (c, d)
    ]
    assert tokens[0] != tokens[1]  # DROID bins its state into the prompt


class _NormalizedPi05(Pi05Model):
    """Returns the flow's actions as they leave the model: normalized, no transform applied."""

    def postprocess(self, request_id: str, emission: Emission) -> Output:
        value = np.asarray(emission.value, dtype=np.float64)
        return Output(
            request_id, emission.modality, emission.name, value, emission.node, emission.walk
        )


def test_aloha_actions_are_openpis_output_transforms(tmp_path: Path) -> None:
    """openpi's pi05_aloha: the model predicts normalized joint deltas; unnormalize, add the state
    to the joints (AbsoluteActions), then map joints and grippers back to ALOHA's convention
    (AlohaOutputs)."""
    directory = make_random_checkpoint(custom("aloha"), tmp_path / "aloha")
    obs = robot_observation("aloha", 3)
    actions = run_model(Pi05Model(None, checkpoint=str(directory)), obs)
    bare = _NormalizedPi05(None, checkpoint=str(directory))
    bare.layout = dataclasses.replace(ALOHA, delta_action_mask=())  # the same prompt, no offset
    flow = run_model(bare, obs)
    state = aloha_state_to_pi(obs["state"])
    unnormalized = quantile_unnormalize(flow, bare.norm_stats.actions)[:, :14]
    mask = np.array(ALOHA.delta_action_mask)
    reference = aloha_actions_from_pi(unnormalized + np.where(mask, state[:14], 0.0))
    assert actions.shape == (6, 14)
    np.testing.assert_allclose(actions, reference, rtol=1e-4, atol=1e-4)
    # the state was added
    assert not np.allclose(actions, aloha_actions_from_pi(unnormalized), atol=1e-3)


def test_lerobot_normalizer_stats_serve_as_norm_stats_json(tmp_path: Path) -> None:
    directory = make_random_checkpoint(custom("libero"), tmp_path / "json")
    stats_file = next((directory / "assets").rglob("norm_stats.json"))
    stats = NormStats.load(stats_file)
    lerobot = tmp_path / "lerobot"
    shutil.copytree(directory, lerobot)
    shutil.rmtree(lerobot / "assets")
    tensors = {
        f"{key}.{name}": np.asarray(getattr(quantiles, name), dtype=np.float32)
        for key, quantiles in (("observation.state", stats.state), ("action", stats.actions))
        for name in ("q01", "q99")
    }
    # Stored in float32, as LeRobot does: compare against the same rounding.
    rounded = {
        "norm_stats": {
            key: {n: np.asarray(getattr(q, n), dtype=np.float32).tolist() for n in ("q01", "q99")}
            for key, q in (("state", stats.state), ("actions", stats.actions))
        }
    }
    stats_file.write_text(json.dumps(rounded))
    save_file(tensors, str(lerobot / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    obs = robot_observation("libero", 4)
    from_json = run_model(Pi05Model(None, checkpoint=str(directory)), obs)
    from_lerobot = run_model(Pi05Model(None, checkpoint=str(lerobot)), obs)
    np.testing.assert_array_equal(from_json, from_lerobot)


def test_norm_stats_errors_name_what_was_looked_for(tmp_path: Path) -> None:
    directory = make_random_checkpoint(custom("libero"), tmp_path / "ckpt")
    with pytest.raises(
        CheckpointError, match=r"asset ids in the checkpoint: physical-intelligence/libero"
    ):
        Pi05Model(None, checkpoint=str(directory), asset_id="droid")
    shutil.rmtree(directory / "assets")
    with pytest.raises(CheckpointError, match="has no norm stats; looked for"):
        Pi05Model(None, checkpoint=str(directory))
    with pytest.raises(CheckpointError, match="needs config= a preset or checkpoint="):
        Pi05Model(None)


def test_an_unknown_robot_is_named(tmp_path: Path) -> None:
    directory = make_random_checkpoint(custom("droid"), tmp_path / "ckpt")
    with pytest.raises(
        ValueError, match=r"unknown robot 'ur5': pi0\.5 serves droid, libero, aloha"
    ):
        Pi05Model(None, checkpoint=str(directory), robot="ur5")
