// prefill_attention: the query rows of prefill chunks against their sequences' keys and values,
// read in place from the paged cache [blocks, block_size, kv_heads, head_dim] through block
// tables. A work item is a tile of up to kTileRows consecutive rows of one sequence and one KV
// head: each chunk of keys is read once for the tile (its keys transposed to [dim][keys] once
// per sequence for all of its tiles, its values read in place) and serves every row of the tile
// and every query head of the KV head, so a prompt's keys are read once per tile instead of
// once per row. Softmax is online (a running maximum, sum and weighted values per row, rescaled
// as keys arrive), in float32. Each row sees its first lens[row] keys: its position + 1
// (causal), or a block-causal or full mask's limit. float32 and bfloat16 caches are read at
// their width.

#pragma once

#include "attention.h"  // token_rows
#include "simd.h"

namespace {

constexpr int64_t kTileRows = 64;
constexpr int64_t kChunk = 64;  // keys per softmax update: four vectors of 16 scores

// Register blocks of prefill_tile's two products, each sum a vf16 held in registers: scores of
// kScoreVectors query vectors x kScoreKeys vectors of 16 keys, and weighted values of
// kValueVectors<J> query vectors x kValueParts<J> vectors of 16 features. With 32 vector
// registers (AVX-512) 16 sums each, with 16 (AVX2: a vf16 is two) 4 sums each: AVX2 with the
// AVX-512 blocks spilled its sums to the stack at every product (1.5x slower than torch).
#if defined(__AVX512F__)
constexpr int kScoreVectors = 4, kScoreKeys = 4;
template <int J>
constexpr int kValueVectors = J <= 2 ? 8 : 16 / J;
template <int J>
constexpr int kValueParts = J;
#else
constexpr int kScoreVectors = 2, kScoreKeys = 2;
template <int J>
constexpr int kValueVectors = 4;
template <int J>
constexpr int kValueParts = 1;
#endif

// Widen n values to float32.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src[i]);
}

inline vf16 max16(vf16 a, vf16 b) { return select(a > b, a, b); }

struct PrefillTile {
  int64_t row0, rows, seq, kv_head;
};

// A sequence's keys transposed and widened to float32 for prefill_tile, once for all of its
// tiles: per KV head and chunk of kChunk keys [head_dim][kChunk] (a chunk's keys one block),
// zero past the keys its rows see.
struct SequenceKeys {
  int64_t chunks = 0;
  std::vector<float> data;  // [kv_heads][chunks][head_dim][kChunk]
};

// Its first `longest` keys, 16 at a time (each row of a chunk written 64 bytes at once).
template <typename T>
SequenceKeys transposed_keys(const T* keys, int64_t block_size, int64_t kv_heads, int64_t D, const int64_t* table,
                             int64_t longest) {
  SequenceKeys sk;
  sk.chunks = (longest + kChunk - 1) / kChunk;
  sk.data.assign(size_t(kv_heads * sk.chunks * D * kChunk), 0.f);
  const int64_t token_stride = kv_heads * D;
  const T* rows[16];
  for (int64_t t0 = 0; t0 < longest; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, longest - t0);
    token_rows(keys, block_size, token_stride, table, t0, n, rows);
    for (int64_t g = 0; g < kv_heads; ++g) {
      float* chunk = sk.data.data() + ((g * sk.chunks + t0 / kChunk) * D) * kChunk + t0 % kChunk;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t i = 0; i < n; ++i) chunk[d * kChunk + i] = load(rows[i][g * D + d]);
    }
  }
  return sk;
}

