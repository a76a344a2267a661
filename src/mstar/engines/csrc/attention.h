// decode_attention: one query token per sequence against its keys and values read in place
// from the paged cache [blocks, block_size, kv_heads, head_dim] through its block table.
// A row's keys are taken in ranges of kRangeKeys (whole blocks); a work item is one range of
// one row, its KV heads together (or one KV head each when there are few ranges for the
// threads), computed in one pass over 16-key tiles: a tile's keys scored for every query head
// of their KV head (one horizontal-add tree per head), its exponentials taken against a
// running maximum (online softmax), its values weighed for all those heads at once, all in
// float32, each key and value read once, while the tiles ahead (and the next item's first)
// are fetched. Without AVX-512 a tile is read in memory order instead, a token's KV heads
// together (see attend_range): the core's prefetchers follow that order. A row of one range
// is written out directly; a longer row's ranges (their maxima, sums and weighted values) are
// merged after, so one long sequence's decode spreads over every thread. float32 and bfloat16
// caches are read as they are stored, so a bfloat16 cache moves half the bytes: its keys
// scored as they are (AMX tile products or AVX-512 BF16 dot products of the stored bits) or
// widened on load, its values widened.

#pragma once

#include "simd.h"

namespace {

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

// Whether bfloat16 scores are dot products of the stored bits (AVX-512 BF16: 32 products a
// instruction, each exact in float32, summed in pairs), with no key widened: the query's
// bits are kept as they are, the scale applied to the scores.
template <int J, typename T>
constexpr bool kDotsOfBits =
#if defined(__AVX512BF16__)
    std::is_same_v<T, uint16_t> && J % 2 == 0;
#else
    false;
#endif

#if defined(__AVX512BF16__)
// q's bits (J / 2 vectors of 32 bfloat16, stored as vf16) against a key's.
template <int J>
inline vf16 dot_bits(const vf16* q, const uint16_t* k) {
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < J / 2; ++j)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)q[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
  return (vf16)acc;
}
#endif

// A key's products with the per_kv queries of its KV head (q: J vectors each, as attend_range
// holds them) before the horizontal add, to out[0], out[16], ...: the vf16 of products with
// AVX-512, elsewhere its two AVX2 halves added (sixteen keys' vf16 would fill every register
// twice over). The key is loaded (and widened) once for all its queries; with kDotsOfBits
// its stored bits are multiplied as they are.
#if defined(__AVX512F__)
using Partial = vf16;
#else
using Partial = vf8;
#endif

template <int J, typename T>
inline void partial_scores(const vf16* q, const T* k, int64_t per_kv, Partial* out) {
#if defined(__AVX512BF16__)
  if constexpr (kDotsOfBits<J, T>) {
    for (int64_t e = 0; e < per_kv; ++e) out[16 * e] = dot_bits<J>(q + e * J, k);
    return;
  }
#endif
  vf16 kv[J];
  load_row<J>(k, kv);
  for (int64_t e = 0; e < per_kv; ++e) {
    const vf16* qe = q + e * J;
    vf16 s = qe[0] * kv[0];
    for (int j = 1; j < J; ++j) s += qe[j] * kv[j];
#if defined(__AVX512F__)
    out[16 * e] = s;
#else
    out[16 * e] = s.lo + s.hi;
#endif
  }
}

// The scores of 16 keys from their partial_scores (16 apart), lane r key r's: one horizontal-add tree.
inline vf16 sum_partials(const Partial* a) {
#if defined(__AVX512F__)
  return sum16(a);
#else
  return {sum8(a), sum8(a + 8)};
#endif
}

