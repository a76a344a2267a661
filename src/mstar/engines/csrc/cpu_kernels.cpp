// mstar's native CPU kernels (built at first use by mstar.engines.native).
//
// decode_attention: one query token per sequence against its keys and values read in place
// from the paged cache [blocks, block_size, kv_heads, head_dim] through its block table.
// Each (sequence, KV head) is one work item: for every query head of the KV head's group,
// scores over 16-key tiles (one horizontal-add tree per tile), an exact softmax, then the
// weighted sum of values, all accumulated in float32. float32 and bfloat16 caches are read
// as they are stored (bfloat16 widened on load), so a bfloat16 cache moves half the bytes.
//
// The decoder layer's small ops, each one pass instead of several torch ops, with torch's
// rounding (every intermediate torch would round to the tensor's dtype is rounded here too):
// rms_norm / add_rms_norm (the residual add fused), rotary (q and k rotated in one pass),
// silu_mul (SwiGLU's act(gate) * up).
//
// linear / pack_linear: x @ W.T (+ b) for the few rows of a decode step, over weights packed
// in tiles of 16 outputs: one pass over the weights serves up to 16 rows, each tile's 16
// sums held in a register (float32: a multiply-add per input; bfloat16: AVX-512 BF16's
// pairwise dot products, AMX tile products from 4 rows where the CPU has AMX, or elsewhere
// each weight widened to float32 on load), accumulated in float32 and rounded once. At these
// row counts the products cost a few microseconds where oneDNN's calls cost about twenty;
// which layout a weight takes is still timed (`choose_layout`).
//
// argmax_rows, linear_argmax, screened_argmax / screened_tokens: the greedy head's choice.
// decode_layer: a Llama decoder layer over decode rows in one call (the kernels above, in
// the layer-by-layer path's order); DecodeStack: the whole decode step's layers in one call.
//
// The vectors hold 16 floats: one AVX-512 register where the CPU has them, a pair of AVX2
// registers (or narrower) elsewhere (see vf16).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define MSTAR_AMX 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

// Sixteen lanes each: float32, int32 (comparison masks), uint32 (bit patterns), and uint16
// (bfloat16 bits, half the width). With AVX-512 each is one 64-byte GCC/Clang vector, one
// register. Without it, GCC keeps a 64-byte vector in memory, a load and a store around
// every operation (the tiled product ran 30x slower on AVX2): there each is two halves of
// eight lanes (`Halves`), one register each, with the same operators.
#if defined(__AVX512F__)
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));

template <typename To, typename From>
inline To convert(From v) {  // lane by lane, as a C cast converts
  return __builtin_convertvector(v, To);
}

template <typename To, typename From>
inline To bitcast(From v) {
  return (To)v;
}

template <typename M, typename V>
inline V select(M mask, V a, V b) {
  return mask ? a : b;
}

inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vu16 load_bits(const uint16_t* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  return h;
}

inline vu32 load_words(const uint16_t* p) {
  vu32 w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

inline void store16(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }

inline void store_bits(uint16_t* p, vu16 v) { std::memcpy(p, &v, sizeof v); }

inline vf16 lane_indices() { return vf16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
#else
template <typename V>
struct Halves {
  V lo, hi;
  auto operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};

typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));
using vf16 = Halves<vf8>;
using vi16 = Halves<vi8>;
using vu32 = Halves<vu8>;
using vu16 = Halves<vh8>;

// Halves op Halves and Halves op scalar (comparisons give Halves of masks); arithmetic and
// bitwise ops also scalar op Halves and the compound assignment.
#define MSTAR_HALVES_BINARY(op)                                                              \
  template <typename V>                                                                      \
  inline auto operator op(const Halves<V>& a, const Halves<V>& b) {                          \
    return Halves<decltype(a.lo op b.lo)>{a.lo op b.lo, a.hi op b.hi};                       \
  }                                                                                          \
  template <typename V, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>    \
  inline auto operator op(const Halves<V>& a, S b) {                                         \
    return Halves<decltype(a.lo op b)>{a.lo op b, a.hi op b};                                \
  }
#define MSTAR_HALVES_ARITHMETIC(op)                                                          \
  MSTAR_HALVES_BINARY(op)                                                                    \
  template <typename V, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>    \
  inline auto operator op(S a, const Halves<V>& b) {                                         \
    return Halves<decltype(a op b.lo)>{a op b.lo, a op b.hi};                                \
  }                                                                                          \
  template <typename V, typename B>                                                          \
  inline Halves<V>& operator op##=(Halves<V>& a, const B& b) {                               \
    return a = a op b;                                                                       \
  }
MSTAR_HALVES_ARITHMETIC(+)
MSTAR_HALVES_ARITHMETIC(-)
MSTAR_HALVES_ARITHMETIC(*)
MSTAR_HALVES_ARITHMETIC(/)
MSTAR_HALVES_ARITHMETIC(&)
MSTAR_HALVES_ARITHMETIC(|)
MSTAR_HALVES_ARITHMETIC(<<)
MSTAR_HALVES_ARITHMETIC(>>)
MSTAR_HALVES_BINARY(<)
MSTAR_HALVES_BINARY(>)
MSTAR_HALVES_BINARY(!=)
#undef MSTAR_HALVES_ARITHMETIC
#undef MSTAR_HALVES_BINARY

template <typename To, typename From>
inline To convert(const Halves<From>& v) {
  using H = decltype(To{}.lo);
  return {__builtin_convertvector(v.lo, H), __builtin_convertvector(v.hi, H)};
}

template <typename To, typename From>
inline To bitcast(const Halves<From>& v) {
  using H = decltype(To{}.lo);
  return {(H)v.lo, (H)v.hi};
}

template <typename M, typename V>
inline Halves<V> select(const Halves<M>& mask, const Halves<V>& a, const Halves<V>& b) {
  return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi};
}

// Unaligned loads and stores of one half (memcpy of a whole Halves went through the stack).
typedef float vf8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint32_t vu8_unaligned __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint16_t vh8_unaligned __attribute__((vector_size(16), aligned(2), may_alias));

inline vf16 load16(const float* p) {
  return {*reinterpret_cast<const vf8_unaligned*>(p), *reinterpret_cast<const vf8_unaligned*>(p + 8)};
}

inline vu16 load_bits(const uint16_t* p) {
  return {*reinterpret_cast<const vh8_unaligned*>(p), *reinterpret_cast<const vh8_unaligned*>(p + 8)};
}

inline vu32 load_words(const uint16_t* p) {
  return {*reinterpret_cast<const vu8_unaligned*>(p), *reinterpret_cast<const vu8_unaligned*>(p + 16)};
}

inline void store16(float* p, vf16 v) {
  *reinterpret_cast<vf8_unaligned*>(p) = v.lo;
  *reinterpret_cast<vf8_unaligned*>(p + 8) = v.hi;
}

inline void store_bits(uint16_t* p, vu16 v) {
  *reinterpret_cast<vh8_unaligned*>(p) = v.lo;
  *reinterpret_cast<vh8_unaligned*>(p + 8) = v.hi;
}

