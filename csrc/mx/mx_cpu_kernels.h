// The CPU quantization kernel's interface. mx_cpu_quant_kernel.cpp is compiled once per
// instruction set into namespaces zrw::cpu::{base, avx2, avx512}; quantize_matrices() below
// picks one at first use (the best the CPU supports, or ZRW_CPU_ISA from the environment).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "../common/mx_format.h"

namespace zrw::cpu {

// Output pointers for matrix 0 of a dense stack of `nmat` matrices (N, K); null skips a layout.
struct QuantOutputs {
  uint8_t* row_data = nullptr;    // (N, K), blocks along K
  uint8_t* row_scale = nullptr;   // (N, ceil(K/32))
  uint8_t* col_data = nullptr;    // (N, K), blocks along N
  uint8_t* col_scale = nullptr;   // (ceil(N/32), K)
  uint8_t* tile_data = nullptr;   // (N, K), 32x32 tiles
  uint8_t* tile_scale = nullptr;  // (ceil(N/32), ceil(K/32))
};

// Quantizes a contiguous stack of `nmat` matrices (N, K) of src_dtype (bf16, fp16, fp32) into
// every layout whose pointers are set, reading each element once.
using QuantizeMatricesFn = void (*)(const void* src, at::ScalarType src_dtype, int64_t nmat,
                                    int64_t N, int64_t K, mx::ElemFormat fmt, mx::ScaleMode mode,
                                    const QuantOutputs& out);

#define ZRW_DECLARE_CPU_ISA(isa)                                                              \
  namespace isa {                                                                             \
  void quantize_matrices(const void* src, at::ScalarType src_dtype, int64_t nmat, int64_t N,  \
                         int64_t K, mx::ElemFormat fmt, mx::ScaleMode mode,                   \
                         const QuantOutputs& out);                                            \
  }
ZRW_DECLARE_CPU_ISA(base)
ZRW_DECLARE_CPU_ISA(avx2)
ZRW_DECLARE_CPU_ISA(avx512)
#undef ZRW_DECLARE_CPU_ISA

// The instruction set the kernels run with: "avx512", "avx2" or "base".
const char* active_isa();

void quantize_matrices(const void* src, at::ScalarType src_dtype, int64_t nmat, int64_t N,
                       int64_t K, mx::ElemFormat fmt, mx::ScaleMode mode, const QuantOutputs& out);

}  // namespace zrw::cpu
