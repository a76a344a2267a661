"""BAGEL's rectified-flow sampling: the shifted schedule, which CFG branches a step needs, the
guidance.

```
t    = linspace(1, 0, num_timesteps);  t = s*t / (1 + (s-1)*t)      (s = timestep_shift)
step k in 0 .. num_timesteps-2:  x <- x - v(x, t[k]) * (t[k] - t[k+1])
```

A step inside ``cfg_interval`` (``lo < t <= hi``) runs the text-free branch when
``cfg_text_scale > 1`` and then the image-free branch too when ``cfg_img_scale > 1``; outside it
runs the conditional branch alone. (Upstream computes the image-free branch whenever its scale
is above 1 but uses it only with text guidance: skipping it otherwise changes nothing.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

import torch

from mstar.zoo.bagel.config import GenDefaults

__all__ = ["BRANCHES", "CFG_IMG", "CFG_TEXT", "COND", "FlowSpec", "guidance"]

COND, CFG_TEXT, CFG_IMG = "cond", "cfg_text", "cfg_img"
BRANCHES = (COND, CFG_TEXT, CFG_IMG)


@dataclass(frozen=True, slots=True)
class FlowSpec:
    """One image's sampling: its latent grid and the guidance settings (validated by the model)."""

    has_wire_form: ClassVar[Literal[True]] = True

    height: int  # latent tokens
    width: int
    num_timesteps: int = 50
    timestep_shift: float = 3.0
    cfg_text_scale: float = 4.0
    cfg_img_scale: float = 1.0
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_type: str = "global"
    cfg_renorm_min: float = 0.0
    # Run every branch on every step (what skipping saves is then spent; the result is the same).
    run_all_branches: bool = False

    @classmethod
    def of(cls, height: int, width: int, defaults: GenDefaults, **overrides: object) -> FlowSpec:
        """Make a spec from a task's defaults and the request's overrides."""
        fields = {
            "num_timesteps": defaults.num_timesteps,
            "timestep_shift": defaults.timestep_shift,
            "cfg_text_scale": defaults.cfg_text_scale,
            "cfg_img_scale": defaults.cfg_img_scale,
            "cfg_interval": tuple(defaults.cfg_interval),
            "cfg_renorm_type": defaults.cfg_renorm_type,
            "cfg_renorm_min": defaults.cfg_renorm_min,
        }
        fields.update(overrides)
        return cls(height, width, **fields)  # type: ignore[arg-type]

    def wire_form(self) -> dict[str, Any]:
        """Return the spec as plain data."""
        return asdict(self)

    @classmethod
    def of_value(cls, value: FlowSpec | Mapping[str, Any]) -> FlowSpec:
        """Read a spec back (or pass one through)."""
        if isinstance(value, FlowSpec):
            return value
        fields = dict(value)
        fields["cfg_interval"] = tuple(fields["cfg_interval"])
        return cls(**fields)

    @property
    def num_steps(self) -> int:
        """Euler steps (one fewer than timesteps)."""
        return self.num_timesteps - 1

    @property
    def num_tokens(self) -> int:
        """Latent tokens of the image."""
        return self.height * self.width

    def timesteps(self) -> torch.Tensor:
        """Return the shifted schedule ``[num_timesteps]`` (float32, from 1 to 0)."""
        t = torch.linspace(1, 0, self.num_timesteps)
        s = self.timestep_shift
        return s * t / (1 + (s - 1) * t)

    def step(self, k: int) -> tuple[float, torch.Tensor]:
        """Return step ``k``'s time (as a float32 value) and its ``dt`` (a float32 scalar
        tensor)."""
        t = self.timesteps()
        return float(t[k]), t[k] - t[k + 1]

    def branches(self, k: int) -> tuple[str, ...]:
        """Return the branches step ``k`` runs (the conditional one always first)."""
        t = self.timesteps()[k]
        lo, hi = self.cfg_interval
        if not (bool(t > lo) and bool(t <= hi)) or self.cfg_text_scale <= 1.0:
            return (COND,)
        return (COND, CFG_TEXT, CFG_IMG) if self.cfg_img_scale > 1.0 else (COND, CFG_TEXT)

    def branches_run(self, k: int) -> tuple[str, ...]:
        """Return the branches step ``k`` queries: those it needs, or all of them
        (``run_all_branches``)."""
        return BRANCHES if self.run_all_branches else self.branches(k)

    def num_passes(self) -> int:
        """Count the LLM passes of the whole loop (one per branch per step)."""
        return sum(len(self.branches_run(k)) for k in range(self.num_steps))


def guidance(
    spec: FlowSpec, v: torch.Tensor, v_text: torch.Tensor | None, v_img: torch.Tensor | None
) -> torch.Tensor:
    """Combine one image's branch velocities ``[n, p*p*z]`` as upstream's ``_forward_flow`` does.

    ``v_text`` (and ``v_img``) are None on steps that do not run those branches.
    """
    if v_text is None:
        return v
    s_text, s_img = spec.cfg_text_scale, spec.cfg_img_scale
    if spec.cfg_renorm_type == "text_channel":
        guided = v_text + s_text * (v - v_text)
        scale = (v.norm(dim=-1, keepdim=True) / (guided.norm(dim=-1, keepdim=True) + 1e-8)).clamp(
            min=spec.cfg_renorm_min, max=1.0
        )
        guided = guided * scale
        return guided if v_img is None else v_img + s_img * (guided - v_img)
    guided = v_text + s_text * (v - v_text)
    if v_img is not None:
        guided = v_img + s_img * (guided - v_img)
    if spec.cfg_renorm_type == "global":
        norm_v, norm_g = v.norm(), guided.norm()
    else:  # "channel"
        norm_v, norm_g = v.norm(dim=-1, keepdim=True), guided.norm(dim=-1, keepdim=True)
    scale = (norm_v / (norm_g + 1e-8)).clamp(min=spec.cfg_renorm_min, max=1.0)
    return guided * scale
