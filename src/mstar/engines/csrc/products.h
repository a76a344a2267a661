// linear / pack_linear: x @ W.T (+ b) for the few rows of a decode step, over weights packed
// in tiles of 16 outputs: one pass over the weights serves up to 16 rows, each tile's 16
// sums held in a register (float32: a multiply-add per input; bfloat16: AVX-512 BF16's
// pairwise dot products, AMX tile products from 4 rows where the CPU has AMX, or elsewhere
// each weight widened to float32 on load), accumulated in float32 and rounded once. At these
// row counts the products cost a few microseconds where oneDNN's calls cost about twenty;
// which layout a weight takes is still timed (`choose_layout`).
//
// argmax_rows, linear_argmax, screened_argmax / screened_tokens: the greedy head's choice.

#pragma once

#include "simd.h"

namespace {

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
// Without AVX-512 BF16: each weight pair widened to float32, two multiply-adds per row; x
// arrives widened to float32 (once per product, not once per tile). The even weights go
// through every row before the odd ones are widened (from a second load): with both held, 6
// rows' sums and the weights took 17 of AVX2's 16 registers, and the spills cost 30 % at 512
// rows (67 against 96 GFLOP/s on Zen 3). Each row's sums add in the same order either way.
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
    const uint16_t* wk = w + 32 * kk;
    vf16 half[NT];
    for (int n = 0; n < NT; ++n) half[n] = bitcast<vf16>(load_words(wk + n * tile_stride) << 16);
    for (int m = 0; m < M; ++m) {
      const float x0 = x[m * x_stride + 2 * kk];
      for (int n = 0; n < NT; ++n) acc[m][n] += x0 * half[n];
    }
    for (int n = 0; n < NT; ++n) half[n] = bitcast<vf16>(load_words(wk + n * tile_stride) & 0xffff0000u);
    for (int m = 0; m < M; ++m) {
      const float x1 = x[m * x_stride + 2 * kk + 1];
      for (int n = 0; n < NT; ++n) acc[m][n] += x1 * half[n];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NT; ++n) store16(y + m * y_stride + 16 * n, acc[m][n]);
}
#endif

#if defined(MSTAR_AMX)
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
// Its tiles (configure_tiles(m)): 0-1: the float32 sums of M rows by two adjacent weight
// tiles; 2-3: M rows of the input, 32 features each (two feature blocks in flight); 4-7:
// weights, 16 feature pairs by 16 outputs by 2 (pack_linear's bfloat16 layout is the tile's
// own, so each weight tile is 1 KB read as stored), two per feature block. Loads of the next
// block overlap the products of this one: with one input tile, each load waited for the
// products before it (3x slower).
void linear_amx_block(int m, int nt, const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K,
                      const uint16_t* bias, uint16_t* y, int64_t y_stride, RowMax* best, int32_t col,
                      int64_t second = 0) {
  _tile_zero(0);
  _tile_zero(1);
  if (second == 0) second = 16 * K;  // the second weight tile: by default the next one
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

// 32 rows (two row tiles) of x by `nt` (1 or 2) adjacent weight tiles, for many rows: each
// weight tile loaded serves both row tiles (half the weight traffic of 16-row blocks). Tiles
// 0-3: sums (row tile r, weight tile n at 2r + n); 4-5: the rows' 32 features; 6-7: weights.
// A row's sums add the same tile products in the same order as linear_amx_block's.
void linear_amx_block32(int nt, const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K,
                        const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t second = 0) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  if (second == 0) second = 16 * K;  // the second weight tile: by default the next one
  const int64_t x_bytes = x_stride * 2;
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, x + k, x_bytes);
    _tile_loadd(6, w + 16 * k, 64);
    _tile_loadd(5, x + 16 * x_stride + k, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (nt > 1) {
      _tile_loadd(7, w + 16 * k + second, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[4][16][16];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
  for (int n = 0; n < nt; ++n) {
    const __m512 b = bias16(bias, n);
    for (int r = 0; r < 32; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums[2 * (r / 16) + n][r % 16]), b));
      std::memcpy(y + r * y_stride + 16 * n, &rounded, sizeof rounded);
    }
  }
}

constexpr int64_t kAmxTileGroup = 2;
// Below 4 rows the tile products lose to AVX-512 BF16's (1.3-1.5x slower at 1 row; level at 2-3).
constexpr int64_t kAmxMinRows = 4;