inline vf16 lane_indices() { return {vf8{0, 1, 2, 3, 4, 5, 6, 7}, vf8{8, 9, 10, 11, 12, 13, 14, 15}}; }
#endif

inline vf16 load16(const uint16_t* p) {  // bfloat16 bits: the upper half of a float32
  return bitcast<vf16>(convert<vu32>(load_bits(p)) << 16);
}

// 32 bfloat16 values as two float32 vectors, without widening each lane: the even-indexed
// values (shifted into the upper half) and the odd-indexed ones (already in the upper half).
// Dot products and weighted sums do not care about lane order, so queries are split alike.
inline void load_pairs(const uint16_t* p, vf16& even, vf16& odd) {
  const vu32 w = load_words(p);
  even = bitcast<vf16>(w << 16);
  odd = bitcast<vf16>(w & 0xffff0000u);
}

inline void store(float v, float* dst) { *dst = v; }

inline void store(float v, uint16_t* dst) {  // round to nearest even, as torch rounds
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *dst = 0x7fc0;  // NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *dst = uint16_t(u >> 16);
}

// round_to<T> lane by lane.
template <typename T>
inline vf16 round16(vf16 v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    const vu32 u = bitcast<vu32>(v);
    const vu32 rounded = (u + (0x7fffu + ((u >> 16) & 1u))) & 0xffff0000u;
    return bitcast<vf16>(select((u & 0x7fffffffu) > 0x7f800000u, vu32{} + 0x7fc00000u, rounded));
  } else {
    return v;
  }
}

// 16 values rounded as `store` rounds each.
inline void store16(uint16_t* dst, vf16 v) {
  store_bits(dst, convert<vu16>(bitcast<vu32>(round16<uint16_t>(v)) >> 16));
}

inline float load(float x) { return x; }
inline float load(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The value `v` takes in T (float32: itself; bfloat16: rounded to nearest even).
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    uint16_t bits;
    store(v, &bits);
    return load(bits);
  } else {
    return v;
  }
}

inline vf16 splat(float x) { return vf16{} + x; }

inline float hsum(vf16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

inline bool any(vi16 mask) {
  uint64_t words[8];
  std::memcpy(words, &mask, sizeof words);
  return (words[0] | words[1] | words[2] | words[3] | words[4] | words[5] | words[6] | words[7]) != 0;
}

inline float hmax(vf16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}

// e^r for |r| <= ln2 / 2: the degree-7 Taylor polynomial (float or vf16).
template <typename V>
inline V exp_polynomial(V r) {
  V p = V{} + 1.f / 5040;
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + c;
  return p;
}

// exp for any float32: 2^n * e^r with |r| <= ln2 / 2, a degree-7 Taylor polynomial (relative
// error below 1e-8 before rounding); x below -87 gives about 1e-38, above 88 the largest
// finite value's neighbourhood. n rounds half to even by adding and subtracting 1.5 x 2^23
// (exact for |n| < 2^22); exp16 makes the same operations lane by lane.
constexpr float kRoundEven = 12582912.0f;

inline float exp_scalar(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + kRoundEven) - kRoundEven;
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  const float p = exp_polynomial(r);
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline vf16 exp16(vf16 x) {
  x = select(x > 88.0f, splat(88.0f), select(x < -87.0f, splat(-87.0f), x));
  const vf16 n = (x * 1.44269504088896341f + kRoundEven) - kRoundEven;
  vf16 r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  return exp_polynomial(r) * bitcast<vf16>((convert<vi16>(n) + 127) << 23);
}

// exp for x <= 0 (softmax arguments); x below -87 gives 0.
inline vf16 exp_nonpositive(vf16 x) { return select(x < -87.0f, vf16{}, exp16(x)); }

// The 16 sums of 16 vectors, lane i holding the sum of a[i]: a tree of pairwise shuffles.
#if defined(__AVX512F__)
inline vf16 sum16(const vf16* a) {
  vf16 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)
    b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)
    c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * k], b[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)
    d[k] = __builtin_shufflevector(c[2 * k], c[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * k], c[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
// Eight sums of eight vectors, lane i holding the sum of a[i].
inline vf8 sum8(const vf8* a) {
  vf8 b[4], c[2];
  for (int k = 0; k < 4; ++k)
    b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int k = 0; k < 2; ++k)
    c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * k], b[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 4, 2, 6, 8, 12, 10, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 5, 3, 7, 9, 13, 11, 15);
}

inline vf16 sum16(const vf16* a) {
  vf8 halves[16];
  for (int r = 0; r < 16; ++r) halves[r] = a[r].lo + a[r].hi;
  return {sum8(halves), sum8(halves + 8)};
}
#endif

// A head_dim row as J vectors: in order for float32; for bfloat16 with head_dim a multiple
// of 32, as (even, odd) pairs of each 32 values (see `load_pairs`); queries, the output and
// the accumulators use the same arrangement, undone by `store_row`.
template <int J, typename T>
inline void load_row(const T* p, vf16* out) {
  if constexpr (std::is_same_v<T, uint16_t> && J % 2 == 0) {
    for (int j = 0; j < J; j += 2) load_pairs(p + 16 * j, out[j], out[j + 1]);
  } else {
    for (int j = 0; j < J; ++j) out[j] = load16(p + 16 * j);
  }
}

template <int J, typename T>
inline void store_row(const vf16* row, float scale, T* out) {
  float values[16 * J];
  if constexpr (std::is_same_v<T, uint16_t> && J % 2 == 0) {
    for (int j = 0; j < J; j += 2)
      for (int i = 0; i < 16; ++i) {
        values[16 * j + 2 * i] = row[j][i];
        values[16 * j + 2 * i + 1] = row[j + 1][i];
      }
  } else {
    for (int j = 0; j < J; ++j)
      for (int i = 0; i < 16; ++i) values[16 * j + i] = row[j][i];
  }
  for (int d = 0; d < 16 * J; ++d) store(values[d] * scale, out + d);
}

template <int J, typename T>
inline vf16 dot(const vf16* qv, const T* k) {
  vf16 kv[J];
  load_row<J>(k, kv);
  vf16 acc = qv[0] * kv[0];
  for (int j = 1; j < J; ++j) acc += qv[j] * kv[j];
  return acc;
}

struct Geometry {
  int64_t block_size, token_stride, len;
};

// Blocks of keys scored (or summed) for every query head of an item before moving on: their
// keys or values stay in L1 across the item's heads.
constexpr int64_t kChunkKeys = 64;

