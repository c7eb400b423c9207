// The CPU quantization and dequantization kernels' entry points. mx_cpu_quant_kernel.cpp and
// mx_cpu_dequant_kernel.cpp are compiled once per instruction set (their interface, in plain
// C++: mx_cpu_isa.h); the functions at the end pick one build at first use (the best the CPU
// supports, or ZRW_CPU_ISA from the environment).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "../common/mx_format.h"
#include "mx_cpu_isa.h"

namespace zrw::cpu {

// Quantizes a contiguous stack of `nmat` matrices (N, K) of src_dtype (bf16, fp16, fp32) into
// every layout whose pointers are set, reading each element once. `round_to` is Undefined
// (quantize the elements as they are) or, for an fp32 source (an FP32 master weight), bf16 or
// fp16: each element is first rounded to that dtype the way torch converts it
// (mx::f32_to_bf16_bits_rne, mx::round_f32_to_f16_value), in the same pass, so the bytes are
// those of quantizing `src.to(round_to)` without that tensor ever existing.
// (The per-ISA builds take the source as an Src, mx_cpu_isa.h.)
using QuantizeMatricesFn = void (*)(const void* src, Src src_kind, int64_t nmat, int64_t N,
                                    int64_t K, mx::ElemFormat fmt, mx::ScaleMode mode,
                                    const QuantOutputs& out);

// Dequantizes n elements of one row: out[j] = decode(data[j]) * 2^(scale - 127), where the
// scale byte is scales[j / 32] (blocks along the row) or scales[j] (one per element: a row
// across blocks that run down the columns). fp32 product, as the reference computes it.
using DequantizeFn = void (*)(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                              int64_t n, float* out);

// The same products written as bf16 bits (mx_matmul's BF16 GEMM tiles): the top half of each fp32
// product's bits. Exact only when every product is a bf16 value (normal or zero), which
// mx_matmul checks before it takes the BF16 path (bf16_exact in mx_cpu.cpp); the kernels do not
// round.
using DequantizeBf16Fn = void (*)(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                                  int64_t n, uint16_t* out);

// The instruction set the kernels run with: "avx512", "avx2" or "base".
const char* active_isa();

// The inner GEMM of mx_matmul: dequantize tiles to fp32 and run the fp32 GEMM, or (where the CPU
// has native BF16 dot products: avx512_bf16, AMX-BF16, Arm BF16) dequantize to bf16 and run the
// BF16 GEMM, which accumulates in fp32. Decided once per process; ZRW_CPU_GEMM=fp32|bf16 forces
// one (tests run both on every machine).
enum class Gemm { FP32, BF16 };
Gemm gemm_path();
const char* gemm_path_name();
// Whether this CPU has native BF16 dot products.
bool cpu_has_native_bf16();

// How many mx_matmul calls ran each GEMM since the last reset: the fp32 GEMM (chosen, or for an
// fp16/fp32 result), the BF16 GEMM, and BF16-path calls handed to the fp32 GEMM because a
// scale lies at an extreme of the e8m0 range (or a block holds NaN/Inf). For tests and
// benchmarks.
struct GemmCounts {
  int64_t fp32 = 0, bf16 = 0, bf16_to_fp32 = 0;
};
GemmCounts gemm_counts();
void reset_gemm_counts();

// mx_matmul's persistent tile workspace (mx_cpu.cpp): its size in bytes, and freeing it
// (returns the bytes dropped; a call in flight keeps its buffer until it returns).
int64_t matmul_workspace_bytes();
int64_t free_matmul_workspace();

void quantize_matrices(const void* src, at::ScalarType src_dtype, at::ScalarType round_to,
                       int64_t nmat, int64_t N, int64_t K, mx::ElemFormat fmt, mx::ScaleMode mode,
                       const QuantOutputs& out);
void dequantize_row_blocks(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                           int64_t n, float* out);
void dequantize_per_element(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                            int64_t n, float* out);
void dequantize_row_blocks_bf16(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                                int64_t n, uint16_t* out);
void dequantize_per_element_bf16(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                                 int64_t n, uint16_t* out);
// The digest's two lane sums over words [begin, end) of `base` (common/digest_words.h), by the
// chosen build.
void digest_words(const unsigned char* base, int64_t begin, int64_t end, uint64_t sums[2]);

}  // namespace zrw::cpu