// One tile: rows [row0, row0 + rows) of q (the query heads of kv_head), against the keys of
// its sequence (`table`; its keys transposed in `seq_keys`). `work` holds the tile's buffers.
template <int J, typename T>
void prefill_tile(const T* q, int64_t q_stride, int64_t heads, int64_t group, const SequenceKeys& seq_keys,
                  const T* values, int64_t block_size, int64_t token_stride, const int64_t* table,
                  const int64_t* lens, const PrefillTile& tile, float scale, T* out, std::vector<float>& work) {
  constexpr int D = 16 * J, C = kChunk / 16, S = kScoreVectors, CS = kScoreKeys, V = kValueVectors<J>,
                JV = kValueParts<J>;
  static_assert(C % CS == 0 && J % JV == 0, "register blocks must divide the chunk and the head");
  constexpr int64_t kAlign = S > V ? S : V;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t nv = tile.rows * group;  // query vectors: row i's head hh is vector i * group + hh
  const int64_t padded = (nv + kAlign - 1) / kAlign * kAlign;
  int64_t longest = 0;
  for (int64_t i = 0; i < tile.rows; ++i) longest = std::max(longest, lens[tile.row0 + i]);
  // queries [padded][D], sums [padded][D], scores then probabilities [padded][kChunk], maxima,
  // totals [padded][16] (lane sums), each vector's visible keys
  work.resize(size_t(padded * (2 * D + kChunk + 18)));
  float* qs = work.data();
  float* acc = qs + padded * D;
  float* probs = acc + padded * D;
  float* maxima = probs + padded * kChunk;
  float* totals = maxima + padded;
  float* seen = totals + 16 * padded;
  const float* head_keys = seq_keys.data.data() + tile.kv_head * seq_keys.chunks * D * kChunk;
  for (int64_t v = 0; v < padded; ++v) {
    const int64_t i = std::min(v / group, tile.rows - 1), hh = v % group;
    const T* src = q + (tile.row0 + i) * q_stride + (tile.kv_head * group + hh) * D;
    widen(src, qs + v * D, D);
    for (int d = 0; d < D; ++d) qs[v * D + d] *= scale * kLog2e;  // scores in base 2
    std::fill(acc + v * D, acc + (v + 1) * D, 0.f);
    maxima[v] = kNone;
    std::fill(totals + 16 * v, totals + 16 * (v + 1), 0.f);
    seen[v] = v < nv ? float(lens[tile.row0 + i]) : 0.f;  // padding vectors see nothing
  }
  // The chunk's values, read in place (float32) or widened once for all the tile's query
  // vectors (bfloat16: widened at each product, they took 1.3x float32's time on Zen 3).
  const T* value_rows[kChunk];
  const float* chunk_values[kChunk];
  std::vector<float> wide(std::is_same_v<T, float> ? 0 : kChunk * D);
  const vf16 lanes = lane_indices();
  for (int64_t t0 = 0; t0 < longest; t0 += kChunk) {
    const int64_t nk = std::min<int64_t>(kChunk, longest - t0);
    const float* kt = head_keys + t0 * D;  // the chunk's keys [D][kChunk]
    token_rows(values + tile.kv_head * D, block_size, token_stride, table, t0, nk, value_rows);
    for (int64_t k = 0; k < nk; ++k) {
      if constexpr (std::is_same_v<T, float>) {
        chunk_values[k] = value_rows[k];
      } else {
        for (int j = 0; j < J; ++j) store16(wide.data() + k * D + 16 * j, load16(value_rows[k] + 16 * j));
        chunk_values[k] = wide.data() + k * D;
      }
    }
    for (int64_t v0 = 0; v0 < padded; v0 += S)
      for (int c0 = 0; c0 < C; c0 += CS) {
        vf16 s[S][CS];
        for (int p = 0; p < S; ++p)
          for (int c = 0; c < CS; ++c) s[p][c] = vf16{};
        for (int d = 0; d < D; ++d) {
          vf16 kd[CS];
          for (int c = 0; c < CS; ++c) kd[c] = load16(kt + d * kChunk + 16 * (c0 + c));
          for (int p = 0; p < S; ++p) {
            const float qd = qs[(v0 + p) * D + d];
            for (int c = 0; c < CS; ++c) s[p][c] += qd * kd[c];
          }
        }
        for (int p = 0; p < S; ++p)
          for (int c = 0; c < CS; ++c) store16(probs + (v0 + p) * kChunk + 16 * (c0 + c), s[p][c]);
      }
    for (int64_t v = 0; v < padded; ++v) {
      float* pv = probs + v * kChunk;
      vf16 s[C];
      for (int c = 0; c < C; ++c) s[c] = load16(pv + 16 * c);
      const float visible = seen[v] - float(t0);  // keys of this chunk the vector sees
      if (visible < float(kChunk))
        for (int c = 0; c < C; ++c) s[c] = select(lanes + float(16 * c) < visible, s[c], splat(kNone));
      // The maximum is raised only where a score passes it by kSlack (then what is summed so
      // far is rescaled to it): most chunks take no horizontal maximum.
      bool above = false;
      for (int c = 0; c < C; ++c) above |= any_above(s[c], maxima[v] + kSlack);
      if (above) {
        vf16 top4 = s[0];
        for (int c = 1; c < C; ++c) top4 = max16(top4, s[c]);
        const float m = std::max(maxima[v], hmax(top4));
        if (maxima[v] != kNone) {
          const float correction = exp_scalar((maxima[v] - m) * kLn2);
          store16(totals + 16 * v, load16(totals + 16 * v) * correction);
          for (int j = 0; j < J; ++j) store16(acc + v * D + 16 * j, load16(acc + v * D + 16 * j) * correction);
        }
        maxima[v] = m;
      }
      if (maxima[v] == kNone) {  // the vector has seen no key yet
        for (int c = 0; c < C; ++c) store16(pv + 16 * c, vf16{});
        continue;
      }
      vf16 total = load16(totals + 16 * v);
      for (int c = 0; c < C; ++c) {
        const vf16 e = exp2_or_zero(s[c] - maxima[v]);
        store16(pv + 16 * c, e);
        total += e;
      }
      store16(totals + 16 * v, total);
    }
    for (int64_t v0 = 0; v0 < padded; v0 += V)
      for (int j0 = 0; j0 < J; j0 += JV) {
        vf16 a[V][JV];
        for (int p = 0; p < V; ++p)
          for (int j = 0; j < JV; ++j) a[p][j] = load16(acc + (v0 + p) * D + 16 * (j0 + j));
        for (int64_t k = 0; k < nk; ++k) {
          vf16 vv[JV];
          for (int j = 0; j < JV; ++j) vv[j] = load16(chunk_values[k] + 16 * (j0 + j));
          for (int p = 0; p < V; ++p) {
            const float w = probs[(v0 + p) * kChunk + k];
            for (int j = 0; j < JV; ++j) a[p][j] += w * vv[j];
          }
        }
        for (int p = 0; p < V; ++p)
          for (int j = 0; j < JV; ++j) store16(acc + (v0 + p) * D + 16 * (j0 + j), a[p][j]);
      }
  }
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t i = v / group, hh = v % group;
    T* dst = out + ((tile.row0 + i) * heads + tile.kv_head * group + hh) * D;
    const float total = hsum(load16(totals + 16 * v));
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int d = 0; d < D; ++d) store(acc[v * D + d] * inv, dst + d);
  }
}

