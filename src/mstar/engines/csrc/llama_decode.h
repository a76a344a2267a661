// The Llama family's decode step, the one model-specific part of the kernels: decode_layer, a
// Llama decoder layer over decode rows in one call (the kernels of attention.h, norms.h and
// products.h, in the layer-by-layer torch path's order), and DecodeStack, the whole decode
// step's layers in one call.

#pragma once

#include "attention.h"
#include "collectives.h"
#include "norms.h"
#include "prefill.h"
#include "products.h"

namespace {

// x @ W + b in the layout FusedLinear stored W in: tiles (pack_linear's, 3 or 4 dimensions),
// [in, out] (`transposed`) or [out, in]. `invariant`: see linear.
at::Tensor product(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool transposed,
                   bool invariant) {
  if (w.dim() > 2) return ::linear(x, w, bias, invariant);
  if (transposed) return bias.has_value() ? at::addmm(*bias, x, w) : at::mm(x, w);
  return at::linear(x, w, bias);
}

}  // namespace

// One Llama decoder layer over a batch of decode rows (one token each), in one call: the
// torch path's ops in its order and with its roundings (rms_norm, the q/k/v product, rotary
// on q and k, the keys and values written to their cache slots, decode_attention, the output
// product, add_rms_norm, gate/up, silu_mul, down), with no Python between them. `delta` is
// the previous layer's MLP output, added to `x` before the input norm (the add the torch
// path makes at the end of a layer). `invariant`: the products' (see linear), and attention
// through prefill_attention. Returns {the residual after attention, the MLP's output}.
// With a tensor-parallel `group`, the layer is this rank's shard (its heads, its share of the
// MLP): the output and down products' partial sums are summed over the group.
std::vector<at::Tensor> decode_layer_in(const at::Tensor& x, const c10::optional<at::Tensor>& delta,
                                        const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                                        const std::vector<at::Tensor>& weights,
                                        const std::vector<c10::optional<at::Tensor>>& biases,
                                        const std::vector<bool>& transposed, const at::Tensor& cos,
                                        const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens,
                                        double scale, int64_t heads, bool invariant, ShmGroup* group) {
  TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && transposed.size() == 4,
              "decode_layer: the q/k/v, output, gate/up and down products expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == x.scalar_type(),
              "decode_layer: contiguous caches [blocks, block_size, kv_heads, dim] of x's dtype expected");
  const int64_t rows = x.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  at::Tensor h;
  at::Tensor residual = x;
  if (delta.has_value()) {
    auto both = ::add_rms_norm(x, *delta, input_norm, eps);
    residual = both[0];
    h = both[1];
  } else {
    h = ::rms_norm(x, input_norm, eps);
  }
  const at::Tensor qkv = product(h, weights[0], biases[0], transposed[0], invariant);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "decode_layer: the q/k/v product's width is not "
              "(heads + 2 kv_heads) x dim");
  const at::Tensor qk = ::rotary(qkv.narrow(1, 0, (heads + kv_heads) * dim).view({rows, heads + kv_heads, dim}),
                               cos, sin);
  const at::Tensor v = qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim);
  write_slots(k_cache, v_cache, slots, qk.narrow(1, heads, kv_heads), v.view({rows, kv_heads, dim}), "decode_layer");
  // Invariant (deterministic serving): the prefill kernel, as the step's prefill rows take it.
  const at::Tensor attended =
      invariant ? ::prefill_attention(qk.narrow(1, 0, heads), k_cache, v_cache, tables,
                                      at::arange(rows, slots.options()), lens, scale)
                : ::decode_attention(qk.narrow(1, 0, heads), k_cache, v_cache, tables, lens, scale);
  at::Tensor o = product(attended.view({rows, heads * dim}), weights[1], biases[1], transposed[1], invariant);
  if (group != nullptr) group->all_reduce_(o);
  auto after = ::add_rms_norm(residual, o, post_norm, eps);
  const at::Tensor gate_up = product(after[1], weights[2], biases[2], transposed[2], invariant);
  at::Tensor down = product(::silu_mul(gate_up), weights[3], biases[3], transposed[3], invariant);
  if (group != nullptr) group->all_reduce_(down);
  return {after[0], down};
}