#if defined(MSTAR_AMX)
// Scores of 16 keys lying `stride` bytes apart (one block's) for the query heads of `count` <= 4
// KV heads, D elements apart from `first`, into tiles 0 to count - 1 (each [16 keys][16 heads]):
// one tile product per 32 features of a KV head's keys (tiles 4, 6) by its heads' queries^T
// (tiles 5, 7; qt: per KV head J / 2 steps of [16 feature pairs][16 heads], the queries' bits),
// where AVX-512 BF16 takes a dot product and a horizontal sum per key and head. The products
// run while the caller's vector code works on the tiles before (see store_score_tiles).
template <int J>
inline void score_tiles_amx(const uint16_t* first, int64_t stride, const uint32_t* qt, int64_t count) {
  constexpr int D = 16 * J, Q = 256 * (J / 2);  // Q: one KV head's queries^T
  _tile_zero(0);
  if (count > 1) _tile_zero(1);
  if (count > 2) _tile_zero(2);
  if (count > 3) _tile_zero(3);
  for (int s = 0; s < J / 2; ++s) {
    const uint16_t* k = first + 32 * s;
    const uint32_t* w = qt + 256 * s;
    _tile_loadd(4, k, stride);
    _tile_loadd(5, w, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (count > 1) {
      _tile_loadd(6, k + D, stride);
      _tile_loadd(7, w + Q, 64);
      _tile_dpbf16ps(1, 6, 7);
    }
    if (count > 2) {
      _tile_loadd(4, k + 2 * D, stride);
      _tile_loadd(5, w + 2 * Q, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (count > 3) {
      _tile_loadd(6, k + 3 * D, stride);
      _tile_loadd(7, w + 3 * Q, 64);
      _tile_dpbf16ps(3, 6, 7);
    }
  }
}

// Tiles 0 to count - 1 to scores [count][16 keys][16 heads].
inline void store_score_tiles(float* scores, int64_t count) {
  _tile_stored(0, scores, 64);
  if (count > 1) _tile_stored(1, scores + 256, 64);
  if (count > 2) _tile_stored(2, scores + 512, 64);
  if (count > 3) _tile_stored(3, scores + 768, 64);
}

// Head e's scores of 16 keys from a stored [16 keys][16 heads] tile.
inline vf16 head_scores(const float* tile, int64_t e) {
  const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  return (vf16)_mm512_i32gather_ps(rows, tile + e, 4);
}

// Whether decode_attention scores bfloat16 keys in tile products: 16 keys of a tile must lie in
// one block (tiles start at multiples of 16 keys), and a KV head serve at most 16 query heads.
template <int J, typename T>
bool decode_tiles_amx(int64_t block_size, int64_t group) {
  return std::is_same_v<T, uint16_t> && J % 2 == 0 && block_size % 16 == 0 && group <= 16 && amx_permitted();
}
#endif

// A hint to bring the line at p into L2 (an asm statement: GCC drops __builtin_prefetch from
// loops that do nothing else).
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Prefetch one token's D values (its KV head's) at p: a single thread keeps only as many
// cache misses in flight as its reorder window holds loads, fewer than memory needs to stream,
// and the hardware prefetchers know nothing of block tables (nor cross a page).
template <int D, typename T>
inline void prefetch_token(const T* p) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t line = 0; line < int64_t(D * sizeof(T)); line += 64) prefetch_l2(bytes + line);
}

// Keys of a row are scored in ranges of whole blocks, about this many keys each: a range's
// softmax is kept apart (its maximum, the sum of its exponentials and its weighted values) and
// a row's ranges are merged in order, in float32. Ranges depend on the row's length and the
// block size alone, so a row gives the same result whatever rows are beside it and however
// many threads run, while one long row's ranges spread over every thread.
constexpr int64_t kRangeKeys = 256;

// How far ahead of the tile being computed its keys and values are fetched (in keys): one
// tile's worth of prefetches per tile computed, so memory streams while the core computes.
constexpr int64_t kAheadKeys = 32;

// Without AVX-512 a tile's keys are taken in runs of this many (see attend_range), chosen by
// measurement on Zen 3: one float32 key, two bfloat16 keys (runs of four read 10-20 % slower,
// a KV head at a time through the tile up to 35 % slower).
#if !defined(__AVX512F__)
template <typename T>
constexpr int64_t kRunKeys = 4 / int64_t(sizeof(T));
#endif

// The offsets (elements) of a row's tokens [t, t + n) in a paged cache of `token_stride`
// elements a token, through its block table, plus `head`: one division for the run, not one a
// token.
inline void token_offsets(const int64_t* table, int64_t block_size, int64_t token_stride, int64_t head, int64_t t,
                          int64_t n, int64_t* out) {
  int64_t block = t / block_size, within = t % block_size;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = (table[block] * block_size + within) * token_stride + head;
    if (++within == block_size) {
      within = 0;
      ++block;
    }
  }
}

