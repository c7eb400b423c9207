// The interface of the per-ISA CPU kernels (mx_cpu_quant_kernel.cpp, mx_cpu_dequant_kernel.cpp),
// in plain C++: those translation units are compiled once per instruction set into namespaces
// zrw::cpu::{base, avx2, avx512} and include no torch header. mx_cpu_kernels.h holds the entry
// points the ops call; mx_cpu_dispatch.cpp picks one build at first use.
#pragma once

#include <cstdint>
#include <functional>

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

// What the kernels read: a bf16, fp16 or fp32 tensor, or an fp32 master whose elements are first
// rounded to bf16 / fp16 as torch converts them (mx::f32_to_bf16_bits_rne,
// mx::round_f32_to_f16_value), so the bytes are those of quantizing `master.to(dtype)`.
enum class Src { BF16, F16, F32, F32AsBF16, F32AsF16 };

// at::parallel_for, defined in mx_cpu_dispatch.cpp (the kernels include no torch header).
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f);

#define ZRW_DECLARE_CPU_ISA(isa)                                                                   \
  namespace isa {                                                                                  \
  void quantize_matrices(const void* src, Src src_kind, int64_t nmat, int64_t N, int64_t K,        \
                         mx::ElemFormat fmt, mx::ScaleMode mode, const QuantOutputs& out);         \
  void dequantize_row_blocks(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,       \
                             int64_t n, float* out);                                               \
  void dequantize_per_element(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,      \
                              int64_t n, float* out);                                              \
  void dequantize_row_blocks_bf16(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,  \
                                  int64_t n, uint16_t* out);                                       \
  void dequantize_per_element_bf16(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales, \
                                   int64_t n, uint16_t* out);                                      \
  void digest_words(const unsigned char* base, int64_t begin, int64_t end, uint64_t sums[2]);      \
  }
ZRW_DECLARE_CPU_ISA(base)
ZRW_DECLARE_CPU_ISA(avx2)
ZRW_DECLARE_CPU_ISA(avx512)
#undef ZRW_DECLARE_CPU_ISA

}  // namespace zrw::cpu