// `group` query heads (rows of q, contiguous; `per_kv` of them to each KV head, the first
// reading `keys` and `values`, the next KV head's D further) against one sequence's keys and
// values; J = head_dim / 16. A row's KV heads go together, block by block: a block's tokens
// are read whole (all heads side by side) instead of a slice per head, far apart. `s` holds
// group x padded scores, `work` 3 x group x J vectors, `inv` group floats.
template <int J, typename T>
void attend_group(const T* q, int64_t group, int64_t per_kv, const T* keys, const T* values, const int64_t* table,
                  const Geometry& g, float scale, T* out, float* s, vf16* work, float* inv) {
  constexpr int D = 16 * J;
  const int64_t len = g.len, bs = g.block_size, stride = g.token_stride;
  const int64_t padded = (len + 15) / 16 * 16, num_blocks = (len + bs - 1) / bs;
  const int64_t chunk = std::max<int64_t>(1, kChunkKeys / bs);
  const float lowest = -std::numeric_limits<float>::infinity();
  vf16* qv = work;                      // [group][J] scaled queries
  vf16* acc = work + group * J;         // [group][J] weighted values
  vf16* maxima = work + 2 * group * J;  // [group] per-lane maxima of the scores
  for (int64_t h = 0; h < group; ++h) {
    load_row<J>(q + h * D, qv + h * J);
    for (int j = 0; j < J; ++j) {
      qv[h * J + j] *= scale;
      acc[h * J + j] = vf16{};
    }
    maxima[h] = splat(lowest);
    for (int64_t t = len; t < padded; ++t) s[h * padded + t] = lowest;
  }
  for (int64_t c = 0; c < num_blocks; c += chunk) {
    const int64_t c_end = std::min(num_blocks, c + chunk);
    for (int64_t h = 0; h < group; ++h) {
      const vf16* qh = qv + h * J;
      float* sh = s + h * padded;
      vf16 tiles_max = maxima[h];
      for (int64_t b = c; b < c_end; ++b) {
        const int64_t t0 = b * bs, n = std::min(bs, len - t0);
        const T* kb = keys + table[b] * bs * stride + (h / per_kv) * D;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
          vf16 a[16];
          for (int r = 0; r < 16; ++r) a[r] = dot<J>(qh, kb + (i + r) * stride);
          const vf16 tile = sum16(a);
          store16(sh + t0 + i, tile);
          tiles_max = select(tiles_max > tile, tiles_max, tile);
        }
        for (; i < n; ++i) {
          const float x = hsum(dot<J>(qh, kb + i * stride));
          sh[t0 + i] = x;
          tiles_max = select(tiles_max > x, tiles_max, splat(x));  // hmax reads every lane
        }
      }
      maxima[h] = tiles_max;
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sh = s + h * padded;
    const float m = hmax(maxima[h]);
    vf16 total = {};
    for (int64_t t = 0; t < padded; t += 16) {
      const vf16 p = exp_nonpositive(load16(sh + t) - m);
      store16(sh + t, p);
      total += p;
    }
    inv[h] = 1.f / hsum(total);
  }
  for (int64_t c = 0; c < num_blocks; c += chunk) {
    const int64_t c_end = std::min(num_blocks, c + chunk);
    for (int64_t h = 0; h < group; ++h) {
      const float* sh = s + h * padded;
      vf16 a[J];
      for (int j = 0; j < J; ++j) a[j] = acc[h * J + j];
      for (int64_t b = c; b < c_end; ++b) {
        const int64_t t0 = b * bs, n = std::min(bs, len - t0);
        const T* vb = values + table[b] * bs * stride + (h / per_kv) * D;
        for (int64_t i = 0; i < n; ++i) {
          const vf16 p = splat(sh[t0 + i]);
          vf16 vv[J];
          load_row<J>(vb + i * stride, vv);
          for (int j = 0; j < J; ++j) a[j] += p * vv[j];
        }
      }
      for (int j = 0; j < J; ++j) acc[h * J + j] = a[j];
    }
  }
  for (int64_t h = 0; h < group; ++h) store_row<J>(acc + h * J, inv[h], out + h * D);
}

template <int J, typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out) {
  constexpr int D = 16 * J;
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, q_stride = q.stride(0), max_blocks = tables.size(1);
  const int64_t block_size = k_cache.size(1), token_stride = kv_heads * D;
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t longest = rows ? *std::max_element(lp, lp + rows) : 0;
  // A work item is a row's KV heads together; with fewer rows than threads, one KV head each.
  const int64_t split = rows < at::get_num_threads() ? kv_heads : 1, per_item = kv_heads / split;
  const int64_t item_heads = per_item * group;
  at::parallel_for(0, rows * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(item_heads * ((longest + 15) / 16 * 16));
    std::vector<vf16> work(3 * item_heads * J);
    std::vector<float> inv(item_heads);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / split, h = (item % split) * per_item;
      const Geometry geometry{block_size, token_stride, lp[row]};
      attend_group<J>(qp + row * q_stride + h * group * D, item_heads, group, kp + h * D, vp + h * D,
                      tp + row * max_blocks, geometry, float(scale), op + (row * heads + h * group) * D,
                      scores.data(), work.data(), inv.data());
    }
  });
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 16: return decode_attention_impl<1, T>(q, k_cache, v_cache, tables, lens, scale, out);
    case 32: return decode_attention_impl<2, T>(q, k_cache, v_cache, tables, lens, scale, out);
    case 64: return decode_attention_impl<4, T>(q, k_cache, v_cache, tables, lens, scale, out);
    case 128: return decode_attention_impl<8, T>(q, k_cache, v_cache, tables, lens, scale, out);
    case 256: return decode_attention_impl<16, T>(q, k_cache, v_cache, tables, lens, scale, out);
    default: TORCH_CHECK(false, "decode_attention: head_dim must be 16, 32, 64, 128 or 256, got ", q.size(2));
  }
}

// rows x n: y = x * rsqrt(mean(x^2) + eps) * w, torch's order; a bfloat16 x rounds the
// normalised value before the weight multiplies it (transformers' order), then the product.
// With `delta`, x is first replaced by round(x + delta), written to `sum`.
template <typename T>
void rms_norm_rows(const T* x, const T* delta, const T* w, float eps, int64_t rows, int64_t n, int64_t x_stride,
                   int64_t delta_stride, T* sum, T* y) {
  std::vector<float> row(n);
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    float squares = 0.f;
    if (delta != nullptr) {
      const T* dr = delta + r * delta_stride;
      for (int64_t i = 0; i < n; ++i) {
        row[i] = round_to<T>(load(xr[i]) + load(dr[i]));
        store(row[i], sum + r * n + i);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) row[i] = load(xr[i]);
    }
    for (int64_t i = 0; i < n; ++i) squares += row[i] * row[i];
    const float inv = 1.f / std::sqrt(squares / float(n) + eps);
    T* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) store(round_to<T>(row[i] * inv) * load(w[i]), yr + i);
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
      for (int64_t i = 0; i < dim; ++i) {
        const float a = round_to<T>(load(xr[i]) * load(c[i]));
        const float b = round_to<T>(load(xr[i < half ? i + half : i - half]) * load(sn[i]));
        store(a + b, o + i);
      }
    }
  }
}

// [tokens, 2 x inner] -> [tokens, inner]: round(round(silu(gate)) * up).
template <typename T>
void silu_mul_rows(const T* x, int64_t tokens, int64_t inner, int64_t x_stride, T* out) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* gate = x + t * x_stride;
    const T* up = gate + inner;
    int64_t i = 0;
    for (; i + 16 <= inner; i += 16) {
      const vf16 g = load16(gate + i);
      const vf16 act = round16<T>(g / (1.f + exp16(g * -1.f)));
      store16(out + t * inner + i, act * load16(up + i));
    }
    for (; i < inner; ++i) {
      const float g = load(gate[i]);
      const float act = round_to<T>(g / (1.f + exp_scalar(-g)));
      store(act * load(up[i]), out + t * inner + i);
    }
  }
}