#if defined(MSTAR_AMX)
// The bfloat16 tile on AMX (head_dim a multiple of 32): scores and weighted values are tile
// products, transposed so that each lane is one query vector (a row's query head) and the
// softmax needs no horizontal step. Per chunk of 64 keys: the keys' tiles are read in place
// from the cache (gathered where 16 keys span blocks); then for each 16 query vectors,
// scores^T [64 keys][16] = K Q^T, the online softmax lane by lane in float32 (base 2), the
// probabilities rounded to bfloat16 (as flash attention rounds them) and the chunk's weighted
// values^T [head_dim][16] = V^T P^T added to the running sums. Values are transposed once per
// sequence and KV head (`SequenceValues`), for all of its tiles. A query vector's result
// depends on its own row alone (each lane computed apart, chunks from the sequence's first
// key), whatever rows share its tile.
constexpr int64_t kAmxChunk = 64;

// A sequence's values transposed for the tiles: per KV head [head_dim][padded keys] bfloat16,
// zero past the keys its rows see (a zero weight times an unwritten value could be NaN).
struct SequenceValues {
  int64_t padded = 0;  // keys per row, a multiple of kAmxChunk
  std::vector<uint16_t> data;
};

// Its tiles (configure_tiles(16)): 0-3: scores of 16 keys each; 4, 6: keys (16 x 32 features),
// then values^T (16 features x 32 keys); 5: queries^T (16 feature pairs x 16 vectors x 2), then
// probabilities^T of keys 0-31 (16 key pairs x 16 vectors x 2); 7: those of keys 32-63; 0
// again: the running sums of weighted values^T, loaded, added to and stored back.
template <int J>
void prefill_tile_amx(const uint16_t* q, int64_t q_stride, int64_t heads, int64_t group, const uint16_t* keys,
                      const SequenceValues& seq_values, int64_t block_size, int64_t token_stride,
                      const int64_t* table, const int64_t* lens, const PrefillTile& tile, float scale,
                      uint16_t* out, std::vector<float>& work) {
  constexpr int D = 16 * J, S = D / 32;  // S: 32-feature steps of a score product
  constexpr int64_t C = kAmxChunk;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t nv = tile.rows * group, subtiles = (nv + 15) / 16;
  int64_t longest = 0;
  for (int64_t i = 0; i < tile.rows; ++i) longest = std::max(longest, lens[tile.row0 + i]);
  // Per 16 vectors: queries^T [S][16 pairs][16] (32-bit pairs), weighted values^T [D][16],
  // maxima, totals, visible keys. Per chunk: keys gathered [C][D] bf16, scores [C][16],
  // probabilities^T [C / 2][32] bf16.
  const int64_t per_sub = S * 16 * 16 + D * 16 + 3 * 16;
  work.resize(size_t(subtiles * per_sub + C * D / 2 + C * 16 + C * 16) + 16);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(work.data()) + 63) & ~uintptr_t(63));
  float* chunk_area = base + subtiles * per_sub;
  uint16_t* kg = reinterpret_cast<uint16_t*>(chunk_area);  // [C][D]
  float* scores = chunk_area + C * D / 2;                   // [C][16]
  uint16_t* pt = reinterpret_cast<uint16_t*>(scores + C * 16);  // [C / 2][32]
  for (int64_t sub = 0; sub < subtiles; ++sub) {
    float* state = base + sub * per_sub;
    uint32_t* qt = reinterpret_cast<uint32_t*>(state);
    float* acc = state + S * 16 * 16;
    std::fill(acc, acc + D * 16, 0.f);
    for (int n = 0; n < 16; ++n) {
      // Padding vectors repeat the tile's last one (finite scores); never written out.
      const int64_t v = std::min(sub * 16 + n, nv - 1), i = v / group, hh = v % group;
      const uint16_t* src = q + (tile.row0 + i) * q_stride + (tile.kv_head * group + hh) * D;
      uint32_t words[D / 2];
      std::memcpy(words, src, sizeof words);
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < 16; ++r) qt[(s * 16 + r) * 16 + n] = words[16 * s + r];
      acc[D * 16 + n] = kNone;                          // maxima
      acc[D * 16 + 16 + n] = 0.f;                       // totals
      acc[D * 16 + 32 + n] = float(lens[tile.row0 + i]);  // keys seen
    }
  }
  configure_tiles(16);
  before_tile_loads();  // the queries^T just written
  const float log2_scale = scale * kLog2e;
  const int64_t key_bytes = token_stride * 2, vt_bytes = seq_values.padded * 2;
  const uint16_t* vt = seq_values.data.data() + tile.kv_head * D * seq_values.padded;
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t t0 = 0; t0 < longest; t0 += C) {
    // Keys: in place where 16 lie in one block and all are the sequence's; else gathered.
    const uint16_t* key_tiles[4];
    int64_t key_strides[4];
    for (int h = 0; h < 4; ++h) {
      const int64_t first = t0 + 16 * h;
      if (block_size % 16 == 0 && first + 16 <= longest) {
        key_tiles[h] = keys + (table[first / block_size] * block_size + first % block_size) * token_stride +
                       tile.kv_head * D;
        key_strides[h] = key_bytes;
        continue;
      }
      uint16_t* dst = kg + 16 * h * D;
      for (int64_t k = 0; k < 16; ++k) {
        const int64_t t = first + k;
        if (t < longest) {
          const int64_t slot = table[t / block_size] * block_size + t % block_size;
          std::memcpy(dst + k * D, keys + slot * token_stride + tile.kv_head * D, D * sizeof(uint16_t));
        } else {
          std::fill(dst + k * D, dst + (k + 1) * D, uint16_t(0));
        }
      }
      key_tiles[h] = dst;
      key_strides[h] = D * 2;
    }
    for (int64_t sub = 0; sub < subtiles; ++sub) {
      float* state = base + sub * per_sub;
      const uint32_t* qt = reinterpret_cast<const uint32_t*>(state);
      float* acc = state + S * 16 * 16;
      float* maxima = acc + D * 16;
      float* totals = maxima + 16;
      const vf16 limit = load16(totals + 16) - float(t0);  // keys of this chunk each vector sees
      if (!any(limit > 0.f)) continue;                     // a causal tile's earlier rows: none here
      const int quarters = any(limit > 32.f) ? 4 : 2;      // keys 32-63 unseen by all: not scored
      before_tile_loads();  // keys gathered, sums rescaled, probabilities of the last chunk
      _tile_zero(0);
      _tile_zero(1);
      if (quarters == 4) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int s = 0; s < S; ++s) {
        _tile_loadd(5, qt + s * 16 * 16, 64);
        _tile_loadd(4, key_tiles[0] + 32 * s, key_strides[0]);
        _tile_loadd(6, key_tiles[1] + 32 * s, key_strides[1]);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 6, 5);
        if (quarters == 4) {
          _tile_loadd(4, key_tiles[2] + 32 * s, key_strides[2]);
          _tile_loadd(6, key_tiles[3] + 32 * s, key_strides[3]);
          _tile_dpbf16ps(2, 4, 5);
          _tile_dpbf16ps(3, 6, 5);
        }
      }
      _tile_stored(0, scores, 64);
      _tile_stored(1, scores + 16 * 16, 64);
      if (quarters == 4) {
        _tile_stored(2, scores + 32 * 16, 64);
        _tile_stored(3, scores + 48 * 16, 64);
      }
      const int64_t keys_here = 16 * quarters;
      // Scores in base 2 (scale times log2 e): exponentials are powers of two, taken against
      // each vector's running maximum. The maximum is raised only where a visible score passes
      // it by kSlack (as in prefill_tile): then the chunk's maximum is taken, the exponentials
      // taken again against it and what was summed rescaled. Most chunks take one pass over
      // their scores, and their weighted values add to the sums in the tile unit.
      const bool masked = any(limit < float(keys_here));
      const vf16 old = load16(maxima);
      const __m512 scale2 = _mm512_set1_ps(log2_scale);
      vf16 chunk_total{};
      // The chunk's probabilities against maxima m (pairs interleaved, the tile's layout);
      // returns whether a visible score passed its maximum by more than kSlack.
      auto weigh = [&](vf16 m) {
        const __m512 shift = (__m512)(-m);
        __mmask16 over = 0;
        chunk_total = vf16{};
        for (int k = 0; k < keys_here; k += 2) {
          const __m512 x0 = _mm512_fmadd_ps(_mm512_load_ps(scores + 16 * k), scale2, shift);
          const __m512 x1 = _mm512_fmadd_ps(_mm512_load_ps(scores + 16 * k + 16), scale2, shift);
          vf16 p0 = exp2_or_zero((vf16)x0), p1 = exp2_or_zero((vf16)x1);
          __mmask16 seen0 = 0xffff, seen1 = 0xffff;
          if (masked) {
            seen0 = _mm512_cmp_ps_mask((__m512)limit, _mm512_set1_ps(float(k)), _CMP_GT_OQ);
            seen1 = _mm512_cmp_ps_mask((__m512)limit, _mm512_set1_ps(float(k + 1)), _CMP_GT_OQ);
            p0 = (vf16)_mm512_maskz_mov_ps(seen0, (__m512)p0);
            p1 = (vf16)_mm512_maskz_mov_ps(seen1, (__m512)p1);
          }
          over |= _mm512_mask_cmp_ps_mask(seen0, x0, _mm512_set1_ps(kSlack), _CMP_GT_OQ) |
                  _mm512_mask_cmp_ps_mask(seen1, x1, _mm512_set1_ps(kSlack), _CMP_GT_OQ);
          chunk_total += p0 + p1;
          // Key pair (k, k + 1) interleaved per vector: the tile's pair layout.
          const __m512i pair =
              _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0));
          _mm512_store_si512(pt + 16 * k, pair);
        }
        return over != 0;
      };
      vf16 m = old;
      // A vector's first keys (its maximum still -inf) always raise it: no first try.
      const bool raised = any(old == splat(kNone)) || weigh(old);
      if (raised) {
        vf16 top = splat(kNone);
        for (int k = 0; k < keys_here; ++k) {
          vf16 x = load16(scores + 16 * k);
          if (masked) x = select(limit > float(k), x, splat(kNone));
          top = max16(top, x);
        }
        top *= log2_scale;
        m = select(old > top, old, top);
        weigh(m);
        // Every vector sees a key by now (rows see key 0 first): the maxima are finite.
        const vf16 correction = exp2_or_zero(old - m);
        store16(totals, load16(totals) * correction + chunk_total);
        store16(maxima, m);
        for (int64_t i = 0; i < D * 16; i += 16) store16(acc + i, load16(acc + i) * correction);
      } else {
        store16(totals, load16(totals) + chunk_total);
      }
      before_tile_loads();  // the probabilities and rescaled sums just written
      _tile_loadd(5, pt, 64);
      if (quarters == 4) _tile_loadd(7, pt + 16 * 32, 64);
      for (int j = 0; j < J; ++j) {
        float* sums = acc + 16 * j * 16;  // features 16 j .. 16 j + 15, a row per feature
        _tile_loadd(0, sums, 64);
        _tile_loadd(4, vt + 16 * j * seq_values.padded + t0, vt_bytes);
        _tile_dpbf16ps(0, 4, 5);
        if (quarters == 4) {
          _tile_loadd(6, vt + 16 * j * seq_values.padded + t0 + 32, vt_bytes);
          _tile_dpbf16ps(0, 6, 7);
        }
        _tile_stored(0, sums, 64);
      }
    }
  }
  _tile_release();
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t sub = v / 16, n = v % 16, i = v / group, hh = v % group;
    const float* acc = base + sub * per_sub + S * 16 * 16;
    const float total = acc[D * 16 + 16 + n];
    uint16_t* dst = out + ((tile.row0 + i) * heads + tile.kv_head * group + hh) * D;
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int d = 0; d < D; ++d) store(acc[d * 16 + n] * inv, dst + d);
  }
}

