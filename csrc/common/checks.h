// Argument checks shared by every backend's kernels. Each message names the op, the argument,
// what was expected and what was found; TORCH_CHECK_VALUE / TORCH_CHECK_TYPE surface as Python
// ValueError / TypeError, TORCH_CHECK as RuntimeError.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>

#include "mx_format.h"
#include "names.h"

namespace zrw::checks {

inline bool is_fp8_elem(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// "floor" / "rceil" (names::kScaleModes, in the order of mx::ScaleMode).
inline mx::ScaleMode parse_scale_mode(const char* op, const std::string& scale_mode) {
  if (scale_mode == names::kScaleModes[0]) return mx::ScaleMode::Floor;
  if (scale_mode == names::kScaleModes[1]) return mx::ScaleMode::RCeil;
  TORCH_CHECK_VALUE(false, op, ": scale_mode must be \"", names::kScaleModes[0], "\" or \"",
                    names::kScaleModes[1], "\", got \"", scale_mode, "\"");
}

inline void check_elem_dtype(const char* op, const char* arg, at::ScalarType t) {
  TORCH_CHECK_TYPE(is_fp8_elem(t), op, ": ", arg,
                   " must be torch.float8_e4m3fn or torch.float8_e5m2, got ", t);
}

inline void check_device(const char* op, const char* arg, const at::Tensor& t,
                         c10::DeviceType expected) {
  TORCH_CHECK(t.device().type() == expected, op, ": ", arg, " must be on ",
              c10::DeviceTypeName(expected, /*lower_case=*/true), ", got a tensor on ", t.device());
}

inline void check_float_input(const char* op, const char* arg, const at::Tensor& x) {
  const auto t = x.scalar_type();
  TORCH_CHECK_TYPE(t == at::kBFloat16 || t == at::kHalf || t == at::kFloat, op, ": ", arg,
                   " must be torch.bfloat16, torch.float16 or torch.float32, got ", t);
}

inline void check_out_dtype(const char* op, at::ScalarType t) {
  TORCH_CHECK_TYPE(t == at::kBFloat16 || t == at::kHalf || t == at::kFloat, op,
                   ": out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got ", t);
}

inline void check_scale_dtype(const char* op, const char* arg, const at::Tensor& s) {
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat8_e8m0fnu, op, ": ", arg,
                   " must be torch.float8_e8m0fnu, got ", s.scalar_type());
}

// Wraps a possibly negative dim; names the argument and the valid range on failure.
inline int64_t wrap_dim(const char* op, const char* arg, int64_t dim, int64_t ndim) {
  TORCH_CHECK_INDEX(ndim > 0, op, ": ", arg, " must have at least one dimension, got a 0-d tensor");
  TORCH_CHECK_INDEX(dim >= -ndim && dim < ndim, op, ": dim must be in [", -ndim, ", ", ndim - 1,
                    "] for a ", ndim, "-d ", arg, ", got ", dim);
  return dim < 0 ? dim + ndim : dim;
}

// The weight ops take one matrix (N, K) or a stack of them (E, N, K).
inline void check_weight_rank(const char* op, const at::Tensor& w, const char* arg = "w") {
  TORCH_CHECK_VALUE(w.dim() == 2 || w.dim() == 3, op, ": ", arg,
                    " must be 2-d (N, K) or 3-d (E, N, K), got shape ", w.sizes());
}

// The *_from_master ops quantize an FP32 master weight as its bf16/fp16 parameter.
inline void check_master_dtype(const char* op, const at::Tensor& master) {
  TORCH_CHECK_TYPE(master.scalar_type() == at::kFloat, op,
                   ": master must be torch.float32 (the FP32 master weight), got ",
                   master.scalar_type());
}

inline void check_param_dtype(const char* op, at::ScalarType t) {
  TORCH_CHECK_TYPE(t == at::kBFloat16 || t == at::kHalf, op,
                   ": param_dtype must be torch.bfloat16 or torch.float16, got ", t);
}

// The scale of data blocked along `dim`: data's shape with that dim -> ceil(D/32).
inline std::vector<int64_t> scale_shape_along(at::IntArrayRef data_shape, int64_t dim) {
  std::vector<int64_t> s(data_shape.begin(), data_shape.end());
  s[dim] = mx::ceil_div(s[dim], mx::kBlock);
  return s;
}

// The scale of `data` blocked along `dim` must have data's shape with dim -> ceil(D/32).
inline void check_scale_matches(const char* op, const char* data_arg, const char* scale_arg,
                                const at::Tensor& data, const at::Tensor& scale, int64_t dim) {
  const auto expected = scale_shape_along(data.sizes(), dim);
  TORCH_CHECK_VALUE(scale.sizes().vec() == expected, op, ": ", scale_arg, " must have shape ",
                    at::IntArrayRef(expected), " for ", data_arg, " of shape ", data.sizes(),
                    " blocked along dim ", dim, ", got ", scale.sizes());
}

// Op-level checks every backend runs (device checks are the backend's own).

// mx_quantize_dual / mx_quantize_block: returns the parsed scale mode.
inline mx::ScaleMode check_weight_quantize_args(const char* op, const at::Tensor& w,
                                                at::ScalarType elem_dtype,
                                                c10::string_view scale_mode) {
  check_float_input(op, "w", w);
  check_weight_rank(op, w);
  check_elem_dtype(op, "elem_dtype", elem_dtype);
  return parse_scale_mode(op, std::string(scale_mode));
}

// mx_quantize_from_master: returns the parsed scale mode and the wrapped dim.
inline std::pair<mx::ScaleMode, int64_t> check_mx_quantize_from_master_args(
    const char* op, const at::Tensor& master, int64_t dim, at::ScalarType param_dtype,
    at::ScalarType elem_dtype, c10::string_view scale_mode) {
  check_master_dtype(op, master);
  check_param_dtype(op, param_dtype);
  check_elem_dtype(op, "elem_dtype", elem_dtype);
  const mx::ScaleMode mode = parse_scale_mode(op, std::string(scale_mode));
  return {mode, wrap_dim(op, "master", dim, master.dim())};
}

// mx_quantize_dual_from_master / mx_quantize_block_from_master: returns the parsed scale mode.
inline mx::ScaleMode check_master_weight_quantize_args(const char* op, const at::Tensor& master,
                                                       at::ScalarType param_dtype,
                                                       at::ScalarType elem_dtype,
                                                       c10::string_view scale_mode) {
  check_master_dtype(op, master);
  check_weight_rank(op, master, "master");
  check_param_dtype(op, param_dtype);
  check_elem_dtype(op, "elem_dtype", elem_dtype);
  return parse_scale_mode(op, std::string(scale_mode));
}

// mx_dequantize: returns the wrapped dim.
inline int64_t check_mx_dequantize_args(const char* op, const at::Tensor& data,
                                        const at::Tensor& scale, int64_t dim,
                                        at::ScalarType out_dtype) {
  check_elem_dtype(op, "data", data.scalar_type());
  check_scale_dtype(op, "scale", scale);
  check_out_dtype(op, out_dtype);
  const int64_t d = wrap_dim(op, "data", dim, data.dim());
  check_scale_matches(op, "data", "scale", data, scale, d);
  return d;
}

inline void check_mx_matmul_args(const char* op, const at::Tensor& a, const at::Tensor& a_scale,
                                 const at::Tensor& b, const at::Tensor& b_scale,
                                 at::ScalarType out_dtype) {
  check_elem_dtype(op, "a", a.scalar_type());
  check_elem_dtype(op, "b", b.scalar_type());
  check_scale_dtype(op, "a_scale", a_scale);
  check_scale_dtype(op, "b_scale", b_scale);
  check_out_dtype(op, out_dtype);
  TORCH_CHECK_VALUE(a.dim() == 2, op, ": a must be 2-d (M, K), got shape ", a.sizes());
  TORCH_CHECK_VALUE(b.dim() == 2, op, ": b must be 2-d (N, K), got shape ", b.sizes());
  TORCH_CHECK_VALUE(a.size(1) == b.size(1), op,
                    ": a (M, K) and b (N, K) must share K (both blocked along K), got a ",
                    a.sizes(), " and b ", b.sizes());
  check_scale_matches(op, "a", "a_scale", a, a_scale, 1);
  check_scale_matches(op, "b", "b_scale", b, b_scale, 1);
}

}  // namespace zrw::checks
