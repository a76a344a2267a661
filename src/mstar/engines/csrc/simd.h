// The vectors every kernel computes with, and what they share: sixteen float32 lanes (vf16)
// with their loads, stores, roundings, exp and horizontal sums; the dtype dispatch.
//
// The vectors hold 16 floats: one AVX-512 register where the CPU has them, a pair of AVX2
// registers (or narrower) elsewhere (see vf16).

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
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
#include <utility>
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

// How many vf16 sums a kernel's register block may hold beside its operands: 16 of the 32
// AVX-512 registers; 6 vf16 (12 of the 16 registers) where a vf16 is two AVX2 halves. A block
// past this spills its sums to the stack at every multiply-add.
#if defined(__AVX512F__)
constexpr int kBlockSums = 16;
#else
constexpr int kBlockSums = 6;
#endif

// *p in every lane, loaded as such (a broadcast load, no shuffle).
inline vf16 broadcast(const float* p) {
#if defined(__AVX512F__)
  return (vf16)_mm512_set1_ps(*p);
#else
  return splat(*p);
#endif
}

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

// Whether any lane of v is above x.
inline bool any_above(vf16 v, float x) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(x), _CMP_GT_OQ) != 0;
#else
  return any(v > x);
#endif
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

// exp of softmax arguments (x <= 88: scores less a maximum, which they may pass a little);
// x below -87 gives 0.
inline vf16 exp_or_zero(vf16 x) { return select(x < -87.0f, vf16{}, exp16(x)); }

constexpr float kLn2 = 0.6931471805599453f, kLog2e = 1.4426950408889634f;

// How far a score may pass the running maximum of an online softmax before the maximum is
// raised (in the scores' units, natural or base 2): most tiles then need no horizontal
// maximum, a long chain of dependent steps, and their weights stay below e^8 (or 2^8).
constexpr float kSlack = 8.f;

#if defined(__AVX512F__)
// 2^y for finite -126 <= y <= 127: 2^round(y) times a degree-6 Taylor polynomial of 2^f,
// |f| <= 1/2 (relative error below 2e-7).
inline vf16 exp2_finite(vf16 y) {
  const __m512 n = _mm512_roundscale_ps((__m512)y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps((__m512)y, n), _mm512_set1_ps(kLn2));  // e^(f ln 2)
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return (vf16)_mm512_scalef_ps(p, n);
}
#endif

// 2^y for softmax arguments in base 2 (y <= 127: scores less a maximum they may pass a
// little); y below -126, -inf and NaN give 0. (Never a subnormal: producing one, or
// underflowing to zero, costs a microcode assist of a hundred cycles and more on x86.)
// Elsewhere the same polynomial, 2^round(y) made from its exponent bits (the arguments are
// normal): a third fewer operations than e^(y ln 2) by way of exp16's clamps and two-step
// reduction (prefill on AVX2 spent a third of its time in them).
inline vf16 exp2_or_zero(vf16 y) {
  const auto normal = y > -126.f;
  y = select(normal, y, splat(-126.f));
#if defined(__AVX512F__)
  return select(normal, exp2_finite(y), vf16{});
#else
  const vf16 n = (y + kRoundEven) - kRoundEven;
  const vf16 f = (y - n) * kLn2;
  vf16 p = splat(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * f + c;
  return select(normal, p * bitcast<vf16>((convert<vi16>(n) + 127) << 23), vf16{});
#endif
}

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

// GCC's _tile_loadd does not tell the compiler that it reads memory, so stores before it may
// be moved past it: call this between writing a buffer and loading it into a tile.
inline void before_tile_loads() { asm volatile("" ::: "memory"); }

// Every tile 64 bytes wide; tiles 0-3 of m rows, 4-7 of 16 (the products' and prefill's).
void configure_tiles(int m) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 4 ? m : 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}
#endif

// The grain of at::parallel_for for units of about `unit_bytes` of memory each (their weights,
// keys and values, counted with what their arithmetic costs): a thread takes at least
// kParallelBytes of work, so small work (a small model's decode step) stays on the calling
// thread instead of paying for a team of threads it cannot use.
constexpr int64_t kParallelBytes = int64_t(1) << 22;

inline int64_t grain_for(int64_t unit_bytes) {
  return std::max<int64_t>(1, kParallelBytes / std::max<int64_t>(1, unit_bytes));
}

// Run fn(begin, end) over items [0, costs.size()) split among the threads into contiguous runs
// of about equal cost (costs in the units of grain_for), not equal counts: a causal prompt's
// later tiles see more keys than its first. Work under kParallelBytes a thread stays on the
// calling thread.
template <typename F>
void parallel_by_cost(const std::vector<int64_t>& costs, F&& fn) {
  const int64_t n = int64_t(costs.size());
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const int64_t parts = std::min<int64_t>({int64_t(at::get_num_threads()), n, std::max<int64_t>(1, prefix[n] / kParallelBytes)});
  if (parts <= 1) {
    if (n > 0) fn(int64_t(0), n);
    return;
  }
  // Part p's first item: the first whose cost starts at or after p / parts of the total.
  std::vector<int64_t> starts(parts + 1, n);
  for (int64_t p = 0; p < parts; ++p)
    starts[p] = std::lower_bound(prefix.begin(), prefix.end() - 1, prefix[n] * p / parts) - prefix.begin();
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      if (starts[p] < starts[p + 1]) fn(starts[p], starts[p + 1]);
  });
}

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