// Tiled weights: float32 [N/16][K][16] (tile, input, output lane); bfloat16 [N/16][K/2][16][2]
// (tile, input pair, output lane, pair member), the operand layout of a pairwise dot product.
// A block of M rows against NT adjacent tiles: M x NT sums in registers, each input's weight
// vector loaded once per tile and each row's input broadcast once for all NT tiles. With 32
// vector registers (AVX-512) blocks of 8 rows by 2 tiles; with 16 (AVX2), 6 rows by 1.
#if defined(__AVX512F__)
constexpr int64_t kRowBlock = 8, kTileGroup = 2;
#else
constexpr int64_t kRowBlock = 6, kTileGroup = 1;
#endif

// Not inlined: inlined into its callers, GCC allocated the sums' registers worse (bfloat16 on
// AVX2: 25 % slower).
template <int M, int NT>
__attribute__((noinline)) void linear_tile_f32(const float* x, int64_t x_stride, const float* w, int64_t tile_stride,
                                                int64_t K, const float* bias, float* y, int64_t y_stride) {
  vf16 acc[M][NT];
  for (int n = 0; n < NT; ++n) {
    const vf16 b = bias ? load16(bias + 16 * n) : vf16{};
    for (int m = 0; m < M; ++m) acc[m][n] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    vf16 wk[NT];
    for (int n = 0; n < NT; ++n) wk[n] = load16(w + n * tile_stride + 16 * k);
    for (int m = 0; m < M; ++m) {
      const float xk = x[m * x_stride + k];
      for (int n = 0; n < NT; ++n) acc[m][n] += xk * wk[n];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NT; ++n) store16(y + m * y_stride + 16 * n, acc[m][n]);
}

#if defined(__AVX512BF16__)
// Tile n's 16 bias values (bfloat16) widened to float32; zeros without a bias.
inline __m512 bias16(const uint16_t* bias, int n) {
  __m512 b = _mm512_setzero_ps();
  if (bias) {
    const vf16 bv = load16(bias + 16 * n);
    std::memcpy(&b, &bv, sizeof b);
  }
  return b;
}

template <int M, int NT>
void linear_tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t tile_stride, int64_t K,
                      const uint16_t* bias, uint16_t* y, int64_t y_stride) {
  __m512 acc[M][NT];
  for (int n = 0; n < NT; ++n) {
    const __m512 b = bias16(bias, n);
    for (int m = 0; m < M; ++m) acc[m][n] = b;
  }
  for (int64_t kk = 0; kk < K / 2; ++kk) {
    __m512bh wk[NT];
    for (int n = 0; n < NT; ++n) wk[n] = (__m512bh)_mm512_loadu_si512(w + n * tile_stride + 32 * kk);
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * kk, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xb, wk[n]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NT; ++n) {
      const __m256bh rounded = _mm512_cvtneps_pbh(acc[m][n]);  // nearest even, as torch rounds
      std::memcpy(y + m * y_stride + 16 * n, &rounded, sizeof rounded);
    }
}
#else
// Without AVX-512 BF16: each weight pair widened to float32 (`load_pairs`), two multiply-adds
// per row; x arrives widened to float32 (once per product, not once per tile).
template <int M, int NT>
__attribute__((noinline)) void linear_tile_bf16(const float* x, int64_t x_stride, const uint16_t* w,
                                                 int64_t tile_stride, int64_t K, const uint16_t* bias, uint16_t* y,
                                                 int64_t y_stride) {
  vf16 acc[M][NT];
  for (int n = 0; n < NT; ++n) {
    const vf16 b = bias ? load16(bias + 16 * n) : vf16{};
    for (int m = 0; m < M; ++m) acc[m][n] = b;
  }
  for (int64_t kk = 0; kk < K / 2; ++kk) {
    vf16 even[NT], odd[NT];
    for (int n = 0; n < NT; ++n) load_pairs(w + n * tile_stride + 32 * kk, even[n], odd[n]);
    for (int m = 0; m < M; ++m) {
      const float x0 = x[m * x_stride + 2 * kk], x1 = x[m * x_stride + 2 * kk + 1];
      for (int n = 0; n < NT; ++n) {
        acc[m][n] += x0 * even[n];
        acc[m][n] += x1 * odd[n];
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NT; ++n) store16(y + m * y_stride + 16 * n, acc[m][n]);
}
#endif

#if defined(MSTAR_AMX)
// AMX, the CPU's matrix unit: tile registers of up to 16 rows x 64 bytes. One tile product
// multiplies 16 rows by 32 features by 16 outputs, where AVX-512 BF16 takes 16 instructions
// per row. Linux hands the tile registers to a process only once it asks.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1: the float32 sums of M rows by two adjacent weight tiles; 2-3: M rows of the
// input, 32 features each (two feature blocks in flight); 4-7: weights, 16 feature pairs by
// 16 outputs by 2 (pack_linear's bfloat16 layout is the tile's own, so each weight tile is
// 1 KB read as stored), two per feature block. Loads of the next block overlap the products
// of this one: with one input tile, each load waited for the products before it (3x slower).
void configure_tiles(int m) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 4 ? m : 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// A row's first maximum over the rounded outputs seen so far, per lane (linear_argmax on
// AMX keeps one per row instead of writing the outputs): a strict > keeps the first index.
struct RowMax {
  static __m512i lanes() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

  __m512 value = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i index = lanes();
  int64_t first_nan = -1;  // the first NaN output's index (torch's argmax returns it)

  // Outputs col .. col + 15, rounded to bfloat16.
  void take(__m256bh rounded, int32_t col) {
    __m256i bits;
    std::memcpy(&bits, &rounded, sizeof bits);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    const __mmask16 better = _mm512_cmp_ps_mask(v, value, _CMP_GT_OQ);
    value = _mm512_mask_mov_ps(value, better, v);
    index = _mm512_mask_mov_epi32(index, better, _mm512_add_epi32(lanes(), _mm512_set1_epi32(col)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan && first_nan < 0) first_nan = col + __builtin_ctz(nan);
  }
};

// M rows (the configured count, <= 16) of x by `nt` (1 or 2) adjacent weight tiles; K a multiple of 32.
// The outputs go to y, or (with `best`) into each row's running maximum, `col` being the first
// tile's first output.
void linear_amx_block(int m, int nt, const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K,
                      const uint16_t* bias, uint16_t* y, int64_t y_stride, RowMax* best, int32_t col) {
  _tile_zero(0);
  _tile_zero(1);
  const int64_t second = 16 * K;  // the second weight tile
  const int64_t x_bytes = x_stride * 2;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const uint16_t* wk = w + 16 * k;  // feature pair k / 2 of the first tile; 512 further: the next 32 features
    _tile_loadd(2, x + k, x_bytes);
    _tile_loadd(4, wk, 64);
    if (nt > 1) _tile_loadd(5, wk + second, 64);
    _tile_loadd(3, x + k + 32, x_bytes);
    _tile_loadd(6, wk + 512, 64);
    if (nt > 1) _tile_loadd(7, wk + second + 512, 64);
    _tile_dpbf16ps(0, 2, 4);
    if (nt > 1) _tile_dpbf16ps(1, 2, 5);
    _tile_dpbf16ps(0, 3, 6);
    if (nt > 1) _tile_dpbf16ps(1, 3, 7);
  }
  if (k < K) {  // the last 32 features
    _tile_loadd(2, x + k, x_bytes);
    _tile_loadd(4, w + 16 * k, 64);
    _tile_dpbf16ps(0, 2, 4);
    if (nt > 1) {
      _tile_loadd(5, w + 16 * k + second, 64);
      _tile_dpbf16ps(1, 2, 5);
    }
  }
  alignas(64) float sums[2][16][16];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  for (int n = 0; n < nt; ++n) {
    const __m512 b = bias16(bias, n);
    for (int r = 0; r < m; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums[n][r]), b));
      if (best) {
        best[r].take(rounded, col + 16 * n);
      } else {
        std::memcpy(y + r * y_stride + 16 * n, &rounded, sizeof rounded);
      }
    }
  }
}

