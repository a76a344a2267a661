// mstar's native CPU kernels (built at first use by mstar.engines.native), one translation
// unit over:
//
//   simd.h          the 16-lane vectors (one AVX-512 register, or two AVX2 halves), exp, sums
//   attention.h     decode_attention over the paged KV cache; write_kv into it
//   prefill.h       prefill_attention: prefill chunks' rows over the paged cache, in tiles
//                   (bfloat16 on AMX where the CPU has it)
//   norms.h         rms_norm, add_rms_norm, rotary, silu_mul with torch's roundings
//   products.h      tiled products (float32, AVX-512 BF16, AMX) and the greedy head's argmax
//   collectives.h   ShmGroup: a tensor-parallel group's all-reduce, all-gather and commands
//                   over shared memory
//   llama_decode.h  the Llama decoder's decode layer and step in one call (model-specific)

#include "simd.h"
#include "attention.h"
#include "prefill.h"
#include "norms.h"
#include "products.h"
#include "collectives.h"
#include "llama_decode.h"

// Each call releases the GIL while it runs, as torch's own ops do: the event loop's Python
// goes on beside it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("decode_attention", &decode_attention, "Decode attention over a paged KV cache (see the source).", release());
  m.def("prefill_attention", &prefill_attention, "Prefill attention over a paged KV cache (see the source).",
        release());
  m.def("write_kv", &write_kv, "Keys and values written to their cache slots (see the source).", py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slots"), py::arg("k"), py::arg("v"), release());
  m.def("prefill_uses_amx", &prefill_uses_amx, "Whether prefill_attention takes such queries on AMX (see the source).");
  m.def("rms_norm", &rms_norm, "RMSNorm of rows (see the source).", release());
  m.def("add_rms_norm", &add_rms_norm, "The residual add and RMSNorm of rows (see the source).", release());
  m.def("rotary", &rotary, "Rotary embedding of heads (see the source).", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up (see the source).", release());
  m.def("screened_argmax", &screened_argmax, "ScreenedArgmax's candidates and exact choice (see the source).",
        release());
  m.def("decode_layer", &decode_layer, "One Llama decoder layer over decode rows (see the source).", py::arg("x"),
        py::arg("delta"), py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("weights"),
        py::arg("biases"), py::arg("transposed"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slots"), py::arg("tables"), py::arg("lens"), py::arg("scale"), py::arg("heads"),
        py::arg("invariant") = false, release());
  // Module-local: builds for other CPUs (native.build_for) load beside this one in a process.
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local(), "A Llama decoder's decode step in one call (see the source).")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, double, int64_t, bool>(), py::arg("embed"),
           py::arg("rope_cos"), py::arg("rope_sin"), py::arg("final_norm"), py::arg("eps"), py::arg("scale"),
           py::arg("heads"), py::arg("invariant") = false)
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_group", &DecodeStack::set_group, py::arg("group"), py::arg("vocab_start"))
      .def("forward", &DecodeStack::forward, release());
  py::class_<ShmGroup, std::shared_ptr<ShmGroup>>(m, "ShmGroup", py::module_local(),
                                                   "A tensor-parallel group over shared memory (see the source).")
      .def(py::init<at::Tensor, int64_t, int64_t, int64_t, int64_t, double>(), py::arg("region"), py::arg("rank"),
           py::arg("world"), py::arg("slot_bytes"), py::arg("command_bytes"), py::arg("timeout_s"))
      .def_static("region_bytes", &ShmGroup::region_bytes)
      .def_property_readonly("rank", &ShmGroup::rank)
      .def_property_readonly("world", &ShmGroup::world)
      .def_property_readonly("lost", &ShmGroup::lost)
      .def("all_reduce_", &ShmGroup::all_reduce_, release())
      .def("all_gather", &ShmGroup::all_gather, release())
      .def("send", &ShmGroup::send, release())
      .def("receive", &ShmGroup::receive, release())
      .def("abort", &ShmGroup::abort, release())
      .def("is_broken", &ShmGroup::is_broken);
  m.def("linear_argmax", &linear_argmax, "argmax_rows(linear(x, tiles, bias)) (see the source).", py::arg("x"),
        py::arg("tiles"), py::arg("bias") = py::none(), release());
  m.def("screened_tokens", &screened_tokens, "ScreenedArgmax's screen and choice in one call (see the source).",
        py::arg("x"), py::arg("screen"), py::arg("weight"), py::arg("dw_max"), py::arg("accum"), py::arg("sum_max"),
        py::arg("safety"), py::arg("unit"), py::arg("max_candidates"), py::arg("invariant") = false, release());
  m.def("argmax_rows", &argmax_rows, "Each row's first maximum (see the source).", release());
  m.def("linear_silu_mul", &linear_silu_mul, "silu_mul(linear(x, gate/up tiles)) in one pass (see the source).",
        release());
  m.def("pack_linear", &pack_linear, "Tile a weight [out, in] for linear (see the source).", release());
  m.def("linear", &linear, "x @ W.T + b over tiled weights (see the source).", py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none(), py::arg("invariant") = false, release());
}
