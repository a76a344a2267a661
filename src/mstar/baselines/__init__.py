"""Baselines: the slow, obvious implementations mstar's fast paths are checked and measured against.

Each recomputes what a zoo model's walks compute on the paged cache, the way its upstream
does it, with nothing cached, paged, forked or batched: the tests assert the served outputs
equal them, and the benchmarks in ``scripts/`` time them side by side. Nothing here serves.

- `mstar.baselines.bagel`: BAGEL with a dense cache per CFG context (`reference_generate`,
  `reference_understand`); `mstar.baselines.bagel_walks`: BAGEL's graph nodes on those dense
  caches, for the reference interpreter (`mstar.graph.run_reference`).
- `mstar.baselines.pi05`: pi0.5 recomputing prefix and suffix at every flow step.
- `mstar.baselines.qwen3_omni`: Qwen3-Omni one component after another (the thinker to its
  end, then the talker, then Code2Wav), sampling as transformers' ``generate`` does.
- `mstar.baselines.vjepa2`: V-JEPA 2-AC's upstream rollout, every frame re-run at every step.
"""

from mstar.baselines.bagel import reference_generate, reference_understand
from mstar.baselines.pi05 import naive_sample_actions, naive_velocity
from mstar.baselines.vjepa2 import native_rollout, native_step

__all__ = [
    "naive_sample_actions",
    "naive_velocity",
    "native_rollout",
    "native_step",
    "reference_generate",
    "reference_understand",
]
