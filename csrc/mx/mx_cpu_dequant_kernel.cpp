// The CPU dequantization loops, compiled once per instruction set like the quantization kernel
// (CMakeLists.txt) over the vectors of mx_cpu_simd.h: each element is decoded (the arithmetic of
// mx::decode_elem on fp32 lanes: normal codes rebias the exponent, subnormals are an exact
// int -> float conversion times 2^(emin - M), the NaN/Inf codes are selected last) and multiplied
// by its block's scale in fp32, the same product as the reference's, and written as fp32 or, for
// mx_matmul's BF16 GEMM tiles, as the top half of the product's bits (see DequantizeBf16Fn in
// mx_cpu_kernels.h for when that is exact). Plain C++, no torch header.
#include <algorithm>
#include <cstdint>

#include "../common/mx_format.h"
#include "mx_cpu_isa.h"
#include "mx_cpu_simd.h"

#ifndef ZRW_CPU_ISA
#error "compile mx_cpu_dequant_kernel.cpp with -DZRW_CPU_ISA=<base|avx2|avx512>"
#endif

namespace zrw::cpu::ZRW_CPU_ISA {
namespace {

using namespace simd;
using mx::ElemFormat;
using mx::kBlock;

// kLanes32 element bytes -> their fp32 values.
template <ElemFormat F>
inline VF decode_lanes(VU32 byte) {
  using E = mx::Elem<F>;
  const VU32 mag = byte & 0x7Fu;
  const VU32 normal = (mag << (23 - E::kMantBits)) + ((127u - E::kBias) << 23);
  const VF sub = __builtin_convertvector(reinterpret_cast<VI32>(mag), VF) *
                 (1.0f / static_cast<float>(1 << (E::kMantBits - E::kEminNormal)));
  VU32 v = mag > (1u << E::kMantBits) - 1 ? normal : reinterpret_cast<VU32>(sub);
  if constexpr (F == ElemFormat::E4M3) {
    v = mag == 0x7Fu ? VU32{} + 0x7FC00000u : v;
  } else {
    v = mag == 0x7Cu ? VU32{} + 0x7F800000u : v;
    v = mag > 0x7Cu ? VU32{} + 0x7FC00000u : v;
  }
  return reinterpret_cast<VF>(v | ((byte & 0x80u) << 24));
}

// kLanes32 scale bytes -> 2^(byte - 127) as fp32 (mx::scale_from_byte).
inline VF scale_lanes(VU32 byte) {
  VU32 bits = byte << 23;
  bits = byte == 0u ? VU32{} + 0x00400000u : bits;
  bits = byte == 0xFFu ? VU32{} + 0x7FC00000u : bits;
  return reinterpret_cast<VF>(bits);
}

inline VU32 bytes_lanes(const uint8_t* p) { return __builtin_convertvector(load<VB32>(p), VU32); }

// kLanes32 products to out: fp32, or bf16 bits (the top half of each product's bits).
inline void store_lanes(float* out, VF v) { store(out, v); }
inline void store_lanes(uint16_t* out, VF v) {
  store(out, __builtin_convertvector(reinterpret_cast<VU32>(v) >> 16, VH32));
}
inline void store1(float* out, float v) { *out = v; }
inline void store1(uint16_t* out, float v) { *out = static_cast<uint16_t>(mx::f32_bits(v) >> 16); }

// out[j] = decode(data[j]) * 2^(scales[j / 32] - 127), j < n.
template <ElemFormat F, typename Out>
void row_blocks(const uint8_t* data, const uint8_t* scales, int64_t n, Out* out) {
  int64_t j = 0;
  for (; j + kLanes32 <= n; j += kLanes32) {  // kLanes32 divides the block: one scale per step
    const float scale = mx::scale_from_byte(scales[j / kBlock]);
    store_lanes(out + j, decode_lanes<F>(bytes_lanes(data + j)) * scale);
  }
  for (; j < n; ++j) {
    store1(out + j, mx::decode_elem<F>(data[j]) * mx::scale_from_byte(scales[j / kBlock]));
  }
}

// out[j] = decode(data[j]) * 2^(scales[j] - 127), j < n.
template <ElemFormat F, typename Out>
void per_element(const uint8_t* data, const uint8_t* scales, int64_t n, Out* out) {
  int64_t j = 0;
  for (; j + kLanes32 <= n; j += kLanes32) {
    const VF scale = scale_lanes(bytes_lanes(scales + j));
    store_lanes(out + j, decode_lanes<F>(bytes_lanes(data + j)) * scale);
  }
  for (; j < n; ++j) store1(out + j, mx::decode_elem<F>(data[j]) * mx::scale_from_byte(scales[j]));
}

template <typename Out>
void row_blocks_any(ElemFormat fmt, const uint8_t* data, const uint8_t* scales, int64_t n,
                    Out* out) {
  if (fmt == ElemFormat::E4M3) {
    row_blocks<ElemFormat::E4M3>(data, scales, n, out);
  } else {
    row_blocks<ElemFormat::E5M2>(data, scales, n, out);
  }
}

template <typename Out>
void per_element_any(ElemFormat fmt, const uint8_t* data, const uint8_t* scales, int64_t n,
                     Out* out) {
  if (fmt == ElemFormat::E4M3) {
    per_element<ElemFormat::E4M3>(data, scales, n, out);
  } else {
    per_element<ElemFormat::E5M2>(data, scales, n, out);
  }
}

}  // namespace

void dequantize_row_blocks(ElemFormat fmt, const uint8_t* data, const uint8_t* scales, int64_t n,
                           float* out) {
  row_blocks_any(fmt, data, scales, n, out);
}

void dequantize_per_element(ElemFormat fmt, const uint8_t* data, const uint8_t* scales, int64_t n,
                            float* out) {
  per_element_any(fmt, data, scales, n, out);
}

void dequantize_row_blocks_bf16(ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                                int64_t n, uint16_t* out) {
  row_blocks_any(fmt, data, scales, n, out);
}

void dequantize_per_element_bf16(ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                                 int64_t n, uint16_t* out) {
  per_element_any(fmt, data, scales, n, out);
}

}  // namespace zrw::cpu::ZRW_CPU_ISA