constexpr int64_t kAmxTileGroup = 2;
// Below 4 rows the tile products lose to AVX-512 BF16's (1.3-1.5x slower at 1 row; level at 2-3).
constexpr int64_t kAmxMinRows = 4;

// Whether linear's bfloat16 product of `rows` rows by K features runs on AMX.
bool amx_takes(int64_t rows, int64_t K) { return rows >= kAmxMinRows && K % 32 == 0 && amx_permitted(); }

// linear's bfloat16 product on AMX: rows in blocks of 16, weight tiles in pairs. With
// `tokens`, each row's first maximum goes there instead of the outputs to y (linear_argmax):
// the threads' maxima are merged (a larger value, or an equal one at a smaller index, wins).
void linear_amx(const uint16_t* x, int64_t rows, int64_t x_stride, const uint16_t* w, int64_t N, int64_t K,
                const uint16_t* bias, uint16_t* y, int64_t* tokens = nullptr) {
  const int64_t tiles = N / 16, groups = (tiles + kAmxTileGroup - 1) / kAmxTileGroup;
  std::mutex merging;
  std::vector<float> top(tokens ? rows : 0, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> first_nan(tokens ? rows : 0, -1);
  if (tokens) std::fill(tokens, tokens + rows, std::numeric_limits<int64_t>::max());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<RowMax> best(tokens ? rows : 0);
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
      const int m = int(std::min<int64_t>(16, rows - m0));
      configure_tiles(m);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t t = g * kAmxTileGroup;
        linear_amx_block(m, int(std::min(kAmxTileGroup, tiles - t)), x + m0 * x_stride, x_stride, w + t * 16 * K, K,
                         bias ? bias + 16 * t : nullptr, tokens ? nullptr : y + m0 * N + 16 * t, N,
                         tokens ? best.data() + m0 : nullptr, int32_t(16 * t));
      }
    }
    _tile_release();
    if (!tokens) return;
    std::lock_guard<std::mutex> lock(merging);
    for (int64_t r = 0; r < rows; ++r) {
      alignas(64) float value[16];
      alignas(64) int32_t index[16];
      _mm512_store_ps(value, best[r].value);
      _mm512_store_si512(index, best[r].index);
      for (int l = 0; l < 16; ++l)
        if (value[l] > top[r] || (value[l] == top[r] && index[l] < tokens[r])) {
          top[r] = value[l];
          tokens[r] = index[l];
        }
      if (best[r].first_nan >= 0 && (first_nan[r] < 0 || best[r].first_nan < first_nan[r]))
        first_nan[r] = best[r].first_nan;
    }
  });
  for (int64_t r = 0; r < rows && tokens; ++r)
    if (first_nan[r] >= 0) tokens[r] = first_nan[r];
}
#endif

// Rows in blocks of up to kRowBlock (as even as they come: 16 rows in 6 + 5 + 5, not 6 + 6 + 4),
// tiles in groups of kTileGroup (a group's weights stay in L1 across the blocks).
template <typename X, typename T, typename Tile>
void linear_rows(const X* x, int64_t rows, int64_t x_stride, const T* w, int64_t N, int64_t K, const T* bias, T* y,
                 Tile&& tile) {
  const int64_t tiles = N / 16, per_tile = 16 * K, groups = (tiles + kTileGroup - 1) / kTileGroup;
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t = g * kTileGroup, nt = std::min(kTileGroup, tiles - t);
      for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
        const int64_t m = (rows - m0) / (blocks - b);
        tile(m, nt, x + m0 * x_stride, w + t * per_tile, bias ? bias + 16 * t : nullptr, y + m0 * N + 16 * t);
        m0 += m;
      }
    }
  });
}

// Calls Fn::template run<M, NT>(args...) for a runtime M in [1, kRowBlock] and NT in [1, kTileGroup].
template <typename Fn, int M = 1, typename... Args>
void by_block(int64_t rows, int64_t tiles, Args... args) {
  if constexpr (M < kRowBlock) {
    if (rows > M) return by_block<Fn, M + 1>(rows, tiles, args...);
  }
  if constexpr (kTileGroup == 2) {
    if (tiles == 2) return Fn::template run<M, 2>(args...);
  }
  Fn::template run<M, 1>(args...);
}

struct TileF32 {
  template <int M, int NT>
  static void run(const float* x, int64_t xs, const float* w, int64_t ts, int64_t K, const float* b, float* y,
                  int64_t ys) {
    linear_tile_f32<M, NT>(x, xs, w, ts, K, b, y, ys);
  }
};

struct TileBF16 {  // x in bfloat16 (AVX-512 BF16) or widened to float32
  template <int M, int NT, typename X>
  static void run(const X* x, int64_t xs, const uint16_t* w, int64_t ts, int64_t K, const uint16_t* b, uint16_t* y,
                  int64_t ys) {
    linear_tile_bf16<M, NT>(x, xs, w, ts, K, b, y, ys);
  }
};

template <typename F>
void by_dtype(const at::Tensor& t, const char* op, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    f(uint16_t{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 only, got ", t.scalar_type());
  }
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": rows [rows, width] with contiguous rows expected");
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
                     reinterpret_cast<T*>(out.data_ptr()));
  });
  return out;
}

