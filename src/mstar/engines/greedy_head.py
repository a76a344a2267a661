"""`ScreenedArgmax`: the exact argmax of a float32 head, found through a bfloat16 product.

Greedy decoding needs only each row's best token, not its logits. On a CPU with bfloat16
dot products (AVX-512 BF16) the head's product in bfloat16 runs 2.5-3x faster than in
float32 and reads half the bytes; at decode batch sizes it is the largest kernel of a small
model's step. Its rounding is bounded, so it can choose the candidates and float32 decide:

```
 approx  = bf16(x) @ bf16(W).T                  one fast product, every id
 bound   = what rounding can move any logit       per row, from norms (below)
 keep    = ids with approx >= max(approx) - 2 * bound
 token   = argmax over `keep` of x @ W[keep].T  exact float32, a handful of ids
```

With `xb = bf16(x)`, `dx = x - xb`, `wb_j = bf16(w_j)`, `dw_j = w_j - wb_j`, the exact
logit differs from `xb . wb_j` by `xb . dw_j + dx . wb_j + dx . dw_j`, at most
`|xb| |dw_j| + |dx| (|wb_j| + |dw_j|)` (Cauchy-Schwarz); float32 accumulation adds at most
`n u |xb| |wb_j|` (n inputs, u = 2**-24) on each side, and rounding the product's output to
bfloat16 at most 2**-8 of the logit. The bound is the maximum of those over the vocabulary
(row norms of the weights are taken once), doubled for safety. The true argmax always
survives the screen, so the token equals the float32 argmax (ties: the smallest id);
rows the screen cannot decide (non-finite values, too many candidates) fall back to the
full float32 product.

Made under `deterministic_products`, the screen multiplies each row as it would alone, and
rows it cannot decide fall back one by one (the others keep the exact choice): a row's token
is then the same whatever rows share its step.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.engines.layers import TILED, FusedLinear, can_pack
from mstar.engines.native import cpu_kernels
from mstar.engines.sampler import argmax_rows

__all__ = ["ScreenedArgmax", "can_screen"]

_BF16_UNIT = 2.0**-8  # bfloat16's unit roundoff (8 significant bits)
_FP32_UNIT = 2.0**-24
_SAFETY = 2.0
# More candidates than this per row (a nearly flat row) are not worth gathering.
_MAX_CANDIDATES_PER_ROW = 256


def can_screen(weight: torch.Tensor) -> bool:
    """Whether a float32 head on this device gains from screening (a CPU with bfloat16 products)."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and can_pack(weight)
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class ScreenedArgmax:
    """Each row's argmax of `x @ W.T` in float32, screened by a bfloat16 product (see the module).

    Args:
        weight: The head `[out, in]`, float32; kept by reference (not copied) for the exact
            products of the candidates. A bfloat16 copy (half its size) is packed for the screen.
        full: The head's own deterministic product, for the rows a deterministic screen
            cannot decide (made here, a copy, when not given).
    """

    def __init__(self, weight: torch.Tensor, *, full: FusedLinear | None = None) -> None:
        with torch.no_grad():
            w = weight.detach()
            wb = w.to(torch.bfloat16)
            wb32 = wb.float()
            wb_norm = wb32.norm(dim=1)
            dw_norm = (w - wb32).norm(dim=1)
            del wb32
            self.weight = w
            self._weight_np = w.numpy()
            self._screen = FusedLinear.shared(wb)  # packed where that is faster (timed)
            self.deterministic = self._screen.deterministic
            # the float32 fallback of a row the screen cannot decide, deterministic
            if self.deterministic and (full is None or not full.deterministic):
                full = FusedLinear.shared(w)
            self._full = full if self.deterministic else None
            self._dw_max = float(dw_norm.max())
            self._sum_max = float((wb_norm + dw_norm).max())
            self._accum = _SAFETY * 2 * w.shape[1] * _FP32_UNIT * float(wb_norm.max())

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """Return `[rows]` int64 token ids for `x` `[rows, in]` float32, or None if undecided.

        None means the screen could not decide some row (non-finite values, a nearly flat
        row): the caller computes the logits in full. A deterministic screen never returns
        None: such rows take the argmax of their own full product.
        """
        with torch.no_grad():
            tokens = self._tokens(x)
            if tokens is not None or self._full is None:
                return tokens
            rows = [self._tokens(x[i : i + 1]) for i in range(x.shape[0])]
            return torch.cat(
                [
                    t if t is not None else argmax_rows(self._full(x[i : i + 1]))
                    for i, t in enumerate(rows)
                ]
            )

    def _tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        kernels = cpu_kernels()
        screen = self._screen
        if (
            kernels is not None
            and screen.layout == TILED
            and screen.out_features == 16 * screen.weight.shape[0]  # no padded tile
            and x.dim() == 2
            and x.stride(-1) == 1
            and self.weight.is_contiguous()
        ):  # the screen's product and the decision in one native call
            tokens = kernels.screened_tokens(
                x,
                screen.weight,
                self.weight,
                self._dw_max,
                self._accum,
                self._sum_max,
                _SAFETY,
                _BF16_UNIT,
                _MAX_CANDIDATES_PER_ROW,
                self.deterministic,
            )
            return tokens if tokens.numel() else None
        xb = x.to(torch.bfloat16)
        approx = screen(xb).contiguous()  # a padded tile's outputs come narrowed
        if (
            kernels is not None
            and approx.is_contiguous()
            and x.stride(-1) == 1
            and self.weight.is_contiguous()
        ):
            # The same decision in two passes over the screen (no float32 copy of it).
            tokens = kernels.screened_argmax(
                approx,
                x,
                self.weight,
                self._dw_max,
                self._accum,
                self._sum_max,
                _SAFETY,
                _BF16_UNIT,
                _MAX_CANDIDATES_PER_ROW,
            )
            return tokens if tokens.numel() else None
        # Everything after the product runs in numpy: its compare, max and flatnonzero were
        # 4-7x faster than torch's over a [16, 32000] screen (torch's nonzero alone took
        # 0.3 ms), and on rows of a few hundred values each numpy call costs a microsecond.
        scores = approx.float().numpy()
        top = scores.max(axis=1)
        if not np.isfinite(top).all():
            return None
        xs = x.numpy()
        xbs = xb.float().numpy()
        nb = np.sqrt(np.einsum("ij,ij->i", xbs, xbs))
        dx = xs - xbs
        nd = np.sqrt(np.einsum("ij,ij->i", dx, dx))
        base = nb * (self._dw_max + self._accum) + nd * self._sum_max
        bound = _SAFETY * (base + _BF16_UNIT * (np.abs(top) + 2 * base))
        flat = np.flatnonzero(scores >= (top - 2 * bound)[:, None])
        num_rows, vocab = scores.shape
        rows, cols = np.divmod(flat, vocab)
        counts = np.bincount(rows, minlength=num_rows)
        if int(counts.min()) == 0 or int(counts.max()) > _MAX_CANDIDATES_PER_ROW:
            return None
        if len(flat) == num_rows:  # one candidate per row: it is the argmax
            return torch.from_numpy(cols)
        # Candidates come row by row, ids ascending: the first best of each row is its token.
        exact = np.einsum("ij,ij->i", xs[rows], self._weight_np[cols])
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        best = np.maximum.reduceat(exact, starts)
        winners = np.flatnonzero(exact == np.repeat(best, counts))
        _, first = np.unique(rows[winners], return_index=True)
        return torch.from_numpy(cols[winners[first]])
