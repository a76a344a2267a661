"""Linear layers stored in whichever weight layout multiplies fastest, plus RMSNorm and rotary.

Zoo models share these. On CPU, how fast `x @ W.T` runs depends on how `W` is laid out, and
which layout wins depends on the weight's shape and on how many input rows there are. A
32000-wide head ran 1.4-2.6x faster `[in, out]` than `[out, in]` at decode batch sizes.
oneDNN's blocked ("packed") layout was 1.7x faster again at 16 rows (2.5x for a 49152-wide
head), and about 2.3x faster than `F.linear` for V-JEPA 2 block products at 64 or more rows
(one thread). At one row, though, packing a small matrix made it 2-5x slower. The winner
cannot be predicted reliably, so `choose_layout` times every layout once for each weight
shape and row counts it is given, and caches the answer for the rest of the process. On CUDA
the checkpoint's `[out, in]` layout is kept.

```
layout   weight storage          product
OUT_IN   [out, in]  (as loaded)  F.linear
IN_OUT   [in, out]               torch.mm / torch.addmm
PACKED   oneDNN blocked, opaque  torch.ops.mkldnn._linear_pointwise  (CPU, fp32 / bf16)
TILED    tiles of 16 outputs     mstar's native `linear` kernel       (CPU, fp32 / bf16)
```

`TILED` is mstar's own product for the few rows of a decode step (`mstar.engines.native`):
one pass over the weights serves up to 16 rows. On the tiny decode shapes it ran 1.3-4x
faster than oneDNN's packed product (whose call alone costs about 20 us); on large weights at
16 float32 rows oneDNN stays ahead, and the timing keeps it there. bfloat16 tiles are AMX's
own operand layout: on a CPU with AMX, 4 rows or more multiply as tile products (a
1024 x 256 weight at 16 rows: 20 us, where AVX-512 BF16 took 100 and oneDNN 52). On a CPU
without bfloat16 arithmetic (AVX2), where oneDNN cannot pack bfloat16 and torch's bfloat16
products crawl, the tiles widen each weight on load: a 2048 x 256 bfloat16 weight at 16
rows took 0.26 ms, `F.linear` 2.1 ms.

Deterministic serving (`deterministic_products`): while a model loads under it, every CPU
weight takes `TILED` whatever the timing says (outputs padded to a whole tile), and bfloat16
tiles multiply on one instruction path at every row count. A row's sums then run in one
order, whatever the number of rows or threads in the product: the same row gives the same
bits alone or in any batch. A weight the tiles cannot take (another dtype or device, or odd
bfloat16 inputs) multiplies one row at a time.

`FusedLinear` holds one or more linears that read the same input as one product in the
chosen layout. `FusableLinear` is an `nn.Linear` that sends its own product through a
`FusedLinear` once fused, for models that call their linears directly. Both are applied
after a checkpoint is loaded, and in the dense layouts the parameter names keep working.

On a CPU, `RMSNorm` (and `RMSNorm.residual`, the residual add fused with it), rotary
(`apply_rotary_signed`) and SwiGLU's ``silu(gate) * up`` each run as one native kernel
(`mstar.engines.native`) instead of several torch ops, rounding wherever the torch ops
round (bfloat16 results are bit-equal); a decode step issues a few dozen ops fewer. Without
the kernels, under autograd or inside `torch.compile`, the torch ops run.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.native import cpu_kernels
from mstar.engines.parallel import TensorParallelError, TensorShard
from mstar.engines.sampler import argmax_rows

__all__ = [
    "DECODE_ROWS",
    "IN_OUT",
    "OUT_IN",
    "PACKED",
    "TILED",
    "FusableLinear",
    "FusedLinear",
    "GatedMLP",
    "OwnProducts",
    "RMSNorm",
    "apply_rotary",
    "apply_rotary_signed",
    "can_pack",
    "choose_layout",
    "deterministic_products",
    "make_deterministic",
    "make_linears_deterministic",
    "products_are_deterministic",
    "route_experts",
    "signed_sin",
    "WeightSlice",
    "attention_slices",
    "column_parallel",
    "gather_vocab_parallel",
    "head_counts",
    "row_parallel",
    "shard_module_",
    "slice_weight",
    "vocab_parallel_embedding",
]

# Weight layouts for `x @ W.T`.
OUT_IN = "out_in"  # `[out, in]` through `F.linear` (the checkpoint's own layout)
IN_OUT = "in_out"  # `[in, out]` through `torch.mm`
PACKED = "packed"  # oneDNN's blocked layout, through its linear kernel (CPU)
TILED = "tiled"  # tiles of 16 outputs, through mstar's native linear kernel (CPU)

DECODE_ROWS: tuple[int, ...] = (1, 16)
"""Row counts `choose_layout` times by default: one sequence, and a decode batch of 16."""

# The cache key is (in, out, dtype, timed row counts).
_LAYOUT_CHOICES: dict[tuple[int, int, torch.dtype, tuple[int, ...]], str] = {}
# oneDNN packs for an expected row count. 16 (a decode batch) measured as fast as any larger
# hint, even for products of thousands of rows.
_PACK_ROWS = 16


_DETERMINISTIC = contextvars.ContextVar("mstar_deterministic_products", default=False)


@contextlib.contextmanager
def deterministic_products(enabled: bool = True) -> Iterator[None]:
    """Within it, linears fused (`FusedLinear.of`, `.shared`, `choose_layout`) compute each row
    the same way whatever else shares the product (see the module's notes).

    Models load their weights under it when an engine serves deterministically
    (`EngineConfig.deterministic`); it is a context variable, so other threads and
    tasks are not affected.
    """
    token = _DETERMINISTIC.set(enabled)
    try:
        yield
    finally:
        _DETERMINISTIC.reset(token)


def products_are_deterministic() -> bool:
    """Whether linears fused now are deterministic (inside `deterministic_products`)."""
    return _DETERMINISTIC.get()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """Return `weight` `[out, in]` reordered into oneDNN's blocked layout for linear."""
    return cast(torch.Tensor, torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS))


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return cast(torch.Tensor, torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""))


