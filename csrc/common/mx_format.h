// MXFP8 bit helpers shared by every backend (OCP Microscaling v1.0).
//
// Everything here is branch-light scalar code on fp32 bit patterns, written so that the
// compiler vectorizes the loops that call it; there are no intrinsics, so the same header
// serves the CPU kernels, a CUDA kernel (add __host__ __device__) and the NPU adapter's
// layout code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace zrw::mx {

// 32 consecutive elements along one axis share one E8M0 scale.
constexpr int64_t kBlock = 32;
// E8M0 byte for NaN; also what a block holding NaN or +-Inf gets.
constexpr uint8_t kScaleNaN = 0xFF;
// Element byte written into 0xFF blocks (NaN in both E4M3FN and E5M2). The spec leaves these
// bytes unspecified; writing one fixed value keeps the output deterministic.
constexpr uint8_t kElemNaN = 0x7F;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum class ScaleMode { Floor, RCeil };
enum class ElemFormat { E4M3, E5M2 };

// __builtin_bit_cast (GCC >= 11, clang >= 9) rather than memcpy: the vectorizer sees through it.
inline uint32_t f32_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
inline float bits_f32(uint32_t u) { return __builtin_bit_cast(float, u); }

// Element format constants. Both formats have max = 1.75 * 2^emax, so the RCEIL rule reduces
// to "FLOOR, plus one when the amax mantissa exceeds 1.75" for both.
template <ElemFormat F>
struct Elem;

template <>
struct Elem<ElemFormat::E4M3> {
  static constexpr int kMantBits = 3;
  static constexpr int kBias = 7;
  static constexpr int kEmax = 8;         // exponent of the largest normal (448 = 1.75 * 2^8)
  static constexpr int kEminNormal = -6;  // smallest normal 2^-6; subnormal quantum 2^-9
  static constexpr float kMax = 448.0f;
};

template <>
struct Elem<ElemFormat::E5M2> {
  static constexpr int kMantBits = 2;
  static constexpr int kBias = 15;
  static constexpr int kEmax = 15;         // 57344 = 1.75 * 2^15
  static constexpr int kEminNormal = -14;  // subnormal quantum 2^-16
  static constexpr float kMax = 57344.0f;
};

// |x| as an integer key: for non-negative floats integer order is float order, and NaN keys
// sort above +Inf above every finite value. A block amax computed as the integer max of these
// keys is exact, vectorizes as a plain integer max, and propagates NaN without float compares.
inline uint32_t abs_key(float x) { return f32_bits(x) & 0x7FFFFFFFu; }

// E8M0 scale byte of a block from its amax key (see abs_key).
//   floor: e = floor(log2(amax)) - emax                 (OCP; torchao FLOOR; Ascend scale_alg=0)
//   rceil: smallest e with amax / 2^e <= max_elem       (cuBLAS/TE; Ascend scale_alg=1)
// both clamped to [-127, 127]; zero (and fp32-subnormal) amax -> 0x00; NaN/Inf -> 0xFF.
template <ElemFormat F>
inline uint8_t scale_byte_from_amax_key(uint32_t amax_key, ScaleMode mode) {
  const uint32_t exp_field = amax_key >> 23;
  if (exp_field == 0xFF) return kScaleNaN;
  // floor(log2(amax)) <= -127 for zero and fp32 subnormals, so e clamps to -127 in both modes.
  if (exp_field == 0) return 0;
  int e = static_cast<int>(exp_field) - 127 - Elem<F>::kEmax;
  // max = 1.75 * 2^emax: amax = M * 2^E needs one more power of two iff M > 1.75.
  if (mode == ScaleMode::RCeil && (amax_key & 0x7FFFFFu) > 0x600000u) e += 1;
  e = std::min(std::max(e, -127), 127);
  return static_cast<uint8_t>(e + 127);
}

// 2^(127 - byte): the factor that divides a block by its scale. Exact for every byte a finite
// block can get (0..247); 0xFF blocks are overwritten afterwards and use 0.
inline float inv_scale_from_byte(uint8_t byte) {
  if (byte == kScaleNaN) return 0.0f;
  const int exp = 127 - static_cast<int>(byte);  // in [-127, 127]
  if (exp >= -126) return bits_f32(static_cast<uint32_t>(exp + 127) << 23);
  return bits_f32(0x00400000u);  // 2^-127, an fp32 subnormal
}

// 2^(byte - 127) as fp32 (NaN for 0xFF): the dequantization factor.
inline float scale_from_byte(uint8_t byte) {
  if (byte == kScaleNaN) return bits_f32(0x7FC00000u);
  if (byte == 0) return bits_f32(0x00400000u);  // 2^-127, an fp32 subnormal
  return bits_f32(static_cast<uint32_t>(byte) << 23);
}