// Each sequence's values transposed (see SequenceValues): its first `longest[seq]` keys.
SequenceValues transposed_values(const uint16_t* values, int64_t block_size, int64_t kv_heads, int64_t D,
                                 const int64_t* table, int64_t longest) {
  SequenceValues sv;
  sv.padded = (longest + kAmxChunk - 1) / kAmxChunk * kAmxChunk;
  sv.data.assign(size_t(kv_heads * D * sv.padded), 0);
  const int64_t token_stride = kv_heads * D;
  // 16 keys at a time: each row of the result written 32 bytes at once (a key at a time wrote
  // a 2-byte piece into every row: a store per row's cache line, for every key).
  const uint16_t* rows[16];
  for (int64_t t0 = 0; t0 < longest; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, longest - t0);
    token_rows(values, block_size, token_stride, table, t0, n, rows);
    for (int64_t c = 0; c < token_stride; ++c) {  // c: KV head g's feature d at g * D + d
      uint16_t* dst = sv.data.data() + c * sv.padded + t0;
      for (int64_t i = 0; i < n; ++i) dst[i] = rows[i][c];
    }
  }
  return sv;
}
#endif

}  // namespace

// Whether prefill_attention takes queries like q on AMX (bfloat16, head_dim a multiple of 32, a
// CPU with AMX that Linux lets this process use).
bool prefill_uses_amx(const at::Tensor& q) {
#if defined(MSTAR_AMX)
  return q.scalar_type() == at::kBFloat16 && q.size(-1) % 32 == 0 && amx_permitted();
#else
  return false;
#endif
}