// The rows of a row's tokens t0 .. t0 + n - 1 in a paged cache (`table`), token_stride apart.
template <typename T>
void token_rows(const T* cache, int64_t block_size, int64_t token_stride, const int64_t* table, int64_t t0,
                int64_t n, const T** rows) {
  int64_t offsets[16];
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t m = std::min<int64_t>(16, n - i);
    token_offsets(table, block_size, token_stride, 0, t0 + i, m, offsets);
    for (int64_t j = 0; j < m; ++j) rows[i + j] = cache + offsets[j];
  }
}

// Where an item reads: a row's keys [begin, end) in blocks of block_size tokens token_stride
// elements apart, through its block table; `head` the first KV head's offset (elements).
struct Geometry {
  int64_t block_size, token_stride, begin, end;
  const int64_t* table;
  int64_t head;

  // The offset of key t of the row (its first KV head's first element).
  int64_t offset(int64_t t) const { return table[t / block_size] * block_size * token_stride + t % block_size * token_stride + head; }

  // The offsets of keys [t, t + n) of the row (their first KV head's first element), 0 < n <= 16,
  // to out[0, 16): past n, the last one repeated.
  void offsets(int64_t t, int64_t n, int64_t* out) const {
    token_offsets(table, block_size, token_stride, head, t, n, out);
    for (int64_t i = n; i < 16; ++i) out[i] = out[n - 1];
  }
};

// The offsets (as Geometry::offsets) of up to 16 keys from `from` on, to fetch ahead: in this
// item's range, then (past its end) in the next item's, so the next item starts warm. Returns
// how many (0: none).
inline int64_t ahead_offsets(const Geometry& g, const Geometry* next, int64_t from, int64_t* out) {
  const Geometry* at = &g;
  if (from >= g.end) {
    if (next == nullptr) return 0;
    from = next->begin + (from - g.end);
    at = next;
  }
  const int64_t n = std::min<int64_t>(16, at->end - from);
  if (n <= 0) return 0;
  at->offsets(from, n, out);
  return n;
}

// Prefetch KV head `head`'s keys and values of the n keys at `offsets`. A tile fetches ahead
// one KV head at a time, between its heads' arithmetic: a burst of every head's prefetches at
// once stalls the core while they wait for line fill buffers.
template <int D, typename T>
inline void prefetch_head(const T* keys, const T* values, const int64_t* offsets, int64_t n, int64_t head) {
  for (int64_t i = 0; i < n; ++i) {
    prefetch_token<D>(keys + offsets[i] + head * D);
    prefetch_token<D>(values + offsets[i] + head * D);
  }
}

// Prefetch the n rows at `offsets` from `base`, each `bytes` long, line by line in memory
// order (a row is a token's KV heads side by side): the core's own prefetchers follow reads in
// that order, not a KV head's lines strided through a tile.
template <typename T>
inline void prefetch_rows(const T* base, const int64_t* offsets, int64_t n, int64_t bytes) {
  for (int64_t i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(base + offsets[i]);
    for (int64_t line = 0; line < bytes; line += 64) prefetch_l2(row + line);
  }
}

