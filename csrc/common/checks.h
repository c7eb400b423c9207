// Argument checks shared by every backend's kernels. Each message names the op, the argument,
// what was expected and what was found; TORCH_CHECK_VALUE / TORCH_CHECK_TYPE surface as Python
// ValueError / TypeError, TORCH_CHECK as RuntimeError.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "mx_format.h"

namespace zrw::checks {

inline bool is_fp8_elem(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

inline mx::ScaleMode parse_scale_mode(const char* op, const std::string& scale_mode) {
  if (scale_mode == "floor") return mx::ScaleMode::Floor;
  if (scale_mode == "rceil") return mx::ScaleMode::RCeil;
  TORCH_CHECK_VALUE(false, op, ": scale_mode must be \"floor\" or \"rceil\", got \"", scale_mode,
                    "\"");
}

inline void check_elem_dtype(const char* op, const char* arg, at::ScalarType t) {
  TORCH_CHECK_TYPE(is_fp8_elem(t), op, ": ", arg,
                   " must be torch.float8_e4m3fn or torch.float8_e5m2, got ", t);
}

inline void check_device(const char* op, const char* arg, const at::Tensor& t,
                         c10::DeviceType expected) {
  TORCH_CHECK(t.device().type() == expected, op, ": ", arg, " must be on ",
              c10::DeviceTypeName(expected, /*lower_case=*/true), ", got a tensor on ",
              t.device());
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
inline void check_weight_rank(const char* op, const at::Tensor& w) {
  TORCH_CHECK_VALUE(w.dim() == 2 || w.dim() == 3, op,
                    ": w must be 2-d (N, K) or 3-d (E, N, K), got shape ", w.sizes());
}

// The scale of data blocked along `dim`: data's shape with that dim -> ceil(D/32).
inline std::vector<int64_t> scale_shape_along(at::IntArrayRef data_shape, int64_t dim) {
  std::vector<int64_t> s(data_shape.begin(), data_shape.end());
  s[dim] = mx::ceil_div(s[dim], mx::kBlock);
  return s;
}

}  // namespace zrw::checks
