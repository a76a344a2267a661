"""CEM planning: sampling constraints, the refit rule, final rounding, settings, and that it
finds the actions that reach a goal in a world whose dynamics are known."""

from __future__ import annotations

import pytest
import torch

from mstar.zoo.vjepa2 import (
    CEMConfig,
    CEMParams,
    CEMState,
    final_plan,
    l1_energy,
    plan_with,
    refit,
    sample_actions,
)
from mstar.zoo.vjepa2.cem import cem_sample_node, cem_update_node


def params(**overrides: object) -> CEMParams:
    return CEMParams.make(CEMConfig(samples=64, topk=8, cem_steps=4), overrides)


def test_samples_respect_the_action_space_and_are_seeded() -> None:
    state = CEMState.initial(params(rollout=3, seed=5))
    state.mean[:, :3] = 0.04  # push xyz towards the clip
    state.mean[:, 3] = 0.7
    actions = sample_actions(state)
    assert actions.shape == (64, 3, 7)
    assert actions[..., :3].abs().max() <= 0.05 and (actions[..., :3].abs() == 0.05).any()
    assert actions[..., 3:6].abs().sum() == 0
    assert actions[..., 6].abs().max() <= 0.75
    torch.testing.assert_close(sample_actions(state), actions)
    assert not torch.equal(
        sample_actions(CEMState(state.mean, state.std, 1, state.params)), actions
    )


def test_refit_takes_the_topk_with_momentum() -> None:
    p = params(
        samples=4,
        topk=2,
        rollout=1,
        momentum_mean=0.25,
        momentum_std=0.5,
        momentum_mean_gripper=0.1,
        momentum_std_gripper=0.0,
    )
    state = CEMState.initial(p)
    actions = torch.zeros(4, 1, 7)
    actions[:, 0, 0] = torch.tensor([0.01, 0.03, -0.05, 0.02])
    actions[:, 0, 6] = torch.tensor([0.2, 0.6, 0.0, 1.0])
    energies = torch.tensor([0.5, 0.1, 0.9, 0.3])  # best: samples 1 and 3
    new = refit(state, actions, energies)
    assert new.iteration == 1
    torch.testing.assert_close(new.mean[0], torch.tensor([0.025 * 0.75, 0.0, 0.0, 0.8 * 0.9]))
    x_std = torch.tensor([0.03, 0.02]).std()
    g_std = torch.tensor([0.6, 1.0]).std()
    torch.testing.assert_close(
        new.std[0], torch.tensor([x_std * 0.5 + 0.05 * 0.5, 0.025, 0.025, g_std])
    )


def test_final_plan_zeroes_rotation_and_small_gripper_means() -> None:
    state = CEMState.initial(params(rollout=2))
    state.mean[:] = torch.tensor([[0.01, 0.02, 0.03, 0.2], [0.0, 0.0, 0.0, -0.5]])
    plan = final_plan(state)
    torch.testing.assert_close(
        plan, torch.tensor([[0.01, 0.02, 0.03, 0, 0, 0, 0.0], [0, 0, 0, 0, 0, 0, -0.5]])
    )


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="topk must be in"):
        params(topk=65)
    with pytest.raises(ValueError, match=r"cem_steps must be in 1\.\.100"):
        params(cem_steps=0)
    with pytest.raises(ValueError, match="must be an integer"):
        params(samples=8.5)
    with pytest.raises(ValueError, match="unknown planning settings"):
        params(steps=3)
    state = CEMState.initial(params(maxnorm=0.1))
    assert CEMState.from_value(state.to_value()).params == state.params


def toy_world(z: torch.Tensor, pose: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Latent = position: each step moves it by the action's xyz (a world with known dynamics)."""
    return z + actions[..., :3].sum(dim=1)[:, None, :]


def test_plans_reach_a_reachable_goal_in_a_known_world() -> None:
    start = torch.zeros(1, 3)
    target = torch.tensor([0.06, -0.03, 0.02])
    p = params(samples=200, topk=10, cem_steps=10, rollout=2, seed=3)
    plan = plan_with(toy_world, start, torch.zeros(7), (start + target), p)
    assert (plan[:, :3].sum(dim=0) - target).abs().max() < 0.01
    assert l1_energy(toy_world(start[None], torch.zeros(1, 7), plan[None]), start + target) < 0.005


def test_nodes_run_one_iteration_as_values() -> None:
    p = params(samples=6, topk=2, rollout=2, cem_steps=2)
    state = CEMState.initial(p).to_value()
    context, goal, pose = torch.zeros(4, 3), torch.ones(4, 3), torch.zeros(7)
    (sampled,) = cem_sample_node([{"context": context, "pose0": pose, "cem": state}])
    assert sampled["latent"].shape == (6, 4, 3) and sampled["step"] == 0
    assert sampled["job"]["emit"] == "none" and sampled["job"]["actions"].shape == (6, 2, 7)
    final = toy_world(sampled["latent"], sampled["pose"], sampled["actions"])
    (updated,) = cem_update_node(
        [{"latent": final, "goal": goal, "actions": sampled["actions"], "cem": sampled["cem"]}]
    )
    assert updated["planned"] is False and updated["cem"]["iteration"] == 1
    (sampled,) = cem_sample_node([{"context": context, "pose0": pose, "cem": updated["cem"]}])
    (done,) = cem_update_node(
        [{"latent": final, "goal": goal, "actions": sampled["actions"], "cem": sampled["cem"]}]
    )
    assert done["planned"] is True and done["action"].shape == (7,)