// Weighted values of one tile for G query heads of a KV head: acc[g] += sum over its n keys of
// p[g][t] * value t. Each value is loaded (and widened) once for the G heads; every U-th key
// goes to its own set of sums, so U x G x J multiply-adds are independent.
template <int J, int G, typename T>
inline void weigh_values(const T* values, const int64_t* offsets, int64_t n, const float* p, vf16* acc) {
  constexpr int U = 2 * G * J <= kBlockSums && G * J < 8 ? 2 : 1;
  vf16 a[U][G][J] = {};
  int64_t t = 0;
  for (; t + U <= n; t += U)
    for (int u = 0; u < U; ++u) {
      vf16 vv[J];
      load_row<J>(values + offsets[t + u], vv);
      for (int g = 0; g < G; ++g) {
        const vf16 w = broadcast(p + 16 * g + t + u);
        for (int j = 0; j < J; ++j) a[u][g][j] += w * vv[j];
      }
    }
  for (; t < n; ++t) {
    vf16 vv[J];
    load_row<J>(values + offsets[t], vv);
    for (int g = 0; g < G; ++g) {
      const vf16 w = broadcast(p + 16 * g + t);
      for (int j = 0; j < J; ++j) a[0][g][j] += w * vv[j];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < J; ++j) {
      vf16 sum = a[0][g][j];
      for (int u = 1; u < U; ++u) sum += a[u][g][j];
      acc[g * J + j] += sum;
    }
}

// The heads a weigh_values call takes together: up to 4, and at most kBlockSums accumulators.
template <int J>
constexpr int kWeighHeads = std::max(1, std::min(4, kBlockSums / J));

template <int J, typename T>
void weigh_heads(const T* values, const int64_t* offsets, int64_t n, const float* p, vf16* acc, int64_t heads) {
  for (int64_t g = 0; g < heads;) {
    const int64_t take = std::min<int64_t>(kWeighHeads<J>, heads - g);
    const float* pg = p + 16 * g;
    vf16* ag = acc + g * J;
    switch (take) {
      case 4:
        if constexpr (kWeighHeads<J> >= 4) weigh_values<J, 4>(values, offsets, n, pg, ag);
        break;
      case 3:
        if constexpr (kWeighHeads<J> >= 3) weigh_values<J, 3>(values, offsets, n, pg, ag);
        break;
      case 2:
        if constexpr (kWeighHeads<J> >= 2) weigh_values<J, 2>(values, offsets, n, pg, ag);
        break;
      default: weigh_values<J, 1>(values, offsets, n, pg, ag);
    }
    g += take;
  }
}

// `kv` KV heads' query heads (rows of q, contiguous, `per_kv` to each KV head, the first KV
// head's `keys` and `values` at g.head, the next D further) against keys [g.begin, g.end) of
// one sequence; J = head_dim / 16. One pass over the keys in tiles of 16: a tile's 16 keys are
// scored for every query head (the products a KV head through the tile with AVX-512, a run of
// kRunKeys keys for every head without it, then a horizontal-add tree per head; or with `amx`
// (decode_tiles_amx) a tile product for up to four KV heads, issued one step ahead), its
// exponentials taken against the running maximum (the head's sums rescaled when the maximum
// grows), and its values weighed for every head, while the tiles ahead are fetched (the first
// kAheadKeys the caller fetches, or the item before this one did). With `stats` null, the
// normalised output goes to `out`; otherwise the range's softmax: each head's
// maximum and sum of exponentials to stats (2 floats) and its weighted values to sums (J
// vectors, in load_row's arrangement). `work` holds work_vectors<J>(kv, per_kv) vectors.
template <int J>
constexpr int64_t work_vectors(int64_t kv, int64_t per_kv) {
  return (2 * J + 3) * kv * per_kv + std::max(64 + kv * 16 * (J / 2), 16 * kv * per_kv);
}

template <int J, typename T>
void attend_range(const T* q, int64_t kv, int64_t per_kv, const T* keys, const T* values, const Geometry& g,
                  const Geometry* next, float scale, T* out, float* stats, vf16* sums, vf16* work, bool amx) {
  constexpr int D = 16 * J;
  const int64_t heads = kv * per_kv, begin = g.begin, end = g.end;
  const float lowest = -std::numeric_limits<float>::infinity();
  vf16* qv = work;                       // [heads][J] queries (scaled, or their bits)
  vf16* acc = work + heads * J;          // [heads][J] weighted values
  vf16* totals = work + 2 * heads * J;   // [heads] lane sums of the exponentials
  float* maxima = reinterpret_cast<float*>(work + (2 * J + 1) * heads);  // [heads] running maxima
  float* p = reinterpret_cast<float*>(work + (2 * J + 2) * heads);       // [heads][16] a tile's weights
  float* scores = p + 16 * heads;                                         // [4][16][16] (amx)
  uint32_t* qt = reinterpret_cast<uint32_t*>(scores + 1024);              // [kv][J / 2][16][16] (amx)
  // Scores are scaled with the query, or after the dot products of bits (kDotsOfBits).
  const float score_scale = kDotsOfBits<J, T> ? scale : 1.f;
  for (int64_t h = 0; h < heads; ++h) {
    if constexpr (kDotsOfBits<J, T>) {
      std::memcpy(qv + h * J, q + h * D, D * sizeof(T));  // the first J / 2 vectors
    } else {
      load_row<J>(q + h * D, qv + h * J);
      for (int j = 0; j < J; ++j) qv[h * J + j] *= scale;
    }
    for (int j = 0; j < J; ++j) acc[h * J + j] = vf16{};
    totals[h] = vf16{};
    maxima[h] = lowest;
  }
#if defined(MSTAR_AMX)
  if constexpr (kDotsOfBits<J, T>) {
    if (amx) {
      // Each KV head's queries^T in pairs of features: qt[k][s][r][e] holds features 32 s + 2 r
      // and the next of head e (zero past per_kv).
      std::fill(qt, qt + kv * 256 * (J / 2), 0u);
      for (int64_t h = 0; h < heads; ++h) {
        uint32_t words[D / 2];
        std::memcpy(words, q + h * D, sizeof words);
        uint32_t* dst = qt + h / per_kv * 256 * (J / 2) + h % per_kv;
        for (int i = 0; i < D / 2; ++i) dst[i / 16 * 256 + i % 16 * 16] = words[i];
      }
      configure_tiles(16);
      before_tile_loads();
      score_tiles_amx<J>(keys + g.offset(begin), g.token_stride * 2, qt, std::min<int64_t>(4, kv));
    }
  }
#endif
  // Head h's 16 scores of a tile (its keys past the range's end weigh nothing) to their
  // exponentials at p_h, against a running maximum that is raised only when a score passes it
  // by kSlack: no horizontal maximum (a long chain) on most tiles, and weights of at most
  // e^kSlack. Raising it rescales what is summed so far.
  const auto weigh_scores = [&](int64_t h, vf16 tile, int64_t n, float* p_h) {
    if (n < 16) {
      float lanes[16];
      store16(lanes, tile);
      std::fill(lanes + n, lanes + 16, lowest);
      tile = load16(lanes);
    }
    if (any_above(tile, maxima[h] + kSlack)) {
      const float m = std::max(maxima[h], hmax(tile));
      const float c = exp_scalar(maxima[h] - m);
      for (int j = 0; j < J; ++j) acc[h * J + j] *= c;
      totals[h] *= c;
      maxima[h] = m;
    }
    const vf16 w = exp_or_zero(tile - maxima[h]);
    totals[h] += w;
    store16(p_h, w);
  };
  int64_t offsets[16], ahead[16];
#if defined(__AVX512F__)
  // A KV head at a time through a tile: its query heads' scores (a tile of AMX products, or 16
  // keys' partial_scores in registers and one horizontal-add tree a head), their exponentials,
  // then its values, while that KV head's keys and values of the tile ahead are fetched.
  for (int64_t t0 = begin; t0 < end; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, end - t0);
    g.offsets(t0, n, offsets);  // past n: repeats
    const int64_t fetching = ahead_offsets(g, next, t0 + kAheadKeys, ahead);
    for (int64_t k = 0; k < kv; ++k) {
      prefetch_head<D>(keys, values, ahead, fetching, k);
#if defined(MSTAR_AMX)
      if constexpr (kDotsOfBits<J, T>) {
        if (amx && k % 4 == 0) {
          // These KV heads' scores (their products issued before), then the next four's
          // products issued, to run while this tile's exponentials and values are computed.
          store_score_tiles(scores, std::min<int64_t>(4, kv - k));
          const int64_t tn = k + 4 < kv ? t0 : t0 + 16, kn = k + 4 < kv ? k + 4 : 0;
          if (tn < end)
            score_tiles_amx<J>(keys + g.offset(tn) + kn * D, g.token_stride * 2, qt + kn * 256 * (J / 2),
                               std::min<int64_t>(4, kv - kn));
        }
      }
#endif
      for (int64_t e = 0; e < per_kv; ++e) {
        const int64_t h = k * per_kv + e;
        vf16 tile;
#if defined(MSTAR_AMX)
        if (kDotsOfBits<J, T> && amx) {
          tile = head_scores(scores + k % 4 * 256, e);
        } else
#endif
        {
          Partial a[16];
          for (int r = 0; r < 16; ++r) partial_scores<J>(qv + h * J, keys + k * D + offsets[r], 1, a + r);
          tile = sum_partials(a);
        }
        weigh_scores(h, tile * score_scale, n, p + 16 * e);
      }
      weigh_heads<J>(values + k * D, offsets, n, p, acc + k * per_kv * J, per_kv);
    }
  }
#else
  // In memory order: a tile's keys a run (kRunKeys) at a time, each scored for every query
  // head of the item (its KV heads lie side by side in a token's row), then its values a run
  // at a time for every head, while the rows of the tile ahead are fetched, a run's share
  // with each run: the core's prefetchers follow reads in memory order, not a KV head's
  // strided ones.
  constexpr int64_t run = kRunKeys<T>;
  Partial* parts = reinterpret_cast<Partial*>(p + 16 * heads);  // [heads][16]
  const int64_t row_bytes = kv * D * int64_t(sizeof(T));
  for (int64_t t0 = begin; t0 < end; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, end - t0);
    g.offsets(t0, n, offsets);  // past n: repeats
    const int64_t fetching = ahead_offsets(g, next, t0 + kAheadKeys, ahead);
    const auto fetch = [&](const T* base, int64_t r0) {
      const int64_t from = fetching * r0 / 16;
      prefetch_rows(base, ahead + from, fetching * (r0 + run) / 16 - from, row_bytes);
    };
    for (int64_t r0 = 0; r0 < 16; r0 += run) {
      fetch(keys, r0);
      for (int64_t k = 0; k < kv; ++k)
        for (int64_t r = r0; r < r0 + run; ++r)
          partial_scores<J>(qv + k * per_kv * J, keys + k * D + offsets[r], per_kv, parts + 16 * k * per_kv + r);
    }
    for (int64_t h = 0; h < heads; ++h) weigh_scores(h, sum_partials(parts + 16 * h) * score_scale, n, p + 16 * h);
    for (int64_t r0 = 0; r0 < 16; r0 += run) {
      fetch(values, r0);
      if (r0 < n)
        for (int64_t k = 0; k < kv; ++k)
          weigh_heads<J>(values + k * D, offsets + r0, std::min(run, n - r0), p + 16 * k * per_kv + r0,
                         acc + k * per_kv * J, per_kv);
    }
  }
