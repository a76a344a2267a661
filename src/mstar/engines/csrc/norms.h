// The decoder layer's small ops, each one pass instead of several torch ops, with torch's
// rounding (every intermediate torch would round to the tensor's dtype is rounded here too):
// rms_norm / add_rms_norm (the residual add fused), rotary (q and k rotated in one pass),
// silu_mul (SwiGLU's act(gate) * up).

#pragma once

#include "simd.h"

namespace {

// rows x n: y = x * rsqrt(mean(x^2) + eps) * w, torch's order; a bfloat16 x rounds the
// normalised value before the weight multiplies it (transformers' order), then the product.
// With `delta`, x is first replaced by round(x + delta), written to `sum`.
template <typename T>
void rms_norm_rows(const T* x, const T* delta, const T* w, float eps, int64_t rows, int64_t n, int64_t x_stride,
                   int64_t delta_stride, T* sum, T* y) {
  std::vector<float> row(n);
  const int64_t body = n / 16 * 16;  // 16 lanes at a time, then one by one
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    if (delta != nullptr) {
      const T* dr = delta + r * delta_stride;
      for (int64_t i = 0; i < body; i += 16) {
        const vf16 v = round16<T>(load16(xr + i) + load16(dr + i));
        store16(row.data() + i, v);
        store16(sum + r * n + i, v);
      }
      for (int64_t i = body; i < n; ++i) {
        row[i] = round_to<T>(load(xr[i]) + load(dr[i]));
        store(row[i], sum + r * n + i);
      }
    } else {
      for (int64_t i = 0; i < body; i += 16) store16(row.data() + i, load16(xr + i));
      for (int64_t i = body; i < n; ++i) row[i] = load(xr[i]);
    }
    vf16 lanes{};
    for (int64_t i = 0; i < body; i += 16) {
      const vf16 v = load16(row.data() + i);
      lanes += v * v;
    }
    float squares = hsum(lanes);
    for (int64_t i = body; i < n; ++i) squares += row[i] * row[i];
    const float inv = 1.f / std::sqrt(squares / float(n) + eps);
    T* yr = y + r * n;
    for (int64_t i = 0; i < body; i += 16)
      store16(yr + i, round16<T>(load16(row.data() + i) * inv) * load16(w + i));
    for (int64_t i = body; i < n; ++i) store(round_to<T>(row[i] * inv) * load(w[i]), yr + i);
  }
}

// Rotary on [tokens, heads, dim] rows (half-split pairs, the sine's first half negated):
// out = round(round(x * cos) + round(swapped * sin)), as the torch ops round.
template <typename T>
#if defined(__clang__)
void rotary_rows(const T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t x_stride, int64_t table_stride, T* out) {
#pragma clang fp contract(off)
#else
__attribute__((optimize("fp-contract=off"))) void rotary_rows(const T* x, const T* cos, const T* sin, int64_t tokens,
                                                              int64_t heads, int64_t dim, int64_t x_stride,
                                                              int64_t table_stride, T* out) {
#endif
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * table_stride;
    const T* sn = sin + t * table_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + t * x_stride + h * dim;
      T* o = out + (t * heads + h) * dim;
      if (half % 16 == 0) {  // 16 lanes at a time, each within one half
        for (int64_t i = 0; i < dim; i += 16) {
          const vf16 a = round16<T>(load16(xr + i) * load16(c + i));
          const vf16 b = round16<T>(load16(xr + (i < half ? i + half : i - half)) * load16(sn + i));
          store16(o + i, a + b);
        }
        continue;
      }
      for (int64_t i = 0; i < dim; ++i) {
        const float a = round_to<T>(load(xr[i]) * load(c[i]));
        const float b = round_to<T>(load(xr[i < half ? i + half : i - half]) * load(sn[i]));
        store(a + b, o + i);
      }
    }
  }
}

// [tokens, 2 x inner] -> [tokens, inner] (rows out_stride apart): round(round(silu(gate)) * up).
template <typename T>
void silu_mul_rows(const T* x, int64_t tokens, int64_t inner, int64_t x_stride, T* out, int64_t out_stride) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* gate = x + t * x_stride;
    const T* up = gate + inner;
    int64_t i = 0;
    for (; i + 16 <= inner; i += 16) {
      const vf16 g = load16(gate + i);
      const vf16 act = round16<T>(g / (1.f + exp16(g * -1.f)));
      store16(out + t * out_stride + i, act * load16(up + i));
    }
    for (; i < inner; ++i) {
      const float g = load(gate[i]);
      const float act = round_to<T>(g / (1.f + exp_scalar(-g)));
      store(act * load(up[i]), out + t * out_stride + i);
    }
  }
}

}  // namespace

// x [rows, n] (strided rows), weight [n], x's dtype: the normalised rows, contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight [width] of x's dtype expected");
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  by_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(reinterpret_cast<const T*>(x.data_ptr()), nullptr, reinterpret_cast<const T*>(weight.data_ptr()),
                     float(eps), x.size(0), x.size(1), x.stride(0), 0, nullptr, reinterpret_cast<T*>(y.data_ptr()));
  });
  return y;
}

// (x + delta, rms_norm(x + delta)): the residual add and the next norm in one pass.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                     double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(delta, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and delta must share shape and dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight [width] of x's dtype expected");
  auto sum = at::empty({x.size(0), x.size(1)}, x.options());
  auto y = at::empty_like(sum);
  by_dtype(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const T*>(delta.data_ptr()),
                     reinterpret_cast<const T*>(weight.data_ptr()), float(eps), x.size(0), x.size(1), x.stride(0),
                     delta.stride(0), reinterpret_cast<T*>(sum.data_ptr()), reinterpret_cast<T*>(y.data_ptr()));
  });
  return {sum, y};
}

// x [tokens, heads, dim] (strided tokens, contiguous heads), cos and sin [tokens, dim]
// (sin signed; rows may be strided): the rotated heads, contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x [tokens, heads, dim] with contiguous heads expected");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary: dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0),
              "rotary: cos and sin [tokens, dim] expected");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: tables must have x's dtype");
  auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  by_dtype(x, "rotary", [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const T*>(cos.data_ptr()),
                   reinterpret_cast<const T*>(sin.data_ptr()), x.size(0), x.size(1), x.size(2), x.stride(0),
                   cos.stride(0), reinterpret_cast<T*>(out.data_ptr()));
  });
  return out;
}

// x [tokens, 2 x inner] (gate then up): silu(gate) * up, [tokens, inner].
at::Tensor silu_mul(const at::Tensor& x) {
  check_rows(x, "silu_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_mul: an even width (gate, then up) expected");
  const int64_t inner = x.size(1) / 2;
  auto out = at::empty({x.size(0), inner}, x.options());
  by_dtype(x, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(reinterpret_cast<const T*>(x.data_ptr()), x.size(0), inner, x.stride(0),
                     reinterpret_cast<T*>(out.data_ptr()), inner);
  });
  return out;
}