namespace {

template <int J, typename T>
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& tables, const at::Tensor& row_seqs, const at::Tensor& lens,
                            const std::vector<int64_t>& longest, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t block_size = k_cache.size(1), token_stride = kv_heads * 16 * J, max_blocks = tables.size(1);
  const int64_t* seq = row_seqs.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<PrefillTile> tiles;
  for (int64_t r = 0; r < rows;) {
    int64_t n = 1;
    while (n < kTileRows && r + n < rows && seq[r + n] == seq[r]) ++n;
    for (int64_t g = 0; g < kv_heads; ++g) tiles.push_back({r, n, seq[r], g});
    r += n;
  }
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const bool amx = prefill_uses_amx(q) && std::is_same_v<T, uint16_t> && J % 2 == 0;
  // Each sequence's keys (AMX: values) transposed once, for all of its tiles: the first
  // `longest[seq]` (the most its rows see).
  const int64_t seq_bytes = 4 * (*std::max_element(longest.begin(), longest.end())) * kv_heads * 16 * J;
  std::vector<SequenceKeys> seq_keys(amx ? 0 : longest.size());
#if defined(MSTAR_AMX)
  std::vector<SequenceValues> seq_values(amx ? longest.size() : 0);
#endif
  at::parallel_for(0, int64_t(longest.size()), grain_for(seq_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (longest[s] == 0) continue;
      if (!amx) {
        seq_keys[s] = transposed_keys(kp, block_size, kv_heads, 16 * J, tp + s * max_blocks, longest[s]);
        continue;
      }
#if defined(MSTAR_AMX)
      if constexpr (std::is_same_v<T, uint16_t>)
        seq_values[s] = transposed_values(vp, block_size, kv_heads, 16 * J, tp + s * max_blocks, longest[s]);
#endif
    }
  });
  // A tile's cost: its rows' query heads against the keys they see, as bytes of products.
  std::vector<int64_t> costs(tiles.size());
  for (size_t i = 0; i < tiles.size(); ++i) {
    int64_t seen = 0;
    for (int64_t r = tiles[i].row0; r < tiles[i].row0 + tiles[i].rows; ++r) seen += lp[r];
    costs[i] = seen * group * 16 * J / 4;
  }
  parallel_by_cost(costs, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t i = begin; i < end; ++i) {
      const PrefillTile& tile = tiles[i];
#if defined(MSTAR_AMX)
      if constexpr (std::is_same_v<T, uint16_t> && J % 2 == 0) {
        if (amx) {
          prefill_tile_amx<J>(qp, q.stride(0), heads, group, kp, seq_values[tile.seq], block_size, token_stride,
                              tp + tile.seq * max_blocks, lp, tile, float(scale), op, work);
          continue;
        }
      }
#endif
      prefill_tile<J>(qp, q.stride(0), heads, group, seq_keys[tile.seq], vp, block_size, token_stride,
                      tp + tile.seq * max_blocks, lp, tile, float(scale), op, work);
    }
  });
}

}  // namespace