// ScreenedArgmax's decision (mstar/engines/greedy_head.py) after its bfloat16 product, in
// two passes over each row's screen: the row maximum, then the ids within twice the
// rounding bound of it, whose exact float32 logits (double sums) pick the first maximum.
// Returns each row's token, or an empty tensor when some row cannot be decided (a
// non-finite screen, no candidate or more than `max_candidates`): the caller then computes
// the logits in full.
at::Tensor screened_argmax(const at::Tensor& approx, const at::Tensor& x, const at::Tensor& weight, double dw_max,
                           double accum, double sum_max, double safety, double unit, int64_t max_candidates) {
  TORCH_CHECK(approx.device().is_cpu() && approx.dim() == 2 && approx.is_contiguous() &&
                  (approx.scalar_type() == at::kBFloat16 || approx.scalar_type() == at::kFloat),
              "screened_argmax: a contiguous bfloat16 or float32 screen [rows, vocab] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() == 2 &&
                  weight.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && x.size(0) == approx.size(0) &&
                  weight.size(0) == approx.size(1) && weight.size(1) == x.size(1),
              "screened_argmax: float32 x [rows, in] and a contiguous weight [vocab, in] expected");
  const int64_t rows = approx.size(0), vocab = approx.size(1), n = x.size(1);
  auto tokens = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* w = weight.data_ptr<float>();
  std::vector<int64_t> candidates;
  std::vector<float> group_max;
  bool decided = true;
  by_dtype(approx, "screened_argmax", [&](auto tag) {
    using T = decltype(tag);
    const T* scores = reinterpret_cast<const T*>(approx.data_ptr());
    for (int64_t r = 0; r < rows && decided; ++r) {
      const float* xr = x.data_ptr<float>() + r * x.stride(0);
      double nb = 0, nd = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double xb = round_to<uint16_t>(xr[i]), dx = xr[i] - xb;
        nb += xb * xb;
        nd += dx * dx;
      }
      const T* sr = scores + r * vocab;
      // Pass one: the maximum of every group of 256 ids (and of the row), NaN noticed.
      constexpr int64_t kGroup = 256;
      const int64_t groups = (vocab + kGroup - 1) / kGroup;
      group_max.resize(groups);
      float top = -std::numeric_limits<float>::infinity();
      bool any_nan = false;
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t lo = gi * kGroup, hi = std::min(vocab, lo + kGroup);
        float gm = -std::numeric_limits<float>::infinity();
        int64_t v = lo;
        if (hi - lo == kGroup) {
          vf16 maxima = splat(gm);
          vi16 nan = {};
          for (; v < hi; v += 16) {
            const vf16 value = load16(sr + v);
            nan |= value != value;
            maxima = select(maxima > value, maxima, value);
          }
          any_nan |= any(nan);
          gm = hmax(maxima);
        }
        for (; v < hi; ++v) {
          const float value = load(sr[v]);
          any_nan |= value != value;
          gm = std::max(gm, value);
        }
        group_max[gi] = gm;
        top = std::max(top, gm);
      }
      if (any_nan || !std::isfinite(top)) {
        decided = false;
        break;
      }
      const double base = std::sqrt(nb) * (dw_max + accum) + std::sqrt(nd) * sum_max;
      const double bound = safety * (base + unit * (std::abs(double(top)) + 2 * base));
      const float threshold = float(double(top) - 2 * bound);
      // Pass two: only the groups that reach the threshold.
      candidates.clear();
      for (int64_t gi = 0; gi < groups; ++gi) {
        if (group_max[gi] < threshold) continue;
        for (int64_t v = gi * kGroup, hi = std::min(vocab, v + kGroup); v < hi; ++v)
          if (load(sr[v]) >= threshold) candidates.push_back(v);
      }
      if (candidates.empty() || int64_t(candidates.size()) > max_candidates) {
        decided = false;
        break;
      }
      int64_t best_id = candidates[0];
      double best = -std::numeric_limits<double>::infinity();
      if (candidates.size() > 1) {
        for (const int64_t v : candidates) {
          const float* wr = w + v * n;
          double dot = 0;
          for (int64_t i = 0; i < n; ++i) dot += double(xr[i]) * double(wr[i]);
          if (dot > best) {  // ascending ids: the first maximum stays
            best = dot;
            best_id = v;
          }
        }
      }
      out[r] = best_id;
    }
  });
  return decided ? tokens : at::empty({0}, tokens.options());
}

// x [rows, n] (strided rows, contiguous within): each row's index of its first maximum,
// int64, as torch.argmax and numpy's argmax pick it (NaN counts as the largest, the first
// NaN wins). bfloat16 rows are compared as they are, widened on load: no float32 copy.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(n >= 1 && n <= (int64_t(1) << 24), "argmax_rows: rows of 1 to 2^24 values expected");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* tokens = out.data_ptr<int64_t>();
  by_dtype(x, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* base = reinterpret_cast<const T*>(x.data_ptr());
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* p = base + r * stride;
        // Per lane: its largest value and the first index holding it (a strict > keeps the
        // first), in two interleaved sets so that consecutive vectors do not wait on each other.
        const int64_t whole = n / 32 * 32;
        const vf16 lanes = lane_indices();
        vf16 best[2] = {splat(-std::numeric_limits<float>::infinity()), splat(-std::numeric_limits<float>::infinity())};
        vf16 first[2] = {lanes, lanes + 16.0f};  // float indices: exact below 2^24 (checked above)
        vi16 nan = vi16{};
        for (int64_t i = 0; i < whole; i += 32) {
          for (int h = 0; h < 2; ++h) {
            const vf16 v = load16(p + i + 16 * h);
            const vi16 better = v > best[h];
            nan |= v != v;
            best[h] = select(better, v, best[h]);
            first[h] = select(better, lanes + float(i + 16 * h), first[h]);
          }
        }
        float top = -std::numeric_limits<float>::infinity();
        int64_t index = n;
        bool has_nan = any(nan);
        if (whole) {
          top = std::max(hmax(best[0]), hmax(best[1]));
          for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 16; ++l)
              if (best[h][l] == top) index = std::min(index, int64_t(first[h][l]));
        }
        for (int64_t i = whole; i < n; ++i) {
          const float v = load(p[i]);
          has_nan |= v != v;
          if (v > top || index == n) {
            top = v;
            index = i;
          }
        }
        if (has_nan) {
          for (index = 0; index < n; ++index) {
            const float v = load(p[index]);
            if (v != v) break;
          }
        }
        tokens[r] = index;
      }
    });
  });
  return out;
}

// W [N, K] (N a multiple of 16; K even for bfloat16) -> its tiles (see linear_tile_*).
at::Tensor pack_linear(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2, "pack_linear: a CPU matrix [out, in] expected");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0, "pack_linear: out features must be a multiple of 16, got ", N);
  const auto c = w.contiguous();
  if (c.scalar_type() == at::kFloat) {
    auto out = at::empty({N / 16, K, 16}, c.options());
    const float* src = c.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for (int64_t t = 0; t < N / 16; ++t)
      for (int64_t k = 0; k < K; ++k)
        for (int l = 0; l < 16; ++l) dst[(t * K + k) * 16 + l] = src[(t * 16 + l) * K + k];
    return out;
  }
  TORCH_CHECK(c.scalar_type() == at::kBFloat16, "pack_linear: float32 or bfloat16 only, got ", c.scalar_type());
  TORCH_CHECK(K % 2 == 0, "pack_linear: bfloat16 in features must be even, got ", K);
  auto out = at::empty({N / 16, K / 2, 16, 2}, c.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(c.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t t = 0; t < N / 16; ++t)
    for (int64_t kk = 0; kk < K / 2; ++kk)
      for (int l = 0; l < 16; ++l)
        for (int e = 0; e < 2; ++e) dst[((t * (K / 2) + kk) * 16 + l) * 2 + e] = src[(t * 16 + l) * K + 2 * kk + e];
  return out;
}