// Round an already-scaled fp32 value to the element format: nearest, ties to even, saturated to
// +-max; returns the element byte in the low 8 bits of a 32-bit lane. `y` must be finite
// (callers overwrite the elements of 0xFF blocks).
//
// Normal range: RNE to mbits mantissa bits in the integer domain (add half-ulp-minus-one plus
// the lowest kept bit, shift), which also carries into the exponent correctly; then rebias and
// saturate on the code. Below the smallest normal binade's top (|y| < 2^(emin+1)) the quantum is
// 2^(emin - mbits): adding 2^(emin - mbits + 23), whose ulp is that quantum, rounds to nearest
// even in hardware and leaves the integer multiple k in the low mantissa bits, and k is the code
// (subnormals, and 2^mbits + mantissa for the smallest normal binade).
//
// Written for GCC 12's vectorizer (callers narrow to bytes in a second loop; it gives up on the
// chain ending in a uint8 store): signed compares (AVX2 has no unsigned ones) and prvalue
// selects only — `c ? named_const : var` is an lvalue select that GCC lowers to a branch.
template <ElemFormat F>
inline uint32_t encode_elem_lane(float y) {
  using E = Elem<F>;
  constexpr int kShift = 23 - E::kMantBits;
  constexpr uint32_t kHalfMinusOne = (1u << (kShift - 1)) - 1u;
  constexpr int32_t kRebias = (127 - E::kBias) << E::kMantBits;
  // max = 1.75 * 2^emax: mantissa bits 0b11 followed by zeros.
  constexpr int32_t kMaxCode = ((E::kEmax + E::kBias) << E::kMantBits) | (3 << (E::kMantBits - 2));
  constexpr int32_t kMinNormalBits = (127 + E::kEminNormal) << 23;
  constexpr uint32_t kSmallMagicBits =
      static_cast<uint32_t>(127 + E::kEminNormal - E::kMantBits + 23) << 23;
  const uint32_t bits = f32_bits(y);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  const uint32_t rounded = abs_bits + kHalfMinusOne + ((abs_bits >> kShift) & 1u);
  int32_t normal_code = static_cast<int32_t>(rounded >> kShift) - kRebias;
  normal_code = normal_code < kMaxCode ? normal_code : kMaxCode + 0;
  const uint32_t small_code =
      f32_bits(bits_f32(abs_bits) + bits_f32(kSmallMagicBits)) - kSmallMagicBits;
  const uint32_t normal_mask =
      0u - static_cast<uint32_t>(static_cast<int32_t>(abs_bits) >= kMinNormalBits + 0);
  const uint32_t code =
      (static_cast<uint32_t>(normal_code) & normal_mask) | (small_code & ~normal_mask);
  return code | sign;
}

// ---------------------------------------------------------------------------------------------
// Rounding an fp32 master element to the parameter dtype, bit for bit what torch's conversion
// (`master.to(param_dtype)`, `param.copy_(master)`) gives, so that quantizing straight from the
// master yields the bytes of quantizing the bf16/fp16 parameter (mx_quantize_from_master).

// fp32 -> bf16 bits, round to nearest, ties to even, as c10::BFloat16 and at::vec do: add
// 0x7FFF plus the lowest kept bit and drop the low half. fp32 subnormals round into bf16
// subnormals (torch does not flush them), finite values past bf16's max round to +-Inf. A NaN
// needs the select (the add would carry it into Inf or flip its sign): it stays a quiet NaN of
// the same sign (torch writes 0x7FC0 or 0xFFFF depending on the path; only NaN-ness reaches the
// quantization, as a 0xFF block).
inline uint16_t f32_to_bf16_bits_rne(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

// fp32 -> the nearest fp16 value (ties to even), returned as the fp32 that holds it exactly:
// IEEE conversion, as F16C's vcvtps2ph and c10::Half do (fp16 subnormals kept, |x| >= 65520
// -> +-Inf, NaN stays NaN). Normal fp16 range (|x| >= 2^-14): the bias add on the bit pattern,
// 13 dropped bits, carrying into the exponent. Below it the quantum is 2^-24: adding 0.5f,
// whose ulp is that quantum, rounds to nearest even in hardware, and subtracting it is exact.
inline float round_f32_to_f16_value(float x) {
  constexpr uint32_t kMinNormalBits = 0x38800000u;  // 2^-14
  constexpr uint32_t kOverflowBits = 0x47800000u;   // 2^16: rounds past 65504
  const uint32_t u = f32_bits(x);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  uint32_t normal = (a + 0xFFFu + ((a >> 13) & 1u)) & ~0x1FFFu;
  normal = normal >= kOverflowBits ? 0x7F800000u : normal;
  const uint32_t small = f32_bits((bits_f32(a) + 0.5f) - 0.5f);
  const uint32_t mag = a > 0x7F800000u ? a : (a >= kMinNormalBits ? normal : small);
  return bits_f32(mag | sign);
}

template <ElemFormat F>
inline uint8_t encode_elem(float y) {
  return static_cast<uint8_t>(encode_elem_lane<F>(y));
}

// Element byte -> fp32 value (exact). NaN encodings decode to NaN.
template <ElemFormat F>
inline float decode_elem(uint8_t byte) {
  using E = Elem<F>;
  const uint32_t sign = (static_cast<uint32_t>(byte) & 0x80u) << 24;
  const uint32_t mag = byte & 0x7Fu;
  const uint32_t exp = mag >> E::kMantBits;
  const uint32_t mant = mag & ((1u << E::kMantBits) - 1);
  float v;
  if (F == ElemFormat::E4M3 && mag == 0x7F) {
    v = bits_f32(0x7FC00000u);
  } else if (F == ElemFormat::E5M2 && exp == 0x1F) {
    v = bits_f32(mant ? 0x7FC00000u : 0x7F800000u);
  } else if (exp == 0) {
    v = static_cast<float>(mant) / static_cast<float>(1 << (E::kMantBits - E::kEminNormal));
  } else {
    v = bits_f32(((exp - E::kBias + 127) << 23) | (mant << (23 - E::kMantBits)));
  }
  return bits_f32(f32_bits(v) | sign);
}

}  // namespace zrw::mx
