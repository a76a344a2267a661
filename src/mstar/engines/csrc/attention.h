// decode_attention: one query token per sequence against its keys and values read in place
// from the paged cache [blocks, block_size, kv_heads, head_dim] through its block table.
// A row's keys are taken in ranges of kRangeKeys (whole blocks); a work item is one range of
// one row, its KV heads together (or one KV head each when there are few ranges for the
// threads): for every query head, scores over 16-key tiles (one horizontal-add tree per tile),
// an exact softmax over the range, then the weighted sum of values, all in float32, each key
// and value read once for all query heads of its KV head. A row of one range is written out
// directly; a longer row's ranges (their maxima, sums and weighted values) are merged after,
// so one long sequence's decode spreads over every thread. float32 and bfloat16 caches are
// read as they are stored, so a bfloat16 cache moves half the bytes: its keys scored as they
// are (AVX-512 BF16 dot products of the stored bits) or widened on load, its values widened.

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

template <int J, typename T>
inline vf16 dot(const vf16* qv, const T* k) {
  vf16 kv[J];
  load_row<J>(k, kv);
  vf16 acc = qv[0] * kv[0];
  for (int j = 1; j < J; ++j) acc += qv[j] * kv[j];
  return acc;
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

// One score: the scaled dot product of a query (as attend_group holds it) and a key.
template <int J, typename T>
inline vf16 score(const vf16* q, const T* k) {
#if defined(__AVX512BF16__)
  if constexpr (kDotsOfBits<J, T>) return dot_bits<J>(q, k);
#endif
  return dot<J>(q, k);
}

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

// Blocks of keys scored (or summed) for every query head of an item before moving on: their
// keys or values stay in L1 across the item's heads.
constexpr int64_t kChunkKeys = 64;

// Where an item reads: a row's keys [begin, end) (begin on a block's start), in blocks of
// block_size tokens token_stride elements apart.
struct Geometry {
  int64_t block_size, token_stride, begin, end;
};

// `group` query heads (rows of q, contiguous; `per_kv` of them to each KV head, the first
// reading `keys` and `values`, the next KV head's D further) against keys [g.begin, g.end) of
// one sequence; J = head_dim / 16. A row's KV heads go together, block by block: a block's
// tokens are read whole (all heads side by side) instead of a slice per head, far apart. With
// `stats` null, the normalised output goes to `out`; otherwise the range's softmax: each head's
// maximum and sum of exponentials to stats (2 floats) and its weighted values to sums (J
// vectors, in load_row's arrangement). `s` holds group x padded scores, `work` 3 x group x J
// vectors, `totals` 2 x group floats.
template <int J, typename T>
void attend_group(const T* q, int64_t group, int64_t per_kv, const T* keys, const T* values, const int64_t* table,
                  const Geometry& g, float scale, T* out, float* stats, vf16* sums, float* s, vf16* work,
                  float* totals) {
  constexpr int D = 16 * J;
  const int64_t bs = g.block_size, stride = g.token_stride, begin = g.begin, end = g.end;
  const int64_t padded = (end - begin + 15) / 16 * 16, first = begin / bs, last = (end + bs - 1) / bs;
  const int64_t chunk = std::max<int64_t>(1, kChunkKeys / bs);
  const float lowest = -std::numeric_limits<float>::infinity();
  vf16* qv = work;                      // [group][J] scaled queries
  vf16* acc = work + group * J;         // [group][J] weighted values
  vf16* maxima = work + 2 * group * J;  // [group] per-lane maxima of the scores
  // Scores are scaled with the query, or after the dot products of bits (kDotsOfBits).
  const float score_scale = kDotsOfBits<J, T> ? scale : 1.f;
  for (int64_t h = 0; h < group; ++h) {
    if constexpr (kDotsOfBits<J, T>) {
      std::memcpy(qv + h * J, q + h * D, D * sizeof(T));  // the first J / 2 vectors
    } else {
      load_row<J>(q + h * D, qv + h * J);
      for (int j = 0; j < J; ++j) qv[h * J + j] *= scale;
    }
    for (int j = 0; j < J; ++j) acc[h * J + j] = vf16{};
    maxima[h] = splat(lowest);
    for (int64_t t = end - begin; t < padded; ++t) s[h * padded + t] = lowest;
  }
  for (int64_t c = first; c < last; c += chunk) {
    const int64_t c_end = std::min(last, c + chunk);
    for (int64_t h = 0; h < group; ++h) {
      const vf16* qh = qv + h * J;
      float* sh = s + h * padded;
      vf16 tiles_max = maxima[h];
      for (int64_t b = c; b < c_end; ++b) {
        const int64_t t0 = b * bs - begin, n = std::min(bs, end - b * bs);
        const T* kb = keys + table[b] * bs * stride + (h / per_kv) * D;
        // The first head of a KV head fetches a chunk ahead: the next chunk's keys, after the
        // last the first chunk's values. (A block's tokens past the range's end are in the cache
        // all the same.)
        const T* ahead = nullptr;
        if (h % per_kv == 0) {
          const int64_t next = b + chunk, wrapped = next - (last - first);
          if (next < last) {
            ahead = keys + table[next] * bs * stride + (h / per_kv) * D;
          } else if (wrapped < last) {
            ahead = values + table[wrapped] * bs * stride + (h / per_kv) * D;
          }
        }
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
          if (ahead != nullptr)
            for (int r = 0; r < 16; ++r) prefetch_token<D>(ahead + (i + r) * stride);
          vf16 a[16];
          for (int r = 0; r < 16; ++r) a[r] = score<J>(qh, kb + (i + r) * stride);
          const vf16 tile = sum16(a) * score_scale;
          store16(sh + t0 + i, tile);
          tiles_max = select(tiles_max > tile, tiles_max, tile);
        }
        for (; i < n; ++i) {
          const float x = hsum(score<J>(qh, kb + i * stride)) * score_scale;
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
    totals[2 * h] = m;
    totals[2 * h + 1] = hsum(total);
  }
  for (int64_t c = first; c < last; c += chunk) {
    const int64_t c_end = std::min(last, c + chunk);
    for (int64_t h = 0; h < group; ++h) {
      const float* sh = s + h * padded;
      vf16 a[J];
      for (int j = 0; j < J; ++j) a[j] = acc[h * J + j];
      for (int64_t b = c; b < c_end; ++b) {
        const int64_t t0 = b * bs - begin, n = std::min(bs, end - b * bs);
        const T* vb = values + table[b] * bs * stride + (h / per_kv) * D;
        if (h % per_kv == 0 && b + chunk < last) {  // the next chunk's values
          const T* ahead = values + table[b + chunk] * bs * stride + (h / per_kv) * D;
          for (int64_t i = 0; i < n; ++i) prefetch_token<D>(ahead + i * stride);
        }
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
  for (int64_t h = 0; h < group; ++h) {
    if (stats == nullptr) {
      store_row<J>(acc + h * J, 1.f / totals[2 * h + 1], out + h * D);
    } else {
      stats[2 * h] = totals[2 * h];  // the maximum, then the sum of exponentials
      stats[2 * h + 1] = totals[2 * h + 1];
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
  const int64_t item_heads = per_item * group;
  std::vector<float> stats(partials * heads * 2);
  std::vector<vf16> sums(partials * heads * J);
  int64_t keys = 0;
  for (int64_t r = 0; r < rows; ++r) keys += lp[r];
  const int64_t item_bytes = 2 * keys / units[rows] * per_item * D * int64_t(sizeof(T));  // its keys and values
  at::parallel_for(0, units[rows] * split, grain_for(item_bytes), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(item_heads * ((range_keys + 15) / 16 * 16));
    std::vector<vf16> work(3 * item_heads * J);
    std::vector<float> totals(2 * item_heads);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t unit = item / split, h = (item % split) * per_item;
      const int64_t row = std::upper_bound(units.begin(), units.end(), unit) - units.begin() - 1;
      const int64_t range = unit - units[row], from = range * range_keys;
      const Geometry geometry{block_size, token_stride, from, std::min(lp[row], from + range_keys)};
      const int64_t slot = (partial[row] + range) * heads + h * group;  // its heads' partials
      attend_group<J>(qp + row * q_stride + h * group * D, item_heads, group, kp + h * D, vp + h * D,
                      tp + row * max_blocks, geometry, float(scale), op + (row * heads + h * group) * D,
                      partial[row] < 0 ? nullptr : stats.data() + 2 * slot,
                      partial[row] < 0 ? nullptr : sums.data() + J * slot, scores.data(), work.data(), totals.data());
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