namespace {

// linear's operands, checked: outputs, inputs, the bias (undefined without one).
struct Tiled {
  int64_t N, K;
  at::Tensor bias;
};

Tiled check_tiled(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  check_rows(x, "linear");
  const bool f32 = packed.dim() == 3;
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous() && (f32 || packed.dim() == 4),
              "linear: weights tiled by pack_linear, of x's dtype, expected");
  const int64_t N = packed.size(0) * 16, K = f32 ? packed.size(1) : 2 * packed.size(1);
  TORCH_CHECK(x.size(1) == K, "linear: x has ", x.size(1), " features, the weights ", K);
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == N && b.scalar_type() == x.scalar_type()),
              "linear: bias [out] of x's dtype expected");
  return {N, K, b};
}

}  // namespace

// x [rows, K] (strided rows) @ W.T + bias, W tiled by pack_linear: [rows, N] in x's dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const auto [N, K, b] = check_tiled(x, packed, bias);
  const bool f32 = packed.dim() == 3;
  auto y = at::empty({x.size(0), N}, x.options());
  const int64_t xs = x.stride(0);
  if (f32) {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "linear: float32 tiles need float32 input");
    linear_rows(x.data_ptr<float>(), x.size(0), xs, packed.data_ptr<float>(), N, K,
                b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                [&](int64_t mb, int64_t nt, const float* xr, const float* wt, const float* bt, float* yr) {
                  by_block<TileF32>(mb, nt, xr, xs, wt, 16 * K, K, bt, yr, N);
                });
    return y;
  }
  using u16 = uint16_t;
  const u16* w = reinterpret_cast<const u16*>(packed.data_ptr());
  const u16* bias_bits = b.defined() ? reinterpret_cast<const u16*>(b.data_ptr()) : nullptr;
  u16* out = reinterpret_cast<u16*>(y.data_ptr());
#if defined(MSTAR_AMX)
  if (amx_takes(x.size(0), K)) {
    linear_amx(reinterpret_cast<const u16*>(x.data_ptr()), x.size(0), xs, w, N, K, bias_bits, out);
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  const u16* xp = reinterpret_cast<const u16*>(x.data_ptr());
  const int64_t x_stride = xs;
#else
  // x widened once: the tiles then broadcast float32 inputs.
  std::vector<float> wide(x.size(0) * K);
  const u16* bits = reinterpret_cast<const u16*>(x.data_ptr());
  for (int64_t r = 0; r < x.size(0); ++r)
    for (int64_t k = 0; k < K; ++k) wide[r * K + k] = load(bits[r * xs + k]);
  const float* xp = wide.data();
  const int64_t x_stride = K;
#endif
  linear_rows(xp, x.size(0), x_stride, w, N, K, bias_bits, out,
              [&](int64_t mb, int64_t nt, const auto* xr, const u16* wt, const u16* bt, u16* yr) {
                by_block<TileBF16>(mb, nt, xr, x_stride, wt, 16 * K, K, bt, yr, N);
              });
  return y;
}

// q [rows, heads, head_dim] (rows may be strided; heads and head_dim contiguous);
// k_cache, v_cache [blocks, block_size, kv_heads, head_dim] contiguous, q's dtype;
// tables [rows, max_blocks] int64 (each row's blocks in order); lens [rows] int64 (keys per
// row, the current token's included). Returns [rows, heads, head_dim] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& tables, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: q [rows, heads, dim] and caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "decode_attention: head_dim mismatch or heads not a multiple of kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "decode_attention: q's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: caches must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && tables.is_contiguous() &&
                  lens.is_contiguous() && tables.dim() == 2 && tables.size(0) == q.size(0) && lens.numel() == q.size(0),
              "decode_attention: tables [rows, max_blocks] and lens [rows], int64, contiguous");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  for (int64_t r = 0; r < lens.numel(); ++r) {
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= tables.size(1) * block_size, "decode_attention: row ", r, "'s length ",
                lp[r], " is outside its table");
    for (int64_t b = 0; b < (lp[r] + block_size - 1) / block_size; ++b) {
      const int64_t block = tp[r * tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "decode_attention: row ", r, " names block ", block, " of ",
                  num_blocks);
    }
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(q, k_cache, v_cache, tables, lens, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<uint16_t>(q, k_cache, v_cache, tables, lens, scale, out);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

namespace {

// x @ W + b in the layout FusedLinear stored W in: tiles (pack_linear's, 3 or 4 dimensions),
// [in, out] (`transposed`) or [out, in].
at::Tensor product(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool transposed) {
  if (w.dim() > 2) return ::linear(x, w, bias);
  if (transposed) return bias.has_value() ? at::addmm(*bias, x, w) : at::mm(x, w);
  return at::linear(x, w, bias);
}

}  // namespace

// One Llama decoder layer over a batch of decode rows (one token each), in one call: the
// torch path's ops in its order and with its roundings (rms_norm, the q/k/v product, rotary
// on q and k, the keys and values written to their cache slots, decode_attention, the output
// product, add_rms_norm, gate/up, silu_mul, down), with no Python between them. `delta` is
// the previous layer's MLP output, added to `x` before the input norm (the add the torch
// path makes at the end of a layer). Returns {the residual after attention, the MLP's output}.
std::vector<at::Tensor> decode_layer(const at::Tensor& x, const c10::optional<at::Tensor>& delta,
                                     const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                                     const std::vector<at::Tensor>& weights,
                                     const std::vector<c10::optional<at::Tensor>>& biases,
                                     const std::vector<bool>& transposed, const at::Tensor& cos, const at::Tensor& sin,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                                     const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t heads) {
  TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && transposed.size() == 4,
              "decode_layer: the q/k/v, output, gate/up and down products expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == x.scalar_type(),
              "decode_layer: contiguous caches [blocks, block_size, kv_heads, dim] of x's dtype expected");
  const int64_t rows = x.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
              "decode_layer: slots [rows] int64 expected");
  at::Tensor h;
  at::Tensor residual = x;
  if (delta.has_value()) {
    auto both = ::add_rms_norm(x, *delta, input_norm, eps);
    residual = both[0];
    h = both[1];
  } else {
    h = ::rms_norm(x, input_norm, eps);
  }
  const at::Tensor qkv = product(h, weights[0], biases[0], transposed[0]);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "decode_layer: the q/k/v product's width is not "
              "(heads + 2 kv_heads) x dim");
  const at::Tensor qk = ::rotary(qkv.narrow(1, 0, (heads + kv_heads) * dim).view({rows, heads + kv_heads, dim}),
                               cos, sin);
  const at::Tensor v = qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t token_bytes = kv_heads * dim * x.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(qk.data_ptr()) + heads * dim * x.element_size();
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_row = qk.stride(0) * x.element_size(), v_row = v.stride(0) * x.element_size();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, "decode_layer: row ", r, "'s slot ", sp[r], " is outside the cache");
    std::memcpy(kc + sp[r] * token_bytes, kp + r * k_row, token_bytes);
    std::memcpy(vc + sp[r] * token_bytes, vp + r * v_row, token_bytes);
  }
  const at::Tensor attended = ::decode_attention(qk.narrow(1, 0, heads), k_cache, v_cache, tables, lens, scale);
  const at::Tensor o = product(attended.view({rows, heads * dim}), weights[1], biases[1], transposed[1]);
  auto after = ::add_rms_norm(residual, o, post_norm, eps);
  const at::Tensor gate_up = product(after[1], weights[2], biases[2], transposed[2]);
  return {after[0], product(::silu_mul(gate_up), weights[3], biases[3], transposed[3])};
}