std::vector<at::Tensor> decode_layer(const at::Tensor& x, const c10::optional<at::Tensor>& delta,
                                     const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                                     const std::vector<at::Tensor>& weights,
                                     const std::vector<c10::optional<at::Tensor>>& biases,
                                     const std::vector<bool>& transposed, const at::Tensor& cos, const at::Tensor& sin,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                                     const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t heads,
                                     bool invariant) {
  return decode_layer_in(x, delta, input_norm, post_norm, eps, weights, biases, transposed, cos, sin, k_cache, v_cache,
                         slots, tables, lens, scale, heads, invariant, nullptr);
}

// A Llama decoder's decode step in one call: the embedding rows of the step's tokens, the
// rotary tables at their positions (rounded to the weights' dtype, the first half of the sine
// negated, as the torch path's `signed_sin`), every layer (decode_layer), then the final
// residual add and norm. Built once per model with its weights; `forward` takes the step's
// tokens, positions, each layer's key and value caches (in layer order), slots, block tables
// and lengths, and returns the final hidden states [rows, hidden]. The GIL is released for
// the whole step, not taken back between layers. `invariant`: the products' (see linear).
class DecodeStack {
 public:
  DecodeStack(at::Tensor embed, at::Tensor rope_cos, at::Tensor rope_sin, at::Tensor final_norm, double eps,
              double scale, int64_t heads, bool invariant)
      : embed_(std::move(embed)), cos_(std::move(rope_cos)), sin_(std::move(rope_sin)),
        final_norm_(std::move(final_norm)), eps_(eps), scale_(scale), heads_(heads), invariant_(invariant) {
    TORCH_CHECK(embed_.dim() == 2 && cos_.dim() == 2 && cos_.sizes() == sin_.sizes() && cos_.size(1) % 2 == 0,
                "DecodeStack: an embedding [vocab, hidden] and rotary tables [positions, head_dim] expected");
  }

  // Run as one rank's shard of a tensor-parallel decoder: the embedding holds ids
  // [vocab_start, vocab_start + its rows), the layers their heads and MLP share.
  void set_group(std::shared_ptr<ShmGroup> group, int64_t vocab_start) {
    group_ = std::move(group);
    vocab_start_ = vocab_start;
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
    at::Tensor x;
    if (group_) {  // this rank's rows of a vocabulary-parallel embedding, summed over the group
      const at::Tensor local = ids - vocab_start_;
      const at::Tensor outside = (local < 0).logical_or_(local >= embed_.size(0));
      x = embed_.index_select(0, local.clamp(0, embed_.size(0) - 1));
      x.masked_fill_(outside.unsqueeze(1), 0);
      group_->all_reduce_(x);
    } else {
      x = embed_.index_select(0, ids);
    }
    const at::Tensor cos = cos_.index_select(0, positions).to(x.scalar_type());
    const at::Tensor sin = sin_.index_select(0, positions).to(x.scalar_type());
    sin.narrow(1, 0, sin.size(1) / 2).neg_();  // a fresh tensor either way (index_select's)
    c10::optional<at::Tensor> delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto out = ::decode_layer_in(x, delta, layer.input_norm, layer.post_norm, layer.eps, layer.weights,
                                   layer.biases, layer.transposed, cos, sin, caches[2 * i], caches[2 * i + 1], slots,
                                   tables, lens, scale_, heads_, invariant_, group_.get());
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
  bool invariant_;
  std::vector<Layer> layers_;
  std::shared_ptr<ShmGroup> group_;
  int64_t vocab_start_ = 0;
};