#endif
  for (int64_t h = 0; h < heads; ++h) {
    const float total = hsum(totals[h]);
    if (stats == nullptr) {
      store_row<J>(acc + h * J, 1.f / total, out + h * D);
    } else {
      stats[2 * h] = maxima[h];  // the maximum, then the sum of exponentials
      stats[2 * h + 1] = total;
      for (int j = 0; j < J; ++j) sums[h * J + j] = acc[h * J + j];
    }
  }
}

// One query head's result from its row's `ranges` partial softmaxes (stats and sums `heads`
// apart, in key order): each range's share rescaled to the largest maximum, summed in order.
template <int J, typename T>
void merge_ranges(const float* stats, const vf16* sums, int64_t ranges, int64_t heads, T* out) {
  float m = stats[0];
  for (int64_t i = 1; i < ranges; ++i) m = std::max(m, stats[2 * i * heads]);
  vf16 acc[J] = {};
  float total = 0.f;
  for (int64_t i = 0; i < ranges; ++i) {
    const float w = exp_scalar(stats[2 * i * heads] - m);
    total += w * stats[2 * i * heads + 1];
    for (int j = 0; j < J; ++j) acc[j] += w * sums[i * heads * J + j];
  }
  store_row<J>(acc, 1.f / total, out);
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
  // A unit is one range of a row (kRangeKeys, whole blocks); units[r] is row r's first, and
  // partial[r] where its ranges' softmaxes go (-1: one range, written out directly).
  const int64_t range_keys = std::max<int64_t>(1, kRangeKeys / block_size) * block_size;
  std::vector<int64_t> units(rows + 1, 0), partial(rows, -1);
  int64_t partials = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = (lp[r] + range_keys - 1) / range_keys;
    units[r + 1] = units[r] + n;
    if (n > 1) partial[r] = std::exchange(partials, partials + n);
  }
  // A work item is a unit's KV heads together; with fewer units than two per thread, one KV
  // head each (the split changes no sum: heads are computed apart either way).
  const int64_t split = units[rows] < 2 * at::get_num_threads() ? kv_heads : 1, per_item = kv_heads / split;