// A Llama decoder's decode step in one call: the embedding rows of the step's tokens, the
// rotary tables at their positions (rounded to the weights' dtype, the first half of the sine
// negated, as the torch path's `signed_sin`), every layer (decode_layer), then the final
// residual add and norm. Built once per model with its weights; `forward` takes the step's
// tokens, positions, each layer's key and value caches (in layer order), slots, block tables
// and lengths, and returns the final hidden states [rows, hidden]. The GIL is released for
// the whole step, not taken back between layers.
class DecodeStack {
 public:
  DecodeStack(at::Tensor embed, at::Tensor rope_cos, at::Tensor rope_sin, at::Tensor final_norm, double eps,
              double scale, int64_t heads)
      : embed_(std::move(embed)), cos_(std::move(rope_cos)), sin_(std::move(rope_sin)),
        final_norm_(std::move(final_norm)), eps_(eps), scale_(scale), heads_(heads) {
    TORCH_CHECK(embed_.dim() == 2 && cos_.dim() == 2 && cos_.sizes() == sin_.sizes() && cos_.size(1) % 2 == 0,
                "DecodeStack: an embedding [vocab, hidden] and rotary tables [positions, head_dim] expected");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps, std::vector<at::Tensor> weights,
                 std::vector<c10::optional<at::Tensor>> biases, std::vector<bool> transposed) {
    TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && transposed.size() == 4,
                "DecodeStack.add_layer: the q/k/v, output, gate/up and down products expected");
    layers_.push_back({std::move(input_norm), std::move(post_norm), eps, std::move(weights), std::move(biases),
                       std::move(transposed)});
  }

  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const std::vector<at::Tensor>& caches,
                     const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens) const {
    TORCH_CHECK(!layers_.empty() && caches.size() == 2 * layers_.size(),
                "DecodeStack.forward: a key and a value cache per layer expected");
    TORCH_CHECK(ids.dim() == 1 && positions.sizes() == ids.sizes(),
                "DecodeStack.forward: ids and positions [rows] expected");
    at::Tensor x = embed_.index_select(0, ids);
    const at::Tensor cos = cos_.index_select(0, positions).to(x.scalar_type());
    const at::Tensor sin = sin_.index_select(0, positions).to(x.scalar_type());
    sin.narrow(1, 0, sin.size(1) / 2).neg_();  // a fresh tensor either way (index_select's)
    c10::optional<at::Tensor> delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto out = ::decode_layer(x, delta, layer.input_norm, layer.post_norm, layer.eps, layer.weights, layer.biases,
                                layer.transposed, cos, sin, caches[2 * i], caches[2 * i + 1], slots, tables, lens,
                                scale_, heads_);
      x = out[0];
      delta = out[1];
    }
    return ::add_rms_norm(x, *delta, final_norm_, eps_)[1];
  }

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    double eps;  // both norms'
    std::vector<at::Tensor> weights;
    std::vector<c10::optional<at::Tensor>> biases;
    std::vector<bool> transposed;
  };
  at::Tensor embed_, cos_, sin_, final_norm_;
  double eps_, scale_;  // the final norm's epsilon, the attention's scale
  int64_t heads_;
  std::vector<Layer> layers_;
};

// The greedy head in one call each, so the step's thread takes the GIL back once, not
// between the product and the choice (the event loop holds it meanwhile, streaming the last
// step's tokens): linear_argmax is argmax_rows(linear(x, tiles, bias)); screened_tokens is
// screened_argmax over the screen linear(bf16(x), screen tiles) (ScreenedArgmax's decision).
at::Tensor linear_argmax(const at::Tensor& x, const at::Tensor& tiles, const c10::optional<at::Tensor>& bias) {
#if defined(MSTAR_AMX)
  // On AMX the outputs are never written: each row's maximum is kept as the tiles come out.
  if (x.scalar_type() == at::kBFloat16) {
    const auto [N, K, b] = check_tiled(x, tiles, bias);
    if (amx_takes(x.size(0), K)) {
      auto tokens = at::empty({x.size(0)}, x.options().dtype(at::kLong));
      linear_amx(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), x.stride(0),
                 reinterpret_cast<const uint16_t*>(tiles.data_ptr()), N, K,
                 b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr, nullptr,
                 tokens.data_ptr<int64_t>());
      return tokens;
    }
  }
#endif
  return ::argmax_rows(::linear(x, tiles, bias));
}

at::Tensor screened_tokens(const at::Tensor& x, const at::Tensor& screen, const at::Tensor& weight, double dw_max,
                           double accum, double sum_max, double safety, double unit, int64_t max_candidates) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "screened_tokens: float32 x [rows, in] expected");
  const at::Tensor approx = ::linear(x.to(at::kBFloat16), screen, c10::nullopt);
  return ::screened_argmax(approx, x, weight, dw_max, accum, sum_max, safety, unit, max_candidates);
}

// Each call releases the GIL while it runs, as torch's own ops do: the event loop's Python
// goes on beside it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("decode_attention", &decode_attention, "Decode attention over a paged KV cache (see the source).", release());
  m.def("rms_norm", &rms_norm, "RMSNorm of rows (see the source).", release());
  m.def("add_rms_norm", &add_rms_norm, "The residual add and RMSNorm of rows (see the source).", release());
  m.def("rotary", &rotary, "Rotary embedding of heads (see the source).", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up (see the source).", release());
  m.def("screened_argmax", &screened_argmax, "ScreenedArgmax's candidates and exact choice (see the source).",
        release());
  m.def("decode_layer", &decode_layer, "One Llama decoder layer over decode rows (see the source).", release());
  py::class_<DecodeStack>(m, "DecodeStack", "A Llama decoder's decode step in one call (see the source).")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, double, int64_t>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, release());
  m.def("linear_argmax", &linear_argmax, "argmax_rows(linear(x, tiles, bias)) (see the source).", py::arg("x"),
        py::arg("tiles"), py::arg("bias") = py::none(), release());
  m.def("screened_tokens", &screened_tokens, "ScreenedArgmax's screen and choice in one call (see the source).",
        release());
  m.def("argmax_rows", &argmax_rows, "Each row's first maximum (see the source).", release());
  m.def("pack_linear", &pack_linear, "Tile a weight [out, in] for linear (see the source).", release());
  m.def("linear", &linear, "x @ W.T + b over tiled weights (see the source).", py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none(), release());
}
