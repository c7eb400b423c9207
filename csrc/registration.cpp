// Every zrw op schema, once. Kernels register per backend in their own files
// (TORCH_LIBRARY_IMPL(zrw, CPU, m) in csrc/mx/mx_cpu.cpp, ...); a backend that is not built
// simply has no kernel, and the dispatcher's error names the op and the device.
#include <torch/library.h>

TORCH_LIBRARY(zrw, m) {
  // MX quantization (docs/design.md §3-§4). Blocks of 32 elements share one float8_e8m0fnu scale.
  m.def("mx_quantize(Tensor x, int dim, ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "mx_quantize_dual(Tensor w, ScalarType elem_dtype, str scale_mode)"
      " -> (Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("mx_quantize_block(Tensor w, ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  // The same three layouts straight from an FP32 master weight (docs/design.md §5, the BF16-free
  // step): each element rounded to param_dtype (bf16 or fp16, as master.to(param_dtype) rounds)
  // and quantized in one read; the outputs are exactly those of the op above applied to
  // master.to(param_dtype), which is never materialized.
  m.def(
      "mx_quantize_from_master(Tensor master, int dim, ScalarType param_dtype,"
      " ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "mx_quantize_dual_from_master(Tensor master, ScalarType param_dtype,"
      " ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "mx_quantize_block_from_master(Tensor master, ScalarType param_dtype,"
      " ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("mx_dequantize(Tensor data, Tensor scale, int dim, ScalarType out_dtype) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "mx_matmul(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, ScalarType out_dtype)"
      " -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def("mx_expand_block_scale(Tensor block_scale, int n, int k, int dim) -> Tensor",
        {at::Tag::pt2_compliant_tag});

  // The native weight cache (docs/design.md §5). Stateful and eager-only: they run from layers' and
  // optimizer hooks outside compiled regions. quant_and_release returns, for "mxfp8",
  // [data_fwd, scale_fwd, data_bwd, scale_bwd]; for "mxfp8-32x32",
  // [data, scale_fwd, data, scale_bwd, block_scale] (one data tensor for both directions).
  // `trainable` (None: w.requires_grad) says whether an optimizer steps w: a DTensor's local
  // shard never requires grad itself (its DTensor does), and is released as trainable.
  m.def(
      "quant_and_release(Tensor w, str recipe, bool release, bool release_frozen,"
      " ScalarType elem_dtype, str scale_mode, str name, bool? trainable=None) -> Tensor[]");
  // Restores write into the storage a weight was released with, never into another one;
  // fill "master" takes its values from `source` (the FP32 master).
  m.def("restore(Tensor w, str fill, Tensor? source) -> ()");
  m.def("restore_weights(Tensor[] weights, str fill, Tensor?[] sources) -> int");
  // keep_released: a released weight stays released and takes its source (an FP32 master) as the
  // values its next quantization reads (the BF16-free optimizer step).
  // digests: where given, each weight written in place gets the digest of its new bytes
  // (MasterWeights' write check, docs/design.md §5, "Rules of truth").
  m.def(
      "assign_weights(Tensor[] weights, Tensor[] sources, bool keep_released=False,"
      " Tensor(a!)? digests=None) -> int");
  // The FP32 master a released weight's entry holds (keep_released), or None.
  m.def("cache_master(Tensor w) -> Tensor?");
  // skip: weights left as they are (zrw.cache.restore_all("master") passes those whose
  // restore from their master failed, so that no lossy fill reaches them).
  m.def("restore_all(str fill, Tensor[] skip) -> int");
  m.def("cache_invalidate(Tensor w, str fill) -> bool");
  m.def("cache_clear(str fill) -> ()");
  m.def("next_step() -> ()");
  m.def("cache_stats() -> (str[], int[])");
  m.def("cache_entries() -> (str[], str[], int[], int[], int[])");
  m.def("cache_state(Tensor w) -> int");
  m.def("cache_states(Tensor[] weights) -> int[]");
}
