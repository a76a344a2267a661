"""Planning with the cross-entropy method (CEM) over world-model rollouts.

One CEM iteration, as V-JEPA 2-AC plans (``mpc_utils.cem``):

1. sample ``samples`` action trajectories of ``rollout`` steps from per-step Gaussians over
   (dx, dy, dz, gripper): xyz clipped to +-``maxnorm``, rotation deltas 0, gripper clipped
   to +-``gripper_clip``;
2. roll every trajectory out from the context frame (one batched rollout);
3. score each by the L1 energy ``mean |z_final - z_goal|``;
4. refit mean and (unbiased) std to the ``topk`` lowest-energy trajectories, with momentum
   (xyz and gripper have their own momenta).

After ``cem_steps`` iterations the plan is the mean trajectory (rotation 0, gripper means
below 0.25 in magnitude set to 0); MPC executes its first action.

In the served model the iterations are a `DynamicLoop` over ``cem_sample`` (step 1),
a `DynamicLoop` over the predictor (step 2) and ``cem_update`` (steps 3-4), with the
planner's state travelling between them as plain values (`CEMState` as a dict). Sampling is
seeded per request and iteration, so a plan is reproducible; `plan_with` runs the same
iterations in-process around any rollout function (the reference the tests compare with).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mstar.zoo.vjepa2.config import CEMConfig

__all__ = [
    "MAX_CEM_STEPS",
    "CEMParams",
    "CEMState",
    "cem_sample_node",
    "cem_update_node",
    "final_plan",
    "l1_energy",
    "plan_with",
    "refit",
    "sample_actions",
]

MAX_CEM_STEPS = 100
"""Most CEM iterations one plan may ask for (the bound of the planning loop)."""


@dataclass(frozen=True)
class CEMParams:
    """One plan's settings (defaults from `CEMConfig`), validated on construction."""

    rollout: int
    samples: int
    topk: int
    cem_steps: int
    momentum_mean: float
    momentum_std: float
    momentum_mean_gripper: float
    momentum_std_gripper: float
    maxnorm: float
    gripper_clip: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.cem_steps <= MAX_CEM_STEPS:
            raise ValueError(f"cem_steps must be in 1..{MAX_CEM_STEPS}, got {self.cem_steps}")
        if self.samples < 2:
            raise ValueError(f"samples must be >= 2, got {self.samples}")
        if not 2 <= self.topk <= self.samples:
            raise ValueError(f"topk must be in 2..samples ({self.samples}), got {self.topk}")
        if self.rollout < 1:
            raise ValueError(f"rollout must be >= 1, got {self.rollout}")
        for name in (
            "momentum_mean",
            "momentum_std",
            "momentum_mean_gripper",
            "momentum_std_gripper",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.maxnorm <= 0 or self.gripper_clip <= 0:
            raise ValueError("maxnorm and gripper_clip must be positive")

    @classmethod
    def make(cls, defaults: CEMConfig, overrides: Mapping[str, Any]) -> CEMParams:
        """Return defaults updated by ``overrides`` (unknown keys are an error)."""
        fields = set(cls.__dataclass_fields__)
        unknown = set(overrides) - fields
        if unknown:
            raise ValueError(
                f"unknown planning settings {sorted(unknown)}; known: {sorted(fields)}"
            )
        values: dict[str, Any] = {**asdict(defaults), "seed": 0, **overrides}
        for name in ("rollout", "samples", "topk", "cem_steps", "seed"):
            if isinstance(values[name], bool) or not isinstance(values[name], int):
                raise ValueError(f"{name} must be an integer, got {values[name]!r}")
        for name in fields - {"rollout", "samples", "topk", "cem_steps", "seed"}:
            if isinstance(values[name], bool) or not isinstance(values[name], int | float):
                raise ValueError(f"{name} must be a number, got {values[name]!r}")
            values[name] = float(values[name])
        return cls(**values)


@dataclass
class CEMState:
    """The planner between iterations: per-step mean and std over (dx, dy, dz, gripper)."""

    mean: torch.Tensor  # [rollout, 4]
    std: torch.Tensor  # [rollout, 4]
    iteration: int
    params: CEMParams

    @classmethod
    def initial(cls, params: CEMParams) -> CEMState:
        """Return the starting distribution: mean 0, std maxnorm (xyz) and 1 (gripper)."""
        std = torch.ones(params.rollout, 4)
        std[:, :3] = params.maxnorm
        return cls(torch.zeros(params.rollout, 4), std, 0, params)

    def to_value(self) -> dict[str, Any]:
        """Return the state as a node value (tensors, numbers and dicts)."""
        return {
            "mean": self.mean,
            "std": self.std,
            "iteration": self.iteration,
            "params": asdict(self.params),
        }

    @classmethod
    def from_value(cls, value: Mapping[str, Any]) -> CEMState:
        """Rebuild a state from `to_value`'s form."""
        return cls(
            value["mean"], value["std"], int(value["iteration"]), CEMParams(**value["params"])
        )


def sample_actions(state: CEMState) -> torch.Tensor:
    """Return ``[samples, rollout, 7]`` sampled trajectories for the state's iteration."""
    p = state.params
    generator = torch.Generator().manual_seed(p.seed * 1_000_003 + state.iteration)
    steps = []
    for h in range(p.rollout):
        draw = torch.randn(p.samples, 4, generator=generator) * state.std[h] + state.mean[h]
        xyz = draw[:, :3].clamp(-p.maxnorm, p.maxnorm)
        gripper = draw[:, 3:].clamp(-p.gripper_clip, p.gripper_clip)
        steps.append(torch.cat([xyz, torch.zeros(p.samples, 3), gripper], dim=-1))
    return torch.stack(steps, dim=1)


def l1_energy(final: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """Return ``[S]`` energies ``mean |final - goal|`` of ``[S, N, D]`` latents and an ``[N, D]``
    goal."""
    return (final.float() - goal.float().to(final.device)).abs().flatten(1).mean(dim=1)


def refit(state: CEMState, actions: torch.Tensor, energies: torch.Tensor) -> CEMState:
    """Return the next state: mean and std of the ``topk`` best trajectories, with momentum."""
    p = state.params
    best = actions[energies.cpu().topk(p.topk, largest=False).indices]
    sel_mean, sel_std = best.mean(dim=0), best.std(dim=0)  # [rollout, 7]
    picked = [0, 1, 2, 6]  # xyz and gripper
    momentum_mean = torch.tensor([p.momentum_mean] * 3 + [p.momentum_mean_gripper])
    momentum_std = torch.tensor([p.momentum_std] * 3 + [p.momentum_std_gripper])
    mean = sel_mean[:, picked] * (1.0 - momentum_mean) + state.mean * momentum_mean
    std = sel_std[:, picked] * (1.0 - momentum_std) + state.std * momentum_std
    return CEMState(mean, std, state.iteration + 1, p)


def final_plan(state: CEMState) -> torch.Tensor:
    """Return the planned ``[rollout, 7]`` trajectory: the mean, no rotation, small gripper means
    0."""
    gripper = state.mean[:, 3:]
    gripper = torch.where(gripper.abs() < 0.25, torch.zeros_like(gripper), gripper)
    return torch.cat([state.mean[:, :3], torch.zeros(state.mean.shape[0], 3), gripper], dim=-1)


Rollout = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``rollout(latent [S, N, D], pose [S, 7], actions [S, R, 7]) -> final latent [S, N, D]``."""


def plan_with(
    rollout: Rollout,
    context: torch.Tensor,
    pose: torch.Tensor,
    goal: torch.Tensor,
    params: CEMParams,
) -> torch.Tensor:
    """Plan in-process: the CEM iterations around ``rollout``; return the ``[rollout, 7]`` plan."""
    state = CEMState.initial(params)
    for _ in range(params.cem_steps):
        actions = sample_actions(state)
        s = params.samples
        final = rollout(
            context.reshape(1, *context.shape[-2:]).expand(s, -1, -1),
            pose.reshape(1, -1).expand(s, -1),
            actions,
        )
        state = refit(state, actions, l1_energy(final, goal))
    return final_plan(state)


def _cem_sample(x: Mapping[str, Any]) -> dict[str, Any]:
    state = CEMState.from_value(x["cem"])
    actions = sample_actions(state)
    s = state.params.samples
    context, pose = x["context"], x["pose0"]
    return {
        "latent": context.reshape(1, *context.shape[-2:]).expand(s, -1, -1).contiguous(),
        "pose": pose.reshape(1, -1).expand(s, -1).contiguous(),
        "step": 0,
        "job": {"actions": actions, "emit": "none"},
        "actions": actions,
        "cem": x["cem"],
    }


def _cem_update(x: Mapping[str, Any]) -> dict[str, Any]:
    state = CEMState.from_value(x["cem"])
    goal = x["goal"]
    state = refit(state, x["actions"], l1_energy(x["latent"], goal.reshape(goal.shape[-2:])))
    if state.iteration >= state.params.cem_steps:
        return {"action": final_plan(state)[0], "planned": True}
    return {"cem": state.to_value(), "planned": False}


def cem_sample_node(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ``cem_sample`` node (batched): draw this iteration's trajectories for each request."""
    return [_cem_sample(x) for x in batch]


def cem_update_node(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ``cem_update`` node (batched): score, refit; after the last iteration emit the action."""
    return [_cem_update(x) for x in batch]