#if defined(MSTAR_AMX)
  const bool amx = decode_tiles_amx<J, T>(block_size, group);
#else
  const bool amx = false;
#endif
  std::vector<float> stats(partials * heads * 2);
  std::vector<vf16> sums(partials * heads * J);
  int64_t keys = 0;
  for (int64_t r = 0; r < rows; ++r) keys += lp[r];
  const int64_t item_bytes = 2 * keys / units[rows] * per_item * D * int64_t(sizeof(T));  // its keys and values
  // Item i: its row, range (of the row's) and first KV head, and where it reads.
  struct Item {
    int64_t row, range, kv_head;
    Geometry where;
  };
  const auto item_at = [&](int64_t item) {
    const int64_t unit = item / split;
    const int64_t row = std::upper_bound(units.begin(), units.end(), unit) - units.begin() - 1;
    const int64_t range = unit - units[row], from = range * range_keys, kv_head = (item % split) * per_item;
    return Item{row, range, kv_head,
                Geometry{block_size, token_stride, from, std::min(lp[row], from + range_keys), tp + row * max_blocks,
                         kv_head * D}};
  };
  at::parallel_for(0, units[rows] * split, grain_for(item_bytes), [&](int64_t begin, int64_t end) {
    std::vector<vf16> work(work_vectors<J>(per_item, group));
    // The first item's first tiles; each item fetches the next one's while it ends.
    Item it = item_at(begin);
    for (int64_t t = it.where.begin; t < it.where.begin + kAheadKeys; t += 16) {
      int64_t ahead[16];
      const int64_t n = ahead_offsets(it.where, nullptr, t, ahead);
      prefetch_rows(kp, ahead, n, per_item * D * int64_t(sizeof(T)));
      prefetch_rows(vp, ahead, n, per_item * D * int64_t(sizeof(T)));
    }
    for (int64_t item = begin; item < end; ++item) {
      const Item next = item + 1 < end ? item_at(item + 1) : it;
      const int64_t h = it.kv_head * group;                        // the item's first query head
      const int64_t slot = (partial[it.row] + it.range) * heads + h;  // its heads' partials
      const bool whole = partial[it.row] < 0;
      attend_range<J>(qp + it.row * q_stride + h * D, per_item, group, kp, vp, it.where,
                      item + 1 < end ? &next.where : nullptr, float(scale), op + (it.row * heads + h) * D,
                      whole ? nullptr : stats.data() + 2 * slot, whole ? nullptr : sums.data() + J * slot, work.data(),
                      amx);
      it = next;
    }
  });
  if (partials == 0) return;
  const int64_t merge_bytes = 8 * J * 64 * partials / std::max<int64_t>(1, rows);  // a row's ranges, per head
  at::parallel_for(0, rows * heads, grain_for(merge_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / heads, h = i % heads;
      if (partial[row] < 0) continue;
      const int64_t slot = partial[row] * heads + h;
      merge_ranges<J>(stats.data() + 2 * slot, sums.data() + J * slot, units[row + 1] - units[row], heads,
                      op + i * D);
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

}  // namespace

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

// The step's keys and values written to their cache slots: k, v [rows, kv_heads, head_dim]
// (rows may be strided; heads and head_dim contiguous), the caches' dtype; slots [rows] int64
// (block * block_size + offset). `caller` names the op in errors.
void write_slots(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
                 const at::Tensor& v, const char* caller) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              caller, ": contiguous CPU caches [blocks, block_size, kv_heads, dim] of one dtype expected");
  const int64_t rows = k.size(0), token = k_cache.size(2) * k_cache.size(3);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(0) == rows && t->size(1) * t->size(2) == token &&
                    t->stride(2) == 1 && t->stride(1) == t->size(2) && t->scalar_type() == k_cache.scalar_type(),
                caller, ": keys and values [rows, kv_heads, dim] of the caches' shape and dtype expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows, caller,
              ": slots [rows] int64 expected");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), token_bytes = token * k_cache.element_size();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, caller, ": row ", r, "'s slot ", sp[r], " is outside the cache");
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_row = k.stride(0) * k.element_size(), v_row = v.stride(0) * v.element_size();
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(kc + sp[r] * token_bytes, kp + r * k_row, token_bytes);
    std::memcpy(vc + sp[r] * token_bytes, vp + r * v_row, token_bytes);
  }
}

}  // namespace

// write_slots, as write_kv names itself in errors.
void write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  write_slots(k_cache, v_cache, slots, k, v, "write_kv");
}