// q [rows, heads, head_dim] (rows may be strided; heads and head_dim contiguous), the rows of
// each sequence consecutive; k_cache, v_cache [blocks, block_size, kv_heads, head_dim]
// contiguous, q's dtype; tables [seqs, max_blocks] int64; row_seqs [rows] int64 (each row's
// sequence: its table); lens [rows] int64 (the keys each row sees, >= 1). Returns [rows, heads,
// head_dim] in q's dtype.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& tables, const at::Tensor& row_seqs, const at::Tensor& lens,
                             double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "prefill_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "prefill_attention: q [rows, heads, dim] and caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "prefill_attention: q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "prefill_attention: head_dim mismatch or heads not a multiple of kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "prefill_attention: q's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "prefill_attention: caches must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && row_seqs.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong && tables.is_contiguous() && row_seqs.is_contiguous() &&
                  lens.is_contiguous() && tables.dim() == 2 && row_seqs.numel() == q.size(0) &&
                  lens.numel() == q.size(0),
              "prefill_attention: tables [seqs, max_blocks], row_seqs and lens [rows], int64, contiguous");
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = row_seqs.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  std::vector<int64_t> longest(tables.size(0), 0);  // the keys each sequence's rows see at most
  for (int64_t r = 0; r < lens.numel(); ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < tables.size(0), "prefill_attention: row ", r, " names sequence ", sp[r]);
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= tables.size(1) * block_size, "prefill_attention: row ", r, "'s length ",
                lp[r], " is outside its table");
    longest[sp[r]] = std::max(longest[sp[r]], lp[r]);
  }
  for (int64_t s = 0; s < tables.size(0); ++s) {
    for (int64_t b = 0; b < (longest[s] + block_size - 1) / block_size; ++b) {
      const int64_t block = tp[s * tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "prefill_attention: sequence ", s, " names block ", block,
                  " of ", num_blocks);
    }
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  by_dtype(q, "prefill_attention", [&](auto zero) {
    using T = decltype(zero);
    switch (q.size(2)) {
      case 16: return prefill_attention_impl<1, T>(q, k_cache, v_cache, tables, row_seqs, lens, longest, scale, out);
      case 32: return prefill_attention_impl<2, T>(q, k_cache, v_cache, tables, row_seqs, lens, longest, scale, out);
      case 64: return prefill_attention_impl<4, T>(q, k_cache, v_cache, tables, row_seqs, lens, longest, scale, out);
      case 128: return prefill_attention_impl<8, T>(q, k_cache, v_cache, tables, row_seqs, lens, longest, scale, out);
      case 256: return prefill_attention_impl<16, T>(q, k_cache, v_cache, tables, row_seqs, lens, longest, scale, out);
      default: TORCH_CHECK(false, "prefill_attention: head_dim must be 16, 32, 64, 128 or 256, got ", q.size(2));
    }
  });
  return out;
}
