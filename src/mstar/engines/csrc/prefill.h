// prefill_attention: the query rows of prefill chunks against their sequences' keys and values,
// read in place from the paged cache [blocks, block_size, kv_heads, head_dim] through block
// tables. A work item is a tile of up to kTileRows consecutive rows of one sequence and one KV
// head: each block of 16 keys is read once for the tile (its keys transposed to [dim][16 keys],
// its values [16 keys][dim]) and serves every row of the tile and every query head of the KV
// head, so a prompt's keys are read once per tile instead of once per row. Softmax is online
// (a running maximum, sum and weighted values per row, rescaled as keys arrive), in float32.
// Each row sees its first lens[row] keys: its position + 1 (causal), or a block-causal or full
// mask's limit. float32 and bfloat16 caches are read at their width.

#pragma once

#include "simd.h"

namespace {

constexpr int64_t kTileRows = 64;
constexpr int64_t kChunk = 64;  // keys per softmax update: four vectors of 16 scores
constexpr int kScoreVectors = 4;  // query vectors scored per pass over a chunk's keys

// Query vectors given weighted values per pass (their sums stay in registers).
template <int J>
constexpr int kValueVectors = J <= 2 ? 8 : 16 / J;

// Widen n values to float32.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src[i]);
}

inline vf16 max16(vf16 a, vf16 b) { return select(a > b, a, b); }

struct PrefillTile {
  int64_t row0, rows, seq, kv_head;
};

// One tile: rows [row0, row0 + rows) of q (the query heads of kv_head), against the keys of
// its sequence (`table`). `work` holds the tile's buffers.
template <int J, typename T>
void prefill_tile(const T* q, int64_t q_stride, int64_t heads, int64_t group, const T* keys, const T* values,
                  int64_t block_size, int64_t token_stride, const int64_t* table, const int64_t* lens,
                  const PrefillTile& tile, float scale, T* out, std::vector<float>& work) {
  constexpr int D = 16 * J, C = kChunk / 16, S = kScoreVectors, V = kValueVectors<J>;
  constexpr int64_t kAlign = S > V ? S : V;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t nv = tile.rows * group;  // query vectors: row i's head hh is vector i * group + hh
  const int64_t padded = (nv + kAlign - 1) / kAlign * kAlign;
  int64_t longest = 0;
  for (int64_t i = 0; i < tile.rows; ++i) longest = std::max(longest, lens[tile.row0 + i]);
  // queries [padded][D], sums [padded][D], probabilities [padded][kChunk], maxima, totals,
  // each vector's visible keys, the chunk's keys transposed [D][kChunk]
  work.resize(size_t(padded * (2 * D + kChunk + 3) + D * kChunk));
  float* qs = work.data();
  float* acc = qs + padded * D;
  float* probs = acc + padded * D;
  float* maxima = probs + padded * kChunk;
  float* totals = maxima + padded;
  float* seen = totals + padded;
  float* kt = seen + padded;
  for (int64_t v = 0; v < padded; ++v) {
    const int64_t i = std::min(v / group, tile.rows - 1), hh = v % group;
    const T* src = q + (tile.row0 + i) * q_stride + (tile.kv_head * group + hh) * D;
    widen(src, qs + v * D, D);
    for (int d = 0; d < D; ++d) qs[v * D + d] *= scale;
    std::fill(acc + v * D, acc + (v + 1) * D, 0.f);
    maxima[v] = kNone;
    totals[v] = 0.f;
    seen[v] = v < nv ? float(lens[tile.row0 + i]) : 0.f;  // padding vectors see nothing
  }
  std::vector<const T*> value_rows(kChunk);
  const vf16 lanes = lane_indices();
  for (int64_t t0 = 0; t0 < longest; t0 += kChunk) {
    const int64_t nk = std::min<int64_t>(kChunk, longest - t0);
    for (int64_t k = 0; k < kChunk; ++k) {
      if (k < nk) {
        const int64_t t = t0 + k;
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* kp = keys + slot * token_stride + tile.kv_head * D;
        for (int d = 0; d < D; ++d) kt[d * kChunk + k] = load(kp[d]);
        value_rows[k] = values + slot * token_stride + tile.kv_head * D;
      } else {
        for (int d = 0; d < D; ++d) kt[d * kChunk + k] = 0.f;
      }
    }
    for (int64_t v0 = 0; v0 < padded; v0 += S) {
      vf16 s[S][C];
      for (int p = 0; p < S; ++p)
        for (int c = 0; c < C; ++c) s[p][c] = vf16{};
      for (int d = 0; d < D; ++d) {
        vf16 kd[C];
        for (int c = 0; c < C; ++c) kd[c] = load16(kt + d * kChunk + 16 * c);
        for (int p = 0; p < S; ++p) {
          const float qd = qs[(v0 + p) * D + d];
          for (int c = 0; c < C; ++c) s[p][c] += qd * kd[c];
        }
      }
      for (int p = 0; p < S; ++p) {
        const int64_t v = v0 + p;
        float* pv = probs + v * kChunk;
        const float visible = seen[v] - float(t0);  // keys of this chunk the vector sees
        if (visible < float(kChunk))
          for (int c = 0; c < C; ++c) s[p][c] = select(lanes + float(16 * c) < visible, s[p][c], splat(kNone));
        vf16 top4 = s[p][0];
        for (int c = 1; c < C; ++c) top4 = max16(top4, s[p][c]);
        const float top = hmax(top4);
        if (top == kNone) {  // the vector sees none of these keys
          for (int c = 0; c < C; ++c) store16(pv + 16 * c, vf16{});
          continue;
        }
        const float m = std::max(maxima[v], top);
        vf16 total = vf16{};
        for (int c = 0; c < C; ++c) {
          const vf16 e = exp_nonpositive(s[p][c] - m);
          store16(pv + 16 * c, e);
          total += e;
        }
        if (maxima[v] != kNone && maxima[v] != m) {
          const float correction = exp_scalar(maxima[v] - m);
          totals[v] *= correction;
          for (int j = 0; j < J; ++j) store16(acc + v * D + 16 * j, load16(acc + v * D + 16 * j) * correction);
        }
        totals[v] += hsum(total);
        maxima[v] = m;
      }
    }
    for (int64_t v0 = 0; v0 < padded; v0 += V) {
      vf16 a[V][J];
      for (int p = 0; p < V; ++p)
        for (int j = 0; j < J; ++j) a[p][j] = load16(acc + (v0 + p) * D + 16 * j);
      for (int64_t k = 0; k < nk; ++k) {
        vf16 vv[J];
        for (int j = 0; j < J; ++j) vv[j] = load16(value_rows[k] + 16 * j);
        for (int p = 0; p < V; ++p) {
          const float w = probs[(v0 + p) * kChunk + k];
          for (int j = 0; j < J; ++j) a[p][j] += w * vv[j];
        }
      }
      for (int p = 0; p < V; ++p)
        for (int j = 0; j < J; ++j) store16(acc + (v0 + p) * D + 16 * j, a[p][j]);
    }
  }
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t i = v / group, hh = v % group;
    T* dst = out + ((tile.row0 + i) * heads + tile.kv_head * group + hh) * D;
    const float inv = totals[v] > 0.f ? 1.f / totals[v] : 0.f;
    for (int d = 0; d < D; ++d) store(acc[v * D + d] * inv, dst + d);
  }
}