def _tiles(weight: torch.Tensor, *, pad: bool = False) -> ModuleType | None:
    """The native kernels, where they can tile this `[out, in]` weight (see `TILED`); with
    `pad`, outputs that are not a whole number of tiles are padded with zero weights."""
    out_features, in_features = weight.shape
    if (
        weight.device.type != "cpu"
        or (out_features % 16 and not pad)
        or weight.dtype not in (torch.float32, torch.bfloat16)
    ):
        return None
    kernels = cpu_kernels()
    if kernels is None or (weight.dtype == torch.bfloat16 and in_features % 2):
        return None
    return kernels


def _stored(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """Return `weight` `[out, in]` stored for `layout` (a copy, except a contiguous `OUT_IN`)."""
    if layout == PACKED:
        return _pack(weight)
    if layout == TILED:
        kernels = cast(ModuleType, _tiles(weight, pad=True))
        if weight.shape[0] % 16:
            weight = F.pad(weight, (0, 0, 0, -weight.shape[0] % 16))
        return cast(torch.Tensor, kernels.pack_linear(weight))
    return weight.t().contiguous() if layout == IN_OUT else weight.contiguous()


_PACKS: dict[torch.dtype, bool] = {}  # whether oneDNN packs each dtype on this CPU


def can_pack(weight: torch.Tensor) -> bool:
    """Return whether oneDNN's packed layout serves this weight's device and dtype here
    (bfloat16 packing needs AVX-512 or AVX-NE-CONVERT; tried once per dtype)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    if weight.dtype not in _PACKS:
        try:
            _pack(torch.zeros(16, 16, dtype=weight.dtype))
            _PACKS[weight.dtype] = True
        except RuntimeError:  # this CPU cannot pack the dtype
            _PACKS[weight.dtype] = False
    return _PACKS[weight.dtype]


# A model's step passes through more weights than the core's cache holds, so by the time a
# weight is used again it has been evicted: each timed product starts from caches refilled
# with other data, as in a step. Warm timings chose `[in, out]` for the tiny model's float32
# products, which then ran 15 % slower in place than the tiles.
_EVICT_BYTES = 8 << 20
_evict_buffer: torch.Tensor | None = None


_HOPELESS = 4.0
"""A layout whose product takes this many times the fastest layout's is not timed further."""


def _evict_caches() -> None:
    global _evict_buffer
    if _evict_buffer is None:
        _evict_buffer = torch.ones(_EVICT_BYTES // 4)
    _evict_buffer.sum()


def choose_layout(weight: torch.Tensor, rows: tuple[int, ...] = DECODE_ROWS) -> str:
    """Return the layout in which `x @ W.T` runs fastest for this weight's shape.

    Each distinct shape, dtype and `rows` is timed once per process. Every layout runs at
    each row count (the best of five products, each from evicted caches), and the layout
    with the smallest total wins. Off the CPU, the result is always `OUT_IN`.

    Args:
        weight: `[out, in]`.
        rows: The input row counts the layer mostly sees, for example decode batch sizes or
            a ViT's tokens per image. Packing pays off only once there are enough rows.
    """
    if products_are_deterministic():
        return TILED if _tiles(weight, pad=True) is not None else OUT_IN
    if weight.device.type != "cpu":
        return OUT_IN
    out_features, in_features = weight.shape
    key = (in_features, out_features, weight.dtype, rows)
    if key in _LAYOUT_CHOICES:
        return _LAYOUT_CHOICES[key]
    candidates = {layout: FusedLinear.in_layout(weight, layout) for layout in (OUT_IN, IN_OUT)}
    if can_pack(weight):
        try:
            packed = FusedLinear.in_layout(weight, PACKED)
            packed(torch.zeros(1, in_features, dtype=weight.dtype))
            candidates[PACKED] = packed
        except RuntimeError:
            pass  # a build without oneDNN's linear kernels
    if _tiles(weight) is not None:
        candidates[TILED] = FusedLinear.in_layout(weight, TILED)
    # The native and oneDNN layouts first: a layout whose first timed product (after a warm-up)
    # takes over _HOPELESS times the fastest so far is dropped untimed further. (torch's
    # bfloat16 product without AVX-512 is a scalar loop: five products of a 49,152-row tied
    # head took SmolLM2's load 15 s on AVX2.)
    order = [layout for layout in (TILED, PACKED, OUT_IN, IN_OUT) if layout in candidates]
    totals = dict.fromkeys(order, 0.0)
    with torch.no_grad():
        for num_rows in rows:
            x = torch.randn(num_rows, in_features, dtype=weight.dtype)
            fastest = float("inf")
            for layout in list(totals):
                fused = candidates[layout]
                fused(x)
                best = float("inf")
                for _ in range(5):
                    _evict_caches()
                    start = time.perf_counter()
                    fused(x)
                    best = min(best, time.perf_counter() - start)
                    if best > _HOPELESS * fastest:
                        del totals[layout]
                        break
                else:
                    fastest = min(fastest, best)
                    totals[layout] += best
    choice = min(totals, key=lambda layout: totals[layout])
    _LAYOUT_CHOICES[key] = choice
    return choice


class FusedLinear:
    """Several linear layers on the same input as one matrix product.

    The weights are concatenated along the output axis and stored in whichever layout
    multiplies fastest on this device (see `choose_layout`). For the dense layouts the
    original `nn.Linear` weights are re-pointed at views of the fused storage, so
    checkpoint names and `state_dict()` keep working with no memory duplicated. oneDNN's
    packed layout cannot be viewed that way; there the `nn.Linear` modules give up their
    weight (it becomes `None`) rather than keep a second copy, so a model fused for
    inference is for inference only. The fused tensors are plain attributes, which
    `Module.to()` does not move: fuse after the model is on its device and in its dtype.

    One fused under `deterministic_products` is `deterministic`: each row's outputs do not
    depend on the other rows of the product.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        layout: str,
        out_features: int | None = None,
    ) -> None:
        self.weight = weight  # [in, out] for IN_OUT; [out, in] (dense or packed) otherwise
        self.layout = layout
        self.deterministic = products_are_deterministic()
        self.out_features = weight.shape[1] if layout == IN_OUT else weight.shape[0]
        if layout == TILED:  # [out / 16, ...] tiles, the last one padded past `out_features`
            self.out_features = out_features or 16 * weight.shape[0]
            self._kernels = cast(ModuleType, cpu_kernels())
            if bias is not None and bias.shape[0] != 16 * weight.shape[0]:
                bias = F.pad(bias, (0, 16 * weight.shape[0] - bias.shape[0]))
        self.bias = bias

    @classmethod
    def of(
        cls, linears: Sequence[nn.Linear], *, rows: tuple[int, ...] = DECODE_ROWS
    ) -> FusedLinear:
        """Fuse `linears` (same input size) and re-point their parameters at the result.

        Args:
            linears: The layers, in the order their outputs are concatenated.
            rows: The input row counts to choose the layout for (see `choose_layout`).
        """
        with torch.no_grad():
            weights = torch.cat([lin.weight for lin in linears], dim=0)
            layout = choose_layout(weights, rows)
            bias = (
                torch.cat([lin.bias for lin in linears if lin.bias is not None])
                if linears[0].bias is not None
                else None
            )
            weight = _stored(weights, layout)
            if layout in (PACKED, TILED):
                for lin in linears:
                    lin.register_parameter("weight", None)
                    if bias is not None:
                        lin.register_parameter("bias", None)
                return cls(weight, bias, layout=layout, out_features=weights.shape[0])
            start = 0
            for lin in linears:
                size = lin.out_features
                view = (
                    weight[:, start : start + size].t()
                    if layout == IN_OUT
                    else weight[start : start + size]
                )
                lin.weight = nn.Parameter(view, requires_grad=False)
                if bias is not None:
                    lin.bias = nn.Parameter(bias[start : start + size], requires_grad=False)
                start += size
        return cls(weight, bias, layout=layout)

    @classmethod
    def in_layout(cls, weight: torch.Tensor, layout: str) -> FusedLinear:
        """Return the product by `weight` `[out, in]` (no bias) stored in `layout`, whatever
        the timing would choose (`choose_layout` times each; benchmarks compare them)."""
        return cls(_stored(weight, layout), None, layout=layout, out_features=weight.shape[0])

    @classmethod
    def shared(cls, weight: torch.Tensor, *, rows: tuple[int, ...] = DECODE_ROWS) -> FusedLinear:
        """Use an `[out, in]` weight owned elsewhere (a tied head), copied only if faster."""
        with torch.no_grad():
            layout = choose_layout(weight, rows)
            if layout != OUT_IN:
                stored = _stored(weight.detach(), layout)
                return cls(stored, None, layout=layout, out_features=weight.shape[0])
        return cls(weight.detach(), None, layout=OUT_IN)

    @classmethod
    def _deterministic_copy(cls, linear: nn.Linear) -> FusedLinear:
        """A deterministic product of `linear`'s weight and bias, leaving them in place."""
        with torch.no_grad():
            weight = linear.weight.detach()
            layout = choose_layout(weight)
            bias = None if linear.bias is None else linear.bias.detach()
            return cls(_stored(weight, layout), bias, layout=layout, out_features=weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Return `x @ W.T + b` for `x` `[..., in]`."""
        if self.layout == OUT_IN and not self.deterministic:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:
            # torch.mm takes only matrices, and oneDNN's kernel was timed on them. Fold the
            # leading dimensions ([B, M, in] -> [B * M, in]), then restore them.
            out = self(x.reshape(-1, x.shape[-1]))
            return out.view(*x.shape[:-1], self.out_features)
        if self.layout == PACKED:
            return _packed_linear(x, self.weight, self.bias)
        if self.layout == TILED:
            y = cast(
                torch.Tensor,
                self._kernels.linear(
                    x if x.stride(-1) == 1 else x.contiguous(),
                    self.weight,
                    self.bias,
                    self.deterministic,
                ),
            )
            # A padded last tile: its extra outputs dropped (a copy, so views of it work)
            return y if y.shape[1] == self.out_features else y[:, : self.out_features].contiguous()
        if self.layout == OUT_IN:  # deterministic: one row at a time, the same product each
            rows = [F.linear(row, self.weight, self.bias) for row in x.split(1)]
            return torch.cat(rows) if rows else F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight)
        return torch.mm(x, self.weight)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """Return `silu(gate) * up` for this `[gate; up]` product of `x` `[rows, in]` in one
        native pass, or None where the kernel does not take it (not tiled, a bias, a padded
        tile, deterministic serving, halves not of whole tiles).

        The product's `[rows, 2 x inner]` outputs are never written whole: each block of them
        goes through silu_mul from a small buffer. The values are the product's, then
        silu_mul's, rounding for rounding.
        """
        if (
            self.layout != TILED
            or self.bias is not None
            or self.deterministic
            or self.out_features != 16 * self.weight.shape[0]
            or self.out_features % 32 != 0
            or x.dim() != 2
            or x.stride(-1) != 1
        ):
            return None
        return cast(torch.Tensor, self._kernels.linear_silu_mul(x, self.weight))

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Return each row's first maximum of `self(x)` for `x` `[rows, in]` (a greedy head's
        choice).

        Tiles multiply and choose in one native call: the calling thread takes the GIL back
        once, not between the product and the choice.
        """
        if (
            self.layout == TILED
            and not self.deterministic
            and self.out_features == 16 * self.weight.shape[0]
            and x.dim() == 2
            and x.stride(-1) == 1
        ):
            return cast(torch.Tensor, self._kernels.linear_argmax(x, self.weight, self.bias))
        return argmax_rows(self(x))

    def native_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
        """Return `(weight, bias, transposed)` as native code multiplies them, or None (oneDNN's
        packed layout, which only its own kernel reads; padded tiles; a deterministic product
        that is not tiled). `transposed`: the weight is `[in, out]`."""
        if (
            self.layout == PACKED
            or (self.layout == TILED and self.out_features != 16 * self.weight.shape[0])
            or (self.deterministic and self.layout != TILED)
        ):
            return None
        return self.weight, self.bias, self.layout == IN_OUT


class OwnProducts:
    """A module whose products are not `nn.Linear`s (fused expert tensors, a router's weight):
    `make_linears_deterministic` asks it to make them deterministic itself."""

    def make_products_deterministic(self) -> None:
        """Compute every product as `deterministic_products` would (see the module notes)."""
        raise NotImplementedError


def make_linears_deterministic(module: nn.Module) -> int:
    """Send every `nn.Linear` in `module` that still multiplies through torch (not fused into a
    `FusedLinear`) through a deterministic product (see `deterministic_products`); return how
    many.

    A deterministic engine applies it to each KV-cache node's modules after they load, so the
    small projections a model calls directly (a time embedding, an action head) compute each
    row as they would alone. The linears keep their weights (the product works on a copy).
    Modules declaring `OwnProducts` (MoE experts, routers) make theirs deterministic
    themselves, and count once.
    """
    count = 0
    with deterministic_products():
        for sub in module.modules():
            if isinstance(sub, OwnProducts):
                sub.make_products_deterministic()
                count += 1
                continue
            if (
                not isinstance(sub, nn.Linear)
                or sub.weight is None
                or sub.weight.device.type == "meta"  # another node's part, not loaded here
                or "forward" in vars(sub)
            ):
                continue
            if isinstance(sub, FusableLinear):
                if sub.fused is None or not sub.fused.deterministic:
                    sub.fused = FusedLinear._deterministic_copy(sub)
            else:
                sub.forward = FusedLinear._deterministic_copy(sub).__call__  # type: ignore[method-assign, assignment]
            count += 1
    return count


def make_deterministic(model: object) -> None:
    """Make a KV-cache node's network compute each row as it would alone: one declaring
    `OwnProducts` does it itself, a torch module has its linears routed
    (`make_linears_deterministic`)."""
    if isinstance(model, OwnProducts):
        model.make_products_deterministic()
    elif isinstance(model, nn.Module):
        make_linears_deterministic(model)


class FusableLinear(nn.Linear):
    """An `nn.Linear` whose product moves into the fastest layout once fused for inference.

    A checkpoint loads into `weight` and `bias` just as it would for any `nn.Linear`.
    `fuse_for_inference` then hands them to a `FusedLinear` of this single layer, and calling
    the module runs that fused product. (In the packed layout `weight` becomes `None`; see
    `FusedLinear`.) Use this class where a model calls a linear directly, such as
    `attn.proj(x)`. Linears that read the same input fuse into one product through
    `FusedLinear.of`.
    """

    fused: FusedLinear | None = None

    def fuse_for_inference(self, rows: tuple[int, ...] = DECODE_ROWS) -> None:
        """Store the weight in the layout fastest at `rows` input rows; fusing again does nothing.

        Call this after the weights are loaded and the module is on its device and in its
        dtype.
        """
        if self.fused is None:
            self.fused = FusedLinear.of([self], rows=rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return `x @ W.T + b` for `x` `[..., in]`."""
        if self.fused is None:
            return super().forward(x)
        return self.fused(x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU (Llama, Qwen)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GeGLU (Gemma)
}


# -- tensor parallelism: which part of each weight a rank keeps (see mstar.engines.parallel) ----


@dataclass(frozen=True, slots=True)
class WeightSlice:
    """A rank's part of a weight: ``[start, stop)`` along ``dim``, zero-padded to ``size`` there.

    ``zero``: the rank holds zeros of the weight's shape (a row-parallel bias off rank 0).
    ``halves``: ``dim`` holds two equal halves (a fused gate/up: gate rows, then up rows), each
    sliced ``[start, stop)``; the part is the two slices, one after the other (``size`` in all).
    """

    dim: int
    start: int
    stop: int
    size: int
    zero: bool = False
    halves: bool = False

    def pieces(self, full: int) -> list[tuple[int, int, int]]:
        """Return ``(source start, length, destination start)`` of each piece along ``dim`` of a
        weight ``full`` long there."""
        n = self.stop - self.start
        if not self.halves:
            return [(self.start, n, 0)]
        half = full // 2
        return [(self.start, n, 0), (half + self.start, n, n)]


def slice_weight(full: torch.Tensor, part: WeightSlice) -> torch.Tensor:
    """Return ``part`` of ``full`` as a tensor of its own (meta tensors stay meta)."""
    if part.zero:
        return torch.zeros_like(full)
    shape = list(full.shape)
    shape[part.dim] = part.size
    out = torch.zeros(shape, dtype=full.dtype, device=full.device)
    if full.device.type != "meta":
        for src, n, dst in part.pieces(full.shape[part.dim]):
            out.narrow(part.dim, dst, n).copy_(full.narrow(part.dim, src, n))
    return out


def attention_slices(
    prefix: str,
    projections: tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    shard: TensorShard,
) -> dict[str, WeightSlice]:
    """This rank's heads of grouped-query attention (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj`` under ``prefix``): q/k/v column-parallel, o row-parallel.

    The KV heads are split over the ranks, each with the query heads that read it (as evenly
    as they go: SmolLM2-135M's 3 KV heads of 3 query heads each over two ranks are 6 + 3 query
    heads). With fewer KV heads than ranks, the query heads are split evenly and each rank
    keeps the KV head its query heads read (replicated).

    Raises:
        TensorParallelError: Fewer KV heads than ranks, and the ranks are not a multiple of
            them or do not divide the query heads.
    """
    d, kv, world = head_dim, num_kv_heads, shard.world
    per_kv = num_heads // kv
    if kv >= world:
        k0, k1 = shard.split(kv)
        q0, q1 = k0 * per_kv, k1 * per_kv
    elif world % kv == 0 and num_heads % world == 0:
        q0, q1 = shard.split(num_heads)
        k0 = q0 // per_kv
        k1 = k0 + 1
    else:
        raise TensorParallelError(
            f"{num_heads} query heads over {kv} KV heads cannot be split over {world} "
            "tensor-parallel ranks (fewer KV heads than ranks: the ranks must be a multiple "
            "of the KV heads, and divide the query heads)"
        )
    q, k, v, o = projections
    return {
        **column_parallel(f"{prefix}.q_proj", q, q0 * d, q1 * d),
        **column_parallel(f"{prefix}.k_proj", k, k0 * d, k1 * d),
        **column_parallel(f"{prefix}.v_proj", v, k0 * d, k1 * d),
        **row_parallel(f"{prefix}.o_proj", o, q0 * d, q1 * d, shard),
    }


def column_parallel(
    prefix: str, linear: nn.Linear, start: int, stop: int
) -> dict[str, WeightSlice]:
    """Column-parallel slices of ``linear`` (output features ``[start, stop)``), by parameter
    name under ``prefix``: the rank computes its outputs, no communication."""
    out = {f"{prefix}.weight": WeightSlice(0, start, stop, stop - start)}
    if linear.bias is not None:
        out[f"{prefix}.bias"] = WeightSlice(0, start, stop, stop - start)
    return out


def row_parallel(
    prefix: str, linear: nn.Linear, start: int, stop: int, shard: TensorShard
) -> dict[str, WeightSlice]:
    """Row-parallel slices of ``linear`` (input features ``[start, stop)``): the rank's output is
    a partial sum the group adds up (`TensorShard.all_reduce_`); the bias stays on rank 0."""
    out = {f"{prefix}.weight": WeightSlice(1, start, stop, stop - start)}
    if linear.bias is not None:
        size = linear.bias.shape[0]
        out[f"{prefix}.bias"] = WeightSlice(0, 0, size, size, zero=shard.rank != 0)
    return out


def shard_module_(module: nn.Module, slices: dict[str, WeightSlice]) -> None:
    """Replace the named parameters of ``module`` by their slices (before `fuse`), and set the
    feature counts of the `nn.Linear` / `nn.Embedding` modules that hold them."""
    params = dict(module.named_parameters())
    for name, part in slices.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        full = params[name]
        setattr(owner, attr, nn.Parameter(slice_weight(full.data, part), requires_grad=False))
        if isinstance(owner, nn.Linear) and attr == "weight":
            owner.out_features, owner.in_features = owner.weight.shape
        elif isinstance(owner, nn.Embedding):
            owner.num_embeddings = owner.weight.shape[0]


def head_counts(q_proj: nn.Linear, k_proj: nn.Linear, head_dim: int) -> tuple[int, int]:
    """Return the query and KV heads ``(num_heads, num_kv_heads)`` that ``q_proj`` and ``k_proj``
    project to: after `shard_module_`, a rank's own."""
    return q_proj.out_features // head_dim, k_proj.out_features // head_dim


def vocab_parallel_embedding(
    embed: nn.Embedding, ids: torch.Tensor, vocab_start: int, vocab_stop: int
) -> torch.Tensor:
    """Return a vocabulary-parallel rank's embedding rows of ``ids``: the rows of its ids
    ``[vocab_start, vocab_stop)``, zeros for the other ranks' ids.

    Not yet summed over the group: `TensorShard.all_reduce_` adds the ranks' rows up, and each
    row is then one rank's, exactly.
    """
    local = ids - vocab_start
    outside = (local < 0) | (local >= vocab_stop - vocab_start)
    x = embed(local.clamp(0, vocab_stop - vocab_start - 1))
    return x.masked_fill_(outside.unsqueeze(1), 0)


def gather_vocab_parallel(
    logits: torch.Tensor, shard: TensorShard | None, vocab_size: int
) -> torch.Tensor:
    """Return every id's logits ``[rows, vocab_size]`` from a vocabulary-parallel rank's
    ``[rows, its vocabulary rows]``, gathered over its group (``logits`` as they are without a
    shard or a group)."""
    if shard is None or shard.group is None:
        return logits
    parts = shard.group.all_gather(logits.contiguous())  # [world, rows, vocab rows]
    full = parts.permute(1, 0, 2).reshape(logits.shape[0], -1)
    return full[:, :vocab_size]


class GatedMLP(nn.Module):
    """The gated feed-forward block: ``down(act(gate(x)) * up(x))``, under checkpoint names.

    ``gate_proj``, ``up_proj`` and ``down_proj`` load as any checkpoint names them;
    `fuse` then stores gate/up as one product and down in their fastest layouts for the rows
    the block sees (in the packed layout the named weights leave their modules; see
    `FusedLinear`).

    Args:
        hidden: Input and output width.
        inner: The gated width.
        activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
        bias: Whether the projections have biases.
    """

    def __init__(
        self, hidden: int, inner: int, *, activation: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        self.act = _ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up: FusedLinear | None = None
        self.down: FusedLinear | None = None
        self.shard: TensorShard | None = None

    def shard_slices(self, prefix: str, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's slices of the block (by parameter name under ``prefix``): gate and up
        column-parallel, down row-parallel."""
        start, stop = shard.split(self.gate_proj.out_features)
        return {
            **column_parallel(f"{prefix}.gate_proj", self.gate_proj, start, stop),
            **column_parallel(f"{prefix}.up_proj", self.up_proj, start, stop),
            **row_parallel(f"{prefix}.down_proj", self.down_proj, start, stop, shard),
        }

    def fuse(self, rows: tuple[int, ...] = DECODE_ROWS) -> None:
        """Store gate/up as one product and down in their fastest layouts at ``rows`` input rows."""
        self.gate_up = FusedLinear.of([self.gate_proj, self.up_proj], rows=rows)
        self.down = FusedLinear.of([self.down_proj], rows=rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` ``[..., hidden]``."""
        out = self.unreduced(x)
        # A shard's down product is a partial sum: the group adds the ranks' up.
        return out if self.shard is None else self.shard.all_reduce_(out.contiguous())

    def unreduced(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output on this rank: a shard's partial sum, not yet summed over the
        group (the whole output when not sharded)."""
        if self.gate_up is None or self.down is None:
            return cast(torch.Tensor, self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))
        if self.act is F.silu:
            gated = self.gate_up.silu_mul(x)
            if gated is not None:
                return self.down(gated)
        gate_up = self.gate_up(x)
        kernels = _native_for(gate_up) if self.act is F.silu and gate_up.dim() == 2 else None
        if kernels is not None:  # one pass, the same roundings
            return self.down(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        kernels = _native_for(x, self.weight)
        if kernels is not None:  # one pass, the same rounding as below
            return cast(
                torch.Tensor, kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)
            ).view(x.shape)
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel instead of seven small ops (a decode step runs 2L + 1 norms).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # transformers' order: normalise in float32, round to the input dtype, then scale. The
        # CPU kernel on bfloat16 input normalises in float32 and rounds once: the same values
        # without the two conversions.
        if dtype == torch.bfloat16 and x.device.type == "cpu":
            return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(dtype)

    def residual(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(x + delta, self(x + delta))``: a residual add and the norm after it."""
        kernels = _native_for(x, self.weight)
        if (
            kernels is not None
            and x.dim() == 2
            and delta.shape == x.shape
            and delta.dtype == x.dtype
        ):
            total, normed = kernels.add_rms_norm(x, delta, self.weight, self.eps)
            return cast(torch.Tensor, total), cast(torch.Tensor, normed)
        total = x + delta
        return total, self(total)


def _native_for(x: torch.Tensor, weight: torch.Tensor | None = None) -> ModuleType | None:
    """The native kernels, where they take `x` (CPU, float32 or bfloat16, rows contiguous, no grad,
    eager)."""
    if (
        x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.stride(-1) != 1
        or (weight is not None and weight.dtype != x.dtype)
        or (
            torch.is_grad_enabled()
            and (x.requires_grad or (weight is not None and weight.requires_grad))
        )
        or torch.compiler.is_compiling()  # compiled graphs fuse the torch ops themselves
    ):
        return None
    return cpu_kernels()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[..., head_dim]` by rotary tables broadcastable to it (half-split pairs).

    Channel `i` is paired with channel `i + head_dim / 2`, as Llama and GPT-NeoX checkpoints
    expect. The tables repeat each angle once for each half. (V-JEPA 2 pairs adjacent
    channels instead; see `mstar.zoo.vjepa2.rope`.)
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """Return rotary sine tables `[..., head_dim]` with the first half negated, for
    `apply_rotary_signed`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_signed(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> torch.Tensor:
    """`apply_rotary` with the sine's sign folded into its table (`signed_sin`): three ops, not
    five.

    A model computes `signed_sin` once per step and rotates every layer's queries and keys
    with it; the result equals `apply_rotary`'s bit for bit (`-a * b` is `a * -b`).
    """
    head_dim = x.shape[-1]
    kernels = _native_for(x)
    if (
        kernels is not None
        and x.dim() == 3
        and x.stride(1) == head_dim
        and cos.shape == sin_signed.shape == (x.shape[0], 1, head_dim)
        and cos.dtype == sin_signed.dtype == x.dtype
    ):  # one pass, the same roundings
        return cast(torch.Tensor, kernels.rotary(x, cos[:, 0], sin_signed[:, 0]))
    # The halves swapped: one copy (a flip of the half axis) instead of a negation and a cat.
    swapped = x.unflatten(-1, (2, head_dim // 2)).flip(-2).flatten(-2)
    out = x * cos
    out += swapped * sin_signed
    return out


def route_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor | None,
    experts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """Run each row of `x` `[rows, ...]` through its expert; return the rows in order.

    A multi-expert layer (BAGEL's understanding and generation weights, pi0.5's VLM and
    action expert) routes the rows of one step by `StepInputs.expert_ids` (None: every row
    is expert 0). Each expert computes its own rows only; attention between them stays
    joint, over one cache.
    """
    if expert_ids is None:
        return experts[0](x)
    present = torch.unique(expert_ids).tolist()
    if len(present) == 1:
        return experts[int(present[0])](x)
    out: torch.Tensor | None = None
    for expert in present:
        rows = (expert_ids == expert).nonzero().squeeze(1)
        y = experts[int(expert)](x.index_select(0, rows))
        if out is None:
            out = y.new_empty((x.shape[0], *y.shape[1:]))
        out.index_copy_(0, rows, y)
    assert out is not None
    return out
