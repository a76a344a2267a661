"""Qwen3-MoE feed-forward blocks: top-k routed experts (fused weights), an optional shared expert.

Experts are stored fused, one tensor per projection over all experts (the layout transformers
keeps in memory; checkpoints that store one tensor per expert are stacked on loading)::

    experts.gate_up_proj  [E, 2 * I, H]   gate rows first, then up rows
    experts.down_proj     [E, H, I]

A step's rows are grouped by expert: each expert that some row picked runs one product over
its rows, and the results are summed back weighted by the router's probabilities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.layers import (
    FusedLinear,
    GatedMLP,
    OwnProducts,
    WeightSlice,
    deterministic_products,
)
from mstar.engines.parallel import TensorShard

__all__ = ["Experts", "SparseMoE"]


class Experts(nn.Module, OwnProducts):
    """``E`` SiLU-gated experts in two fused tensors.

    Made deterministic (`OwnProducts`), each expert's two products run through tiled copies
    (`FusedLinear`s) whose rows do not depend on how many rows the expert serves in a step.
    The fused tensors stay as they are (other nodes may load into or read the same weights),
    so the experts' memory doubles in that mode.
    """

    def __init__(self, num_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        self._tiled: list[tuple[FusedLinear, FusedLinear]] | None = None

    def make_products_deterministic(self) -> None:
        """Store each expert's products tiled, deterministic (see the class notes)."""
        if self._tiled is not None or self.gate_up_proj.device.type == "meta":
            return
        with torch.no_grad(), deterministic_products():
            self._tiled = [
                (
                    FusedLinear.shared(self.gate_up_proj[e].detach()),
                    FusedLinear.shared(self.down_proj[e].detach()),
                )
                for e in range(self.num_experts)
            ]

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self._tiled is not None:
            gate_up, down = self._tiled[expert]
            gate, up = gate_up(x).chunk(2, dim=-1)
            return down(F.silu(gate) * up)
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])

    def forward(
        self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor
    ) -> torch.Tensor:
        """Return ``sum_k weight[r, k] * expert[index[r, k]](x[r])`` for each row ``r``."""
        out = torch.zeros_like(x)
        flat = top_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // top_index.shape[1]
        weights = top_weight.reshape(-1).index_select(0, order)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            sel = rows[start : start + count]
            y = self._expert(expert, x.index_select(0, sel))
            out.index_add_(0, sel, y * weights[start : start + count, None].to(y.dtype))
            start += count
        return out


class Router(nn.Module, OwnProducts):
    """Softmax router picking the top ``k`` experts (renormalised when ``norm_topk_prob``).

    Made deterministic (`OwnProducts`), its product is tiled: a row's expert choice then does
    not depend on the rows beside it.
    """

    def __init__(self, num_experts: int, hidden: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self._tiled: FusedLinear | None = None

    def make_products_deterministic(self) -> None:
        """Tile the router's product, deterministic (see the class notes)."""
        if self._tiled is None and self.weight.device.type != "meta":
            with torch.no_grad(), deterministic_products():
                self._tiled = FusedLinear.shared(self.weight.detach())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(indices, weights)`` ``[rows, k]``, the weights in ``x``'s dtype."""
        logits = self._tiled(x) if self._tiled is not None else F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_weight, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        return top_index, top_weight.to(logits.dtype)


class SparseMoE(nn.Module):
    """Routed experts, plus a sigmoid-gated shared expert when ``shared_inner`` > 0 (the talker)."""

    def __init__(
        self,
        hidden: int,
        inner: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        shared_inner: int = 0,
    ) -> None:
        super().__init__()
        self.gate = Router(num_experts, hidden, top_k, norm_topk_prob)
        self.experts = Experts(num_experts, hidden, inner)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_inner:
            self.shared_expert = GatedMLP(hidden, shared_inner)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.shard: TensorShard | None = None

    def shard_slices(self, prefix: str, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's share of the block, by parameter name under ``prefix``.

        Tensor parallel within the experts: every rank holds every expert's columns
        ``[start, stop)`` of its inner width (gate and up rows, down columns), so each rank
        does its share of every routed row whatever the router picks, and the block's output
        is one sum over the ranks. (Splitting by expert instead would leave a rank idle when the
        step's rows pick the other's experts.) The router stays whole on every rank: each
        picks the same experts. The shared expert is split as a dense MLP.
        """
        experts = self.experts
        inner = experts.down_proj.shape[2]
        start, stop = shard.split(inner)
        n = stop - start
        out = {
            f"{prefix}.experts.gate_up_proj": WeightSlice(1, start, stop, 2 * n, halves=True),
            f"{prefix}.experts.down_proj": WeightSlice(2, start, stop, n),
        }
        if self.shared_expert is not None:
            out.update(self.shared_expert.shard_slices(f"{prefix}.shared_expert", shard))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` ``[rows, hidden]``."""
        top_index, top_weight = self.gate(x)
        out = self.experts(x, top_index, top_weight)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # a shard's shared expert is a partial sum too (its gate is whole): summed below
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.unreduced(x)
        # A shard's experts give partial sums: the group adds the ranks' up.
        return out if self.shard is None else self.shard.all_reduce_(out.contiguous())