// Whether linear's bfloat16 product of `rows` rows by K features runs on AMX. `invariant`
// (deterministic serving): from one row, so a row's sums never depend on how many rows share
// the product (AMX and AVX-512 BF16 add a row's products in different orders).
bool amx_takes(int64_t rows, int64_t K, bool invariant = false) {
  return (invariant || rows >= kAmxMinRows) && K % 32 == 0 && amx_permitted();
}

// The order of AMX products over rows and weight groups [begin, end) of `group_bytes` each:
// with `many` (a block of 32 rows at m0 by group g) and 32 rows or more, rows and groups a few
// at a time (about 512 and 256 KiB: both stay in L2 while the other passes); the rest (or all,
// without `many`) in blocks of up to 16 rows, `few(m, m0, g)`.
template <typename Many, typename Few>
void amx_blocks(int64_t rows, int64_t begin, int64_t end, int64_t K, int64_t group_bytes, const Many* many,
                const Few& few) {
  int64_t m0 = 0;
  if (many != nullptr && rows >= 32) {
    const int64_t span = std::max<int64_t>(1, (256 << 10) / group_bytes);
    const int64_t stripe = std::max<int64_t>(32, (512 << 10) / (K * 2) / 32 * 32);
    const int64_t whole = rows / 32 * 32;
    configure_tiles(16);
    for (int64_t r0 = 0; r0 < whole; r0 += stripe)
      for (int64_t g0 = begin; g0 < end; g0 += span)
        for (m0 = r0; m0 < std::min(whole, r0 + stripe); m0 += 32)
          for (int64_t g = g0; g < std::min(end, g0 + span); ++g) (*many)(m0, g);
    m0 = whole;
  }
  for (; m0 < rows; m0 += 16) {
    const int m = int(std::min<int64_t>(16, rows - m0));
    configure_tiles(m);
    for (int64_t g = begin; g < end; ++g) few(m, m0, g);
  }
}

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
  // A group's weights, and its products (a tile product of 16 rows costs about a weight load)
  const int64_t group_bytes = kAmxTileGroup * 16 * K * 2 * (1 + rows / 16);
  at::parallel_for(0, groups, grain_for(group_bytes), [&](int64_t begin, int64_t end) {
    std::vector<RowMax> best(tokens ? rows : 0);
    const auto many = [&](int64_t m0, int64_t g) {  // many rows: in blocks of 32, the rest below
      const int64_t t = g * kAmxTileGroup;
      linear_amx_block32(int(std::min(kAmxTileGroup, tiles - t)), x + m0 * x_stride, x_stride, w + t * 16 * K, K,
                         bias ? bias + 16 * t : nullptr, y + m0 * N + 16 * t, N);
    };
    amx_blocks(rows, begin, end, K, kAmxTileGroup * 16 * K * 2, tokens ? nullptr : &many,
               [&](int m, int64_t m0, int64_t g) {
                 const int64_t t = g * kAmxTileGroup;
                 linear_amx_block(m, int(std::min(kAmxTileGroup, tiles - t)), x + m0 * x_stride, x_stride,
                                  w + t * 16 * K, K, bias ? bias + 16 * t : nullptr,
                                  tokens ? nullptr : y + m0 * N + 16 * t, N, tokens ? best.data() + m0 : nullptr,
                                  int32_t(16 * t));
               });
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

// Rows in blocks of up to kRowBlock (as even as they come: 16 rows in 6 + 5 + 5, not 6 + 6 + 4)
// by weight groups [0, groups) of `group_bytes` each (a group's weights stay in L1 across the
// blocks of a stripe): `block(m, m0, g)` for each. Rows and groups a few at a time (about
// 256 KiB of each): both stay in L2 while the other passes (a prompt's rows, read whole for
// each group, came from memory every time). Groups spread over threads.
template <typename Block>
void row_blocks(int64_t rows, int64_t row_bytes, int64_t groups, int64_t group_bytes, const Block& block) {
  const int64_t span = std::max<int64_t>(1, (256 << 10) / group_bytes);
  const int64_t stripe = std::max<int64_t>(1, (256 << 10) / row_bytes / kRowBlock) * kRowBlock;
  // A group's weights, and its products (a vector product of 4 rows costs about a weight load)
  at::parallel_for(0, groups, grain_for(group_bytes * (1 + rows / 4)), [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += stripe) {
      const int64_t r1 = std::min(rows, r0 + stripe), blocks = (r1 - r0 + kRowBlock - 1) / kRowBlock;
      for (int64_t g0 = begin; g0 < end; g0 += span)
        for (int64_t g = g0; g < std::min(end, g0 + span); ++g)
          for (int64_t b = 0, m0 = r0; b < blocks; ++b) {
            const int64_t m = (r1 - m0) / (blocks - b);
            block(m, m0, g);
            m0 += m;
          }
    }
  });
}

// linear's rows by tiles in groups of kTileGroup (see row_blocks).
template <typename X, typename T, typename Tile>
void linear_rows(const X* x, int64_t rows, int64_t x_stride, const T* w, int64_t N, int64_t K, const T* bias, T* y,
                 Tile&& tile) {
  const int64_t tiles = N / 16, per_tile = 16 * K, groups = (tiles + kTileGroup - 1) / kTileGroup;
  row_blocks(rows, K * int64_t(sizeof(X)), groups, kTileGroup * per_tile * int64_t(sizeof(T)),
             [&](int64_t m, int64_t m0, int64_t g) {
               const int64_t t = g * kTileGroup, nt = std::min(kTileGroup, tiles - t);
               tile(m, nt, x + m0 * x_stride, w + t * per_tile, bias ? bias + 16 * t : nullptr, y + m0 * N + 16 * t);
             });
}

// bfloat16 rows widened to float32 once, for tiles that broadcast float32 inputs (without
// AVX-512 BF16): [rows, K] contiguous.
inline std::vector<float> widened_rows(const uint16_t* bits, int64_t rows, int64_t stride, int64_t K) {
  std::vector<float> wide(rows * K);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) wide[r * K + k] = load(bits[r * stride + k]);
  return wide;
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

}  // namespace

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
    at::parallel_for(0, rows, grain_for(n * int64_t(sizeof(T))), [&](int64_t begin, int64_t end) {
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
// Each output is one thread's sum over the inputs in order, whatever the number of rows or
// threads; with `invariant`, bfloat16 rows also take one instruction path at every row count.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  bool invariant) {
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
  if (amx_takes(x.size(0), K, invariant)) {
    linear_amx(reinterpret_cast<const u16*>(x.data_ptr()), x.size(0), xs, w, N, K, bias_bits, out);
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  const u16* xp = reinterpret_cast<const u16*>(x.data_ptr());
  const int64_t x_stride = xs;
#else
  const std::vector<float> wide = widened_rows(reinterpret_cast<const u16*>(x.data_ptr()), x.size(0), xs, K);
  const float* xp = wide.data();
  const int64_t x_stride = K;
#endif
  linear_rows(xp, x.size(0), x_stride, w, N, K, bias_bits, out,
              [&](int64_t mb, int64_t nt, const auto* xr, const u16* wt, const u16* bt, u16* yr) {
                by_block<TileBF16>(mb, nt, xr, x_stride, wt, 16 * K, K, bt, yr, N);
              });
  return y;
}

namespace {

// The gated products of linear_silu_mul: pair t is gate tile t and up tile pairs + t of a
// [gate; up] weight (2 x pairs tiles). Each block's gate and up outputs go to a small buffer
// (as linear rounds them) and from there through silu_mul_rows to out [rows, 16 x pairs]:
// the [rows, 2 x inner] product is never written whole, nor read back.
template <typename X, typename T>
void gated_rows(const X* x, int64_t rows, int64_t x_stride, const T* w, int64_t pairs, int64_t K, T* out) {
  using Tile = std::conditional_t<std::is_same_v<T, float>, TileF32, TileBF16>;
  const int64_t per_tile = 16 * K, inner = 16 * pairs;
  row_blocks(rows, K * int64_t(sizeof(X)), pairs, 2 * per_tile * int64_t(sizeof(T)), [&](int64_t m, int64_t m0,
                                                                                          int64_t p) {
    alignas(64) T both[kRowBlock * 32];  // the block's gate (lanes 0-15) and up (16-31) outputs
    const X* xr = x + m0 * x_stride;
    const T* gate = w + p * per_tile;
    if constexpr (kTileGroup > 1) {  // gate and up as a group of two tiles
      by_block<Tile>(m, 2, xr, x_stride, gate, pairs * per_tile, K, nullptr, both, int64_t(32));
    } else {
      by_block<Tile>(m, 1, xr, x_stride, gate, per_tile, K, nullptr, both, int64_t(32));
      by_block<Tile>(m, 1, xr, x_stride, gate + pairs * per_tile, per_tile, K, nullptr, both + 16, int64_t(32));
    }
    silu_mul_rows<T>(both, m, 16, 32, out + m0 * inner + 16 * p, inner);
  });
}

#if defined(MSTAR_AMX)
// gated_rows on AMX: blocks of 32 rows (then 16) by a gate tile and its up tile.
void gated_amx(const uint16_t* x, int64_t rows, int64_t x_stride, const uint16_t* w, int64_t pairs, int64_t K,
               uint16_t* out) {
  const int64_t per_tile = 16 * K, inner = 16 * pairs, second = pairs * per_tile;
  const int64_t pair_bytes = 2 * per_tile * 2 * (1 + rows / 16);
  at::parallel_for(0, pairs, grain_for(pair_bytes), [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t both[32 * 32];
    const auto many = [&](int64_t m0, int64_t p) {
      linear_amx_block32(2, x + m0 * x_stride, x_stride, w + p * per_tile, K, nullptr, both, 32, second);
      silu_mul_rows<uint16_t>(both, 32, 16, 32, out + m0 * inner + 16 * p, inner);
    };
    amx_blocks(rows, begin, end, K, 2 * per_tile * 2, &many, [&](int m, int64_t m0, int64_t p) {
      linear_amx_block(m, 2, x + m0 * x_stride, x_stride, w + p * per_tile, K, nullptr, both, 32, nullptr, 0, second);
      silu_mul_rows<uint16_t>(both, m, 16, 32, out + m0 * inner + 16 * p, inner);
    });
    _tile_release();
  });
}
#endif

}  // namespace

// silu_mul(linear(x, packed)) without the product's [rows, 2 x inner] outputs: packed is a
// [gate; up] weight [2 x inner, in] tiled by pack_linear (inner a multiple of 16), no bias.
// The same values as the two calls, rounding for rounding.
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& packed) {
  [[maybe_unused]] const auto [N, K, b] = check_tiled(x, packed, c10::nullopt);
  TORCH_CHECK(N % 32 == 0, "linear_silu_mul: gate and up of 16 x n outputs each expected, got ", N, " outputs");
  const int64_t pairs = N / 32, xs = x.stride(0);
  auto y = at::empty({x.size(0), N / 2}, x.options());
  if (packed.dim() == 3) {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "linear_silu_mul: float32 tiles need float32 input");
    gated_rows(x.data_ptr<float>(), x.size(0), xs, packed.data_ptr<float>(), pairs, K, y.data_ptr<float>());
    return y;
  }
  using u16 = uint16_t;
  const u16* w = reinterpret_cast<const u16*>(packed.data_ptr());
  u16* out = reinterpret_cast<u16*>(y.data_ptr());
#if defined(MSTAR_AMX)
  if (amx_takes(x.size(0), K)) {
    gated_amx(reinterpret_cast<const u16*>(x.data_ptr()), x.size(0), xs, w, pairs, K, out);
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  gated_rows(reinterpret_cast<const u16*>(x.data_ptr()), x.size(0), xs, w, pairs, K, out);
#else
  const std::vector<float> wide = widened_rows(reinterpret_cast<const u16*>(x.data_ptr()), x.size(0), xs, K);
  gated_rows(wide.data(), x.size(0), K, w, pairs, K, out);
#endif
  return y;
}

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
  return ::argmax_rows(::linear(x, tiles, bias, false));
}

// (`invariant`: the screen's product is linear's invariant one, so whether a row is decided
// does not depend on the other rows.)
at::Tensor screened_tokens(const at::Tensor& x, const at::Tensor& screen, const at::Tensor& weight, double dw_max,
                           double accum, double sum_max, double safety, double unit, int64_t max_candidates,
                           bool invariant) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "screened_tokens: float32 x [rows, in] expected");
  const at::Tensor approx = ::linear(x.to(at::kBFloat16), screen, c10::nullopt, invariant);
  return ::screened_argmax(approx, x, weight, dw_max, accum, sum_max, safety, unit, max_candidates);
}