template <int J, typename T>
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& tables, const at::Tensor& row_seqs, const at::Tensor& lens,
                            double scale, at::Tensor& out) {
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
  at::parallel_for(0, int64_t(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t i = begin; i < end; ++i) {
      const PrefillTile& tile = tiles[i];
      prefill_tile<J>(qp, q.stride(0), heads, group, kp, vp, block_size, token_stride, tp + tile.seq * max_blocks,
                      lp, tile, float(scale), op, work);
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
  for (int64_t r = 0; r < lens.numel(); ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < tables.size(0), "prefill_attention: row ", r, " names sequence ", sp[r]);
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= tables.size(1) * block_size, "prefill_attention: row ", r, "'s length ",
                lp[r], " is outside its table");
    for (int64_t b = 0; b < (lp[r] + block_size - 1) / block_size; ++b) {
      const int64_t block = tp[sp[r] * tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "prefill_attention: row ", r, " names block ", block, " of ",
                  num_blocks);
    }
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  by_dtype(q, "prefill_attention", [&](auto zero) {
    using T = decltype(zero);
    switch (q.size(2)) {
      case 16: return prefill_attention_impl<1, T>(q, k_cache, v_cache, tables, row_seqs, lens, scale, out);
      case 32: return prefill_attention_impl<2, T>(q, k_cache, v_cache, tables, row_seqs, lens, scale, out);
      case 64: return prefill_attention_impl<4, T>(q, k_cache, v_cache, tables, row_seqs, lens, scale, out);
      case 128: return prefill_attention_impl<8, T>(q, k_cache, v_cache, tables, row_seqs, lens, scale, out);
      case 256: return prefill_attention_impl<16, T>(q, k_cache, v_cache, tables, row_seqs, lens, scale, out);
      default: TORCH_CHECK(false, "prefill_attention: head_dim must be 16, 32, 64, 128 or 256, got ", q.size(2));
    }
  });
  return out;
}
