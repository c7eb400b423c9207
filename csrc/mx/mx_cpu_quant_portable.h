// The portable path of the CPU quantization kernel: what the base build runs (x86-64 baseline
// SSE2, and every Arm host, where it compiles to NEON). Included by mx_cpu_quant_kernel.cpp
// inside its per-ISA namespace. No intrinsics: GCC vector extensions (`vector_size(16)`, one
// 128-bit register of 8 x 16-bit lanes, `__builtin_shufflevector`, `__builtin_convertvector`),
// which GCC lowers to SSE2 on x86 and to NEON on aarch64.
//
// The design is the AVX2 path's (mx_cpu_quant_avx2.h, whose header comment has the numerics in
// full), on 8 lanes instead of 16:
//
// * Everything is encoded in 16-bit integer lanes from bf16 bit patterns. A block's amax is the
//   integer max of the abs keys (bf16 bits with the sign cleared; signed 16-bit max, since the
//   keys are <= 0x7FFF: SSE2 has no unsigned one). The scale byte comes from the amax key in
//   the same lanes (the vector form of mx::scale_byte_from_amax_key), and an element's code is
//       min(base(x) - ((scale_byte - bias) << M), max_code) | sign,
//   base(x) = the bf16 exponent and mantissa rounded to M bits (nearest even, carrying into the
//   exponent), exact whenever the element is a normal of the element format. A 32-element run
//   with a code below the smallest normal (which a bf16 zero or subnormal always gets, see
//   code_offsets), or in a block of a tiny scale, is redone by the exact scalar path
//   (mx::encode_elem_lane on x * 2^-e, as the reference computes it); NaN/Inf blocks then get
//   kElemNaN. So the bytes are the same as every other build's for every input.
// * fp32 and fp16 inputs are staged as "jammed bf16" keys (the dropped 16 bits ORed into the
//   lowest kept bit: same amax order, exponent, above-1.75 test and nearest-even decisions at
//   M <= 3 bits), and the exact path reads their values. FP32 masters quantized as their bf16
//   parameter are rounded to bf16 while staged (mx::f32_to_bf16_bits_rne: the keys are then the
//   values), masters quantized as fp16 are rounded to fp16 (mx::round_f32_to_f16_value) and
//   staged like an fp16 input. The master is read once; the rounded values exist chunk by chunk.
// * Blocks along rows only (mx_quantize along the contiguous axis): the rows are one stream of
//   32-element blocks, taken 8 blocks (256 elements) at a time: the 8 block maxima are reduced
//   into one register by a transposing tree (unpack/shuffle + max, 3 levels: lane i = block i's
//   amax), the 8 scales computed in that register, and the 8 blocks encoded from L1.
// * Blocks down the columns, 32x32 tiles, dual-axis: strips of 32 rows, in chunks of up to 2048
//   columns (non-bf16 inputs staged chunk by chunk, each row segment one sequential stream with
//   the next row's prefetched), each chunk taken panel by panel (32 rows x 32 columns, 2 KiB of
//   bf16). Pass 1 reads the panel (each row's next panels prefetched) and keeps the columns'
//   amaxes in 4 registers (the column scales and code offsets stay there) and the row blocks'
//   maxima, 8 rows at a time, reduced by the max tree into their scales; pass 2 encodes the panel
//   from L1, both planes of the dual quantization from one load. The plane whose blocks run down
//   the columns is written in its final layout (per-lane offsets), with no strided second pass.
// * Work is spread with at::parallel_for over runs of row blocks or over strips, each thread one
//   contiguous range (one input stream per thread).
#pragma once

#if !defined(ZRW_CPU_ISA)
#error "mx_cpu_quant_portable.h is part of mx_cpu_quant_kernel.cpp"
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "../common/mx_format.h"
#include "mx_cpu_kernels.h"

namespace zrw::cpu::ZRW_CPU_ISA::portable_path {

using zrw::mx::ElemFormat;
using zrw::mx::ScaleMode;
using zrw::mx::kBlock;

typedef int16_t i16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint64_t u64x2 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int16_t i16x16 __attribute__((vector_size(32)));

// ---- 8-lane helpers ---------------------------------------------------------------------------

inline i16x8 splat(int v) { return i16x8{} + static_cast<int16_t>(v); }
inline i16x8 vmax(i16x8 a, i16x8 b) { return a > b ? a : b; }
inline i16x8 vmin(i16x8 a, i16x8 b) { return a < b ? a : b; }
inline i16x8 load8(const uint16_t* p) {
  i16x8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline i16x8 load8(const int16_t* p) {
  i16x8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(int16_t* p, i16x8 v) { __builtin_memcpy(p, &v, sizeof(v)); }
inline i16x8 abs8(i16x8 x) { return x & splat(0x7FFF); }
inline bool any(i16x8 v) {
  const u64x2 t = reinterpret_cast<u64x2>(v);
  return (t[0] | t[1]) != 0;
}
// Two registers of codes (each lane 0..255) -> 16 bytes.
inline void store_codes(uint8_t* p, i16x8 a, i16x8 b) {
  const i16x16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                            14, 15);
  const u8x16 bytes = __builtin_convertvector(ab, u8x16);
  __builtin_memcpy(p, &bytes, sizeof(bytes));
}
// 8 scale bytes (lanes 0..255) -> 8 bytes.
inline void store_bytes8(uint8_t* p, i16x8 v) {
  const u8x8 bytes = __builtin_convertvector(v, u8x8);
  __builtin_memcpy(p, &bytes, sizeof(bytes));
}
// m[0..7] -> one register whose lane i is the max of m[i]'s lanes (3 levels of unpack + max).
inline i16x8 max_tree(const i16x8* m) {
  i16x8 t[4], u[2];
  for (int i = 0; i < 4; ++i) {
    t[i] = vmax(__builtin_shufflevector(m[2 * i], m[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11),
                __builtin_shufflevector(m[2 * i], m[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15));
  }
  for (int i = 0; i < 2; ++i) {
    u[i] = vmax(__builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13),
                __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15));
  }
  return vmax(__builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14),
              __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15));
}
// Every lane: the max of v's lanes.
inline i16x8 hmax_all(i16x8 v) {
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  return vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
}
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 2); }

// ---- the 16-bit encode ------------------------------------------------------------------------

template <ElemFormat F>
struct Enc {
  using E = zrw::mx::Elem<F>;
  static constexpr int kShift = 7 - E::kMantBits;  // bf16 mantissa bits dropped
  static constexpr int kHalfMinusOne = (1 << (kShift - 1)) - 1;
  static constexpr int kMinNormalCode = 1 << E::kMantBits;
  static constexpr int kMaxCode =
      ((E::kEmax + E::kBias) << E::kMantBits) | (3 << (E::kMantBits - 2));
};

// E8M0 bytes of 8 amax keys (mx::scale_byte_from_amax_key on bf16 keys); NaN lanes ORed into
// nan_acc.
template <ElemFormat F>
inline i16x8 scale_bytes(i16x8 k, ScaleMode mode, i16x8& nan_acc) {
  using E = zrw::mx::Elem<F>;
  const i16x8 exp = reinterpret_cast<i16x8>(reinterpret_cast<u16x8>(k) >> 7);
  i16x8 e = exp - splat(127 + E::kEmax);
  // The comparison is -1 where the amax mantissa exceeds 1.75: one more power of two.
  if (mode == ScaleMode::RCeil) e -= (k & splat(0x7F)) > splat(0x60);
  e = vmax(vmin(e, splat(127)), splat(-127));
  i16x8 byte = e + splat(127);
  byte &= ~(exp == splat(0));  // zero (and subnormal) amax -> 0x00
  const i16x8 nan = exp == splat(0xFF);
  nan_acc |= nan;
  return (byte & ~nan) | (nan & splat(0xFF));
}

// Code offsets of scale bytes: (byte - bias) << M. Bytes <= bias (blocks whose amax is below
// ~2^-112 (E4M3) / 2^-97 (E5M2)) get 0x1000 instead, which makes every code negative: those
// blocks take the exact path. In exchange, no lane needs a test of its own for a bf16 zero or
// subnormal: with an offset >= 2^M, its base (<= 2^M) gives a code <= 0, below the normal range.
template <ElemFormat F>
inline i16x8 code_offsets(i16x8 bytes) {
  using E = zrw::mx::Elem<F>;
  const i16x8 normal = bytes > splat(E::kBias);
  return (((bytes - splat(E::kBias)) << E::kMantBits) & normal) | (splat(0x1000) & ~normal);
}

// The shared part of 8 elements' encode: base(x) and the sign.
template <ElemFormat F>
struct Prep {
  i16x8 base, sign;
  explicit Prep(i16x8 x) {
    using C = Enc<F>;
    const u16x8 ua = reinterpret_cast<u16x8>(abs8(x));
    const u16x8 lsb = (ua >> C::kShift) & 1;
    base = reinterpret_cast<i16x8>((ua + static_cast<uint16_t>(C::kHalfMinusOne) + lsb) >>
                                   C::kShift);
    sign = reinterpret_cast<i16x8>((reinterpret_cast<u16x8>(x) >> 8) & 0x80);
  }
  // The codes for one block scale offset; the raw codes' running minimum kept in `cmin` (a run
  // whose minimum is below the normal range takes the exact path: see below_normal).
  i16x8 code(i16x8 off, i16x8& cmin) const {
    using C = Enc<F>;
    const i16x8 c = base - off;
    cmin = vmin(cmin, c);
    return vmin(c, splat(C::kMaxCode)) | sign;
  }
};

// Whether any code whose minimum `cmin` holds lies below the element format's normal range.
template <ElemFormat F>
inline bool below_normal(i16x8 cmin) {
  return any(cmin < splat(Enc<F>::kMinNormalCode));
}

// ---- inputs -----------------------------------------------------------------------------------

// Where the elements come from: a bf16 weight (its bits are the keys and the values), an fp32
// or fp16 tensor (jammed keys; values as they are), or an fp32 master rounded to the bf16/fp16
// parameter dtype on the way (see the header comment).
enum class Src { BF16, F32, F16, MasterBF16, MasterF16 };

inline float bf16_value(uint16_t bits) {
  return zrw::mx::bits_f32(static_cast<uint32_t>(bits) << 16);
}
inline float to_float(uint16_t bf16_bits) { return bf16_value(bf16_bits); }
inline float to_float(float x) { return x; }

// 8 fp32 lanes (two registers of bit patterns) -> their high halves, in order.
inline i16x8 high_halves(u32x4 a, u32x4 b) {
  return __builtin_shufflevector(reinterpret_cast<i16x8>(a), reinterpret_cast<i16x8>(b), 1, 3, 5,
                                 7, 9, 11, 13, 15);
}
inline u32x4 load4(const float* p) {
  u32x4 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// fp32 bits whose high half is the bf16 rounding of x (mx::f32_to_bf16_bits_rne: nearest, ties
// to even). A NaN stays a NaN (its sign may not: only NaN-ness reaches the quantization, as a
// 0xFF block), by ORing in a quiet NaN's exponent after the add instead of a select.
inline u32x4 round_bf16_high(u32x4 u) {
  const u32x4 rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  const u32x4 nan = reinterpret_cast<u32x4>(reinterpret_cast<i32x4>(u & 0x7FFFFFFFu) >
                                            (i32x4{} + 0x7F800000));
  return rounded | (nan & 0x7FC00000u);
}

// fp32 bits whose high half is x's jammed bf16 key (the OR of the low 16 bits put into bit 16).
inline u32x4 jam_high(u32x4 u) { return u | (((u & 0xFFFFu) + 0xFFFFu) & 0x10000u); }

inline uint16_t jam(float v) {
  const uint32_t u = zrw::mx::f32_bits(v);
  return static_cast<uint16_t>((u >> 16) | ((u & 0xFFFFu) != 0 ? 1u : 0u));
}

// Source<S>::stage(x, keys, vals, n, ld): n (a multiple of 32) elements -> their keys (and
// values, where the exact path reads staged values); ld: the distance to the same elements of
// the next row of a strip, prefetched meanwhile (0: none).
template <Src S>
struct Source;

template <>
struct Source<Src::BF16> {
  using In = uint16_t;
  using Orig = uint16_t;  // the exact path reads the input itself
  static constexpr bool kDirect = true;
  static float value(In x) { return bf16_value(x); }
};
template <>
struct Source<Src::MasterBF16> {
  using In = float;
  using Orig = uint16_t;  // the staged keys are the rounded values
  static constexpr bool kDirect = false;
  static float value(In x) { return bf16_value(zrw::mx::f32_to_bf16_bits_rne(x)); }
  static void stage(const In* __restrict x, uint16_t* __restrict keys, float*, int64_t n,
                    int64_t ld) {
    for (int64_t j = 0; j < n; j += 16) {
      if (ld) prefetch(x + j + ld);
      for (int64_t h = j; h < j + 16; h += 8) {
        const i16x8 k =
            high_halves(round_bf16_high(load4(x + h)), round_bf16_high(load4(x + h + 4)));
        __builtin_memcpy(keys + h, &k, sizeof(k));
      }
    }
  }
};
template <>
struct Source<Src::F32> {
  using In = float;
  using Orig = float;  // the input itself
  static constexpr bool kDirect = false;
  static float value(In x) { return x; }
  static void stage(const In* __restrict x, uint16_t* __restrict keys, float*, int64_t n,
                    int64_t ld) {
    for (int64_t j = 0; j < n; j += 16) {
      if (ld) prefetch(x + j + ld);
      for (int64_t h = j; h < j + 16; h += 8) {
        const i16x8 k = high_halves(jam_high(load4(x + h)), jam_high(load4(x + h + 4)));
        __builtin_memcpy(keys + h, &k, sizeof(k));
      }
    }
  }
};
template <>
struct Source<Src::MasterF16> {
  using In = float;
  using Orig = float;  // the staged fp16 values
  static constexpr bool kDirect = false;
  static float value(In x) { return zrw::mx::round_f32_to_f16_value(x); }
  static void stage(const In* __restrict x, uint16_t* __restrict keys, float* __restrict vals,
                    int64_t n, int64_t) {
    for (int64_t j = 0; j < n; ++j) vals[j] = zrw::mx::round_f32_to_f16_value(x[j]);
    for (int64_t j = 0; j < n; ++j) keys[j] = jam(vals[j]);
  }
};
template <>
struct Source<Src::F16> {
  using In = at::Half;
  using Orig = float;  // the staged fp32 values
  static constexpr bool kDirect = false;
  static float value(In x) { return static_cast<float>(x); }
  static void stage(const In* __restrict x, uint16_t* __restrict keys, float* __restrict vals,
                    int64_t n, int64_t) {
    for (int64_t j = 0; j < n; ++j) vals[j] = static_cast<float>(x[j]);
    for (int64_t j = 0; j < n; ++j) keys[j] = jam(vals[j]);
  }
};

// Whether the exact path reads the staged fp32 values (rather than the input or the keys).
template <Src S>
constexpr bool kStagedValues = S == Src::MasterF16 || S == Src::F16;

// ---- the exact path ---------------------------------------------------------------------------

// One 32-element run: every element through x * 2^-e and mx::encode_elem_lane, as the portable
// reference computes it. blk_out / col_out may be null (layout not written).
template <ElemFormat F, typename O>
inline void encode_run_exact(const O* x, uint8_t blk_byte, const uint8_t* col_byte,
                             uint8_t* blk_out, uint8_t* col_out) {
  const float blk_inv = zrw::mx::inv_scale_from_byte(blk_byte);
  for (int j = 0; j < kBlock; ++j) {
    const float v = to_float(x[j]);
    if (blk_out) blk_out[j] = zrw::mx::encode_elem<F>(v * blk_inv);
    if (col_out) {
      col_out[j] = zrw::mx::encode_elem<F>(v * zrw::mx::inv_scale_from_byte(col_byte[j]));
    }
  }
}

// ---- blocks along rows only -------------------------------------------------------------------

// `nblocks` consecutive 32-element blocks of keys (and of the exact path's values `orig`), 8 at
// a time; codes to data[32 b ..], scale bytes to scale[b].
template <ElemFormat F, typename O>
void row_blocks(const uint16_t* __restrict keys, const O* orig, int64_t nblocks, ScaleMode mode,
                uint8_t* __restrict data, uint8_t* __restrict scale) {
  for (int64_t g = 0; g < nblocks; g += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, nblocks - g));
    const uint16_t* x = keys + kBlock * g;
    uint8_t* out = data + kBlock * g;
    i16x8 m[8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      if (b < n) {
        const uint16_t* p = x + kBlock * b;
        m[b] = vmax(vmax(abs8(load8(p)), abs8(load8(p + 8))),
                    vmax(abs8(load8(p + 16)), abs8(load8(p + 24))));
      } else {
        m[b] = splat(0);
      }
    }
    i16x8 nan = splat(0);
    const i16x8 bytes = scale_bytes<F>(max_tree(m), mode, nan);
    const i16x8 offs = code_offsets<F>(bytes);
    if (n == 8) {
      store_bytes8(scale + g, bytes);
    } else {
      uint8_t tmp[8];
      store_bytes8(tmp, bytes);
      std::memcpy(scale + g, tmp, n);
    }
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      if (b >= n) break;
      const uint16_t* p = x + kBlock * b;
      const i16x8 off = splat(offs[b]);
      i16x8 cmin = splat(0x7FFF);
      i16x8 c[4];
#pragma GCC unroll 4
      for (int h = 0; h < 4; ++h) c[h] = Prep<F>(load8(p + 8 * h)).code(off, cmin);
      if (__builtin_expect(below_normal<F>(cmin), 0)) {
        encode_run_exact<F>(orig + kBlock * (g + b), static_cast<uint8_t>(bytes[b]), nullptr,
                            out + kBlock * b, nullptr);
        continue;
      }
      store_codes(out + kBlock * b, c[0], c[1]);
      store_codes(out + kBlock * b + 16, c[2], c[3]);
    }
    if (__builtin_expect(any(nan), 0)) {
      for (int b = 0; b < n; ++b) {
        if (nan[b]) std::memset(out + kBlock * b, zrw::mx::kElemNaN, kBlock);
      }
    }
  }
}

// Per-thread buffers of the row path: one row chunk staged.
struct RowScratch {
  static constexpr int64_t kCols = 4096;
  alignas(16) uint16_t keys[kCols];
  alignas(16) float vals[kCols];
  alignas(16) uint16_t tail_keys[kBlock];
  alignas(16) float tail_vals[kBlock];
  alignas(16) uint8_t tail_out[kBlock];
};

// `rows` rows of K elements, blocks along the rows.
template <ElemFormat F, Src S>
void quantize_rows(const typename Source<S>::In* src, int64_t rows, int64_t K, ScaleMode mode,
                   uint8_t* data, uint8_t* scale) {
  using Sr = Source<S>;
  const int64_t KB = zrw::mx::ceil_div(K, kBlock);
  if constexpr (Sr::kDirect) {
    if (K % kBlock == 0) {
      // Whole blocks: the rows are one flat run of blocks, in groups of 8.
      const int64_t nblocks = rows * KB, ngroups = zrw::mx::ceil_div(nblocks, 8);
      at::parallel_for(0, ngroups, 64, [&](int64_t g0, int64_t g1) {
        const int64_t b0 = 8 * g0, b1 = std::min(nblocks, 8 * g1);
        row_blocks<F>(src + kBlock * b0, src + kBlock * b0, b1 - b0, mode, data + kBlock * b0,
                      scale + b0);
      });
      return;
    }
  }
  const int64_t kfull = K / kBlock * kBlock;
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K)),
                   [&](int64_t r0, int64_t r1) {
    auto s = std::make_unique<RowScratch>();
    for (int64_t r = r0; r < r1; ++r) {
      const typename Sr::In* x = src + r * K;
      uint8_t* d = data + r * K;
      uint8_t* sc = scale + r * KB;
      for (int64_t c0 = 0; c0 < kfull; c0 += RowScratch::kCols) {
        const int64_t n = std::min(RowScratch::kCols, kfull - c0);
        if constexpr (Sr::kDirect) {
          row_blocks<F>(x + c0, x + c0, n / kBlock, mode, d + c0, sc + c0 / kBlock);
        } else {
          Sr::stage(x + c0, s->keys, s->vals, n, 0);
          if constexpr (kStagedValues<S>) {
            row_blocks<F>(s->keys, static_cast<const float*>(s->vals), n / kBlock, mode, d + c0,
                          sc + c0 / kBlock);
          } else if constexpr (std::is_same_v<typename Sr::Orig, uint16_t>) {
            row_blocks<F>(s->keys, static_cast<const uint16_t*>(s->keys), n / kBlock, mode,
                          d + c0, sc + c0 / kBlock);
          } else {
            row_blocks<F>(s->keys, x + c0, n / kBlock, mode, d + c0, sc + c0 / kBlock);
          }
        }
      }
      if (kfull == K) continue;
      // The last partial block, zero padded (missing elements count as 0 for amax).
      const int64_t tail = K - kfull;
      for (int64_t j = 0; j < kBlock; ++j) {
        s->tail_vals[j] = j < tail ? Sr::value(x[kfull + j]) : 0.0f;
        s->tail_keys[j] = jam(s->tail_vals[j]);  // exact for bf16 values
      }
      row_blocks<F>(s->tail_keys, static_cast<const float*>(s->tail_vals), 1, mode, s->tail_out,
                    sc + kfull / kBlock);
      std::memcpy(d + kfull, s->tail_out, tail);
    }
  });
}

// ---- strips of 32 rows: blocks down the columns, 32x32 tiles, both axes ------------------------

// Which layouts one pass writes besides blocks down the columns: blocks along the row, 32x32
// tiles, or neither.
enum class BlockKind { None, Row, Tile };

struct Scratch {
  // 32 x 2048 bf16 = 128 KiB: the chunk stays in L2 between the two passes.
  static constexpr int64_t kCols = 2048;
  static constexpr int64_t kBlocks = kCols / kBlock;
  alignas(16) uint8_t col_byte[kCols];
  // Row blocks' scale bytes, [row][block]; the tiles' use row 0.
  alignas(16) uint8_t blk_byte[kBlock * kBlocks];
  // Non-bf16 inputs: the chunk's keys, and (fp16 values) the values the exact path reads.
  alignas(16) uint16_t stage[kBlock * kCols];
  alignas(16) float stage_vals[kBlock * kCols];
  // A strip's last partial 32-column block, zero padded, and its outputs.
  alignas(16) uint16_t tail_keys[kBlock * kBlock];
  alignas(16) float tail_vals[kBlock * kBlock];
  alignas(16) uint8_t tail_blk[kBlock * kBlock];
  alignas(16) uint8_t tail_col[kBlock * kBlock];
};

// One chunk: `nrows` (<= 32) rows of `ncols` (a multiple of 32, <= Scratch::kCols) keys at
// `src` (row stride ld), values for the exact path at `orig` (stride ld_orig); codes to
// blk_out / col_out (stride ld_out), scale bytes left in s.blk_byte / s.col_byte.
//
// Panel by panel (32 rows x 32 columns: one block of every row, 2 KiB of bf16): pass 1 reads
// the panel (its rows' next panels prefetched when `src` is the input itself) and keeps the
// columns' amaxes in 4 registers and the row blocks' maxima 8 rows at a time, whose scales come
// from the max tree; pass 2 encodes the panel again from L1, both planes from one load, the
// column offsets in registers.
template <ElemFormat F, BlockKind BK, bool COL, typename O>
void quantize_chunk(const uint16_t* src, int64_t ld, const O* orig, int64_t ld_orig,
                    int64_t nrows, int64_t ncols, ScaleMode mode, uint8_t* blk_out,
                    uint8_t* col_out, int64_t ld_out, Scratch& s, bool prefetch_src) {
  constexpr bool kNeedCols = COL || BK == BlockKind::Tile;
  constexpr int64_t kAhead = 2 * kBlock;  // prefetch distance: two panels
  const int64_t nb = ncols / kBlock;
  i16x8 blk_nan = splat(0), col_nan = splat(0);
  alignas(16) int16_t row_off[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t j = kBlock * b;
    // Pass 1: the panel's amax keys.
    i16x8 ck[4] = {splat(0), splat(0), splat(0), splat(0)};
    for (int64_t g = 0; g < nrows; g += 8) {
      i16x8 m[8];
#pragma GCC unroll 8
      for (int rr = 0; rr < 8; ++rr) {
        if (g + rr < nrows) {
          const uint16_t* p = src + (g + rr) * ld + j;
          if (prefetch_src) prefetch(p + kAhead);
          i16x8 a[4];
#pragma GCC unroll 4
          for (int h = 0; h < 4; ++h) {
            a[h] = abs8(load8(p + 8 * h));
            if constexpr (kNeedCols) ck[h] = vmax(ck[h], a[h]);
          }
          m[rr] = vmax(vmax(a[0], a[1]), vmax(a[2], a[3]));
        } else {
          m[rr] = splat(0);
        }
      }
      if constexpr (BK == BlockKind::Row) {
        const i16x8 bytes = scale_bytes<F>(max_tree(m), mode, blk_nan);
        store8(row_off + g, code_offsets<F>(bytes));
        const int n = static_cast<int>(std::min<int64_t>(8, nrows - g));
        for (int rr = 0; rr < n; ++rr) {
          s.blk_byte[(g + rr) * Scratch::kBlocks + b] = static_cast<uint8_t>(bytes[rr]);
        }
      }
    }
    i16x8 tile_off = splat(0), co[4];
    if constexpr (BK == BlockKind::Tile) {
      const i16x8 bytes =
          scale_bytes<F>(hmax_all(vmax(vmax(ck[0], ck[1]), vmax(ck[2], ck[3]))), mode, blk_nan);
      tile_off = code_offsets<F>(bytes);
      s.blk_byte[b] = static_cast<uint8_t>(bytes[0]);
    }
    if constexpr (COL) {
#pragma GCC unroll 4
      for (int h = 0; h < 4; ++h) {
        const i16x8 bytes = scale_bytes<F>(ck[h], mode, col_nan);
        co[h] = code_offsets<F>(bytes);
        store_bytes8(s.col_byte + j + 8 * h, bytes);
      }
    }

    // Pass 2: the elements, both layouts from one load (the panel is in L1).
    for (int64_t r = 0; r < nrows; ++r) {
      const uint16_t* p = src + r * ld + j;
      i16x8 boff = tile_off;
      if constexpr (BK == BlockKind::Row) boff = splat(row_off[r]);
      i16x8 cmin = splat(0x7FFF);
      i16x8 bc[4], cc[4];
#pragma GCC unroll 4
      for (int h = 0; h < 4; ++h) {
        const Prep<F> pr(load8(p + 8 * h));
        if constexpr (BK != BlockKind::None) bc[h] = pr.code(boff, cmin);
        if constexpr (COL) cc[h] = pr.code(co[h], cmin);
      }
      uint8_t* bo = BK != BlockKind::None ? blk_out + r * ld_out + j : nullptr;
      uint8_t* cout = COL ? col_out + r * ld_out + j : nullptr;
      if (__builtin_expect(below_normal<F>(cmin), 0)) {
        const uint8_t bbyte = BK == BlockKind::Row    ? s.blk_byte[r * Scratch::kBlocks + b]
                              : BK == BlockKind::Tile ? s.blk_byte[b]
                                                      : uint8_t{0};
        encode_run_exact<F>(orig + r * ld_orig + j, bbyte, s.col_byte + j, bo, cout);
        continue;
      }
      if constexpr (BK != BlockKind::None) {
        store_codes(bo, bc[0], bc[1]);
        store_codes(bo + 16, bc[2], bc[3]);
      }
      if constexpr (COL) {
        store_codes(cout, cc[0], cc[1]);
        store_codes(cout + 16, cc[2], cc[3]);
      }
    }
  }

  // NaN/Inf blocks and columns: their element bytes are kElemNaN.
  if (BK != BlockKind::None && any(blk_nan)) {
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t brow = BK == BlockKind::Row ? r * Scratch::kBlocks : 0;
      for (int64_t b = 0; b < nb; ++b) {
        if (s.blk_byte[brow + b] != zrw::mx::kScaleNaN) continue;
        std::memset(blk_out + r * ld_out + kBlock * b, zrw::mx::kElemNaN, kBlock);
      }
    }
  }
  if (COL && any(col_nan)) {
    for (int64_t j = 0; j < ncols; ++j) {
      if (s.col_byte[j] != zrw::mx::kScaleNaN) continue;
      for (int64_t r = 0; r < nrows; ++r) col_out[r * ld_out + j] = zrw::mx::kElemNaN;
    }
  }
}

// Rows [r0, r0 + 32) (clipped to N) of one matrix (N, K), in chunks of Scratch::kCols columns
// (non-bf16 chunks staged first); a last partial 32-column block through a zero-padded copy.
template <ElemFormat F, BlockKind BK, bool COL, Src S>
void quantize_strip(const typename Source<S>::In* src, int64_t N, int64_t K, int64_t r0,
                    ScaleMode mode, uint8_t* blk_data, uint8_t* blk_scale, uint8_t* col_data,
                    uint8_t* col_scale, Scratch& s) {
  using Sr = Source<S>;
  const int64_t nrows = std::min<int64_t>(kBlock, N - r0);
  const int64_t KB = zrw::mx::ceil_div(K, kBlock);
  const int64_t strip = r0 / kBlock;
  const int64_t kfull = K / kBlock * kBlock;
  auto write_scales = [&](int64_t c0, int64_t ncols, int64_t valid_cols) {
    const int64_t nb = ncols / kBlock;
    if constexpr (BK == BlockKind::Row) {
      for (int64_t r = 0; r < nrows; ++r) {
        std::memcpy(blk_scale + (r0 + r) * KB + c0 / kBlock, s.blk_byte + r * Scratch::kBlocks,
                    nb);
      }
    } else if constexpr (BK == BlockKind::Tile) {
      std::memcpy(blk_scale + strip * KB + c0 / kBlock, s.blk_byte, nb);
    }
    if constexpr (COL) std::memcpy(col_scale + strip * K + c0, s.col_byte, valid_cols);
  };
  constexpr int64_t ld_stage = Scratch::kCols;
  for (int64_t c0 = 0; c0 < kfull; c0 += Scratch::kCols) {
    const int64_t ncols = std::min(Scratch::kCols, kfull - c0);
    const typename Sr::In* x = src + r0 * K + c0;
    uint8_t* blk_out = blk_data ? blk_data + r0 * K + c0 : nullptr;
    uint8_t* col_out = col_data ? col_data + r0 * K + c0 : nullptr;
    if constexpr (Sr::kDirect) {
      quantize_chunk<F, BK, COL>(x, K, x, K, nrows, ncols, mode, blk_out, col_out, K, s, true);
    } else {
      // Row by row, each row segment one sequential stream, the next row's prefetched
      // meanwhile (without it the strided rows cost more than the whole encode).
      for (int64_t r = 0; r < nrows; ++r) {
        Sr::stage(x + r * K, s.stage + r * ld_stage, s.stage_vals + r * ld_stage, ncols, K);
      }
      if constexpr (kStagedValues<S>) {
        quantize_chunk<F, BK, COL>(s.stage, ld_stage, static_cast<const float*>(s.stage_vals),
                                   ld_stage, nrows, ncols, mode, blk_out, col_out, K, s, false);
      } else if constexpr (std::is_same_v<typename Sr::Orig, uint16_t>) {
        quantize_chunk<F, BK, COL>(s.stage, ld_stage, static_cast<const uint16_t*>(s.stage),
                                   ld_stage, nrows, ncols, mode, blk_out, col_out, K, s, false);
      } else {
        quantize_chunk<F, BK, COL>(s.stage, ld_stage, x, K, nrows, ncols, mode, blk_out, col_out,
                                   K, s, false);
      }
    }
    write_scales(c0, ncols, ncols);
  }
  if (kfull == K) return;
  const int64_t tail = K - kfull;
  for (int64_t r = 0; r < kBlock; ++r) {
    for (int64_t j = 0; j < kBlock; ++j) {
      const float v = r < nrows && j < tail ? Sr::value(src[(r0 + r) * K + kfull + j]) : 0.0f;
      s.tail_vals[r * kBlock + j] = v;
      s.tail_keys[r * kBlock + j] = jam(v);  // exact for bf16 values
    }
  }
  quantize_chunk<F, BK, COL>(s.tail_keys, kBlock, static_cast<const float*>(s.tail_vals), kBlock,
                             nrows, kBlock, mode, s.tail_blk, s.tail_col, kBlock, s, false);
  write_scales(kfull, kBlock, tail);
  for (int64_t r = 0; r < nrows; ++r) {
    if (BK != BlockKind::None) {
      std::memcpy(blk_data + (r0 + r) * K + kfull, s.tail_blk + r * kBlock, tail);
    }
    if (COL) std::memcpy(col_data + (r0 + r) * K + kfull, s.tail_col + r * kBlock, tail);
  }
}

template <ElemFormat F, BlockKind BK, bool COL, Src S>
void quantize_strips(const typename Source<S>::In* src, int64_t nmat, int64_t N, int64_t K,
                     ScaleMode mode, const QuantOutputs& out) {
  const int64_t KB = zrw::mx::ceil_div(K, kBlock), NB = zrw::mx::ceil_div(N, kBlock);
  const int64_t total = nmat * NB;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kBlock * K));
  at::parallel_for(0, total, grain, [&](int64_t i0, int64_t i1) {
    auto s = std::make_unique<Scratch>();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / NB;
      uint8_t* blk_data = nullptr;
      uint8_t* blk_scale = nullptr;
      if constexpr (BK == BlockKind::Row) {
        blk_data = out.row_data + m * N * K;
        blk_scale = out.row_scale + m * N * KB;
      } else if constexpr (BK == BlockKind::Tile) {
        blk_data = out.tile_data + m * N * K;
        blk_scale = out.tile_scale + m * NB * KB;
      }
      uint8_t* col_data = COL ? out.col_data + m * N * K : nullptr;
      uint8_t* col_scale = COL ? out.col_scale + m * NB * K : nullptr;
      quantize_strip<F, BK, COL, S>(src + m * N * K, N, K, (i % NB) * kBlock, mode, blk_data,
                                    blk_scale, col_data, col_scale, *s);
    }
  });
}

// ---- entry ------------------------------------------------------------------------------------

// Every layout combination the ops request (not blocks along rows together with tiles) for bf16,
// fp16 and fp32 inputs (fp32 optionally rounded to bf16/fp16 first); false if this path does
// not take the call.
inline bool quantize_matrices(const void* src, at::ScalarType src_dtype, at::ScalarType round_to,
                              int64_t nmat, int64_t N, int64_t K, ElemFormat fmt, ScaleMode mode,
                              const QuantOutputs& out) {
  if (out.row_data && out.tile_data) return false;
  auto with_src = [&](auto f_tag, auto s_tag) {
    constexpr ElemFormat F = decltype(f_tag)::value;
    constexpr Src S = decltype(s_tag)::value;
    using In = typename Source<S>::In;
    const In* x = static_cast<const In*>(src);
    if (out.row_data && !out.col_data) {
      quantize_rows<F, S>(x, nmat * N, K, mode, out.row_data, out.row_scale);
    } else if (out.row_data) {
      quantize_strips<F, BlockKind::Row, true, S>(x, nmat, N, K, mode, out);
    } else if (out.tile_data && out.col_data) {
      quantize_strips<F, BlockKind::Tile, true, S>(x, nmat, N, K, mode, out);
    } else if (out.tile_data) {
      quantize_strips<F, BlockKind::Tile, false, S>(x, nmat, N, K, mode, out);
    } else if (out.col_data) {
      quantize_strips<F, BlockKind::None, true, S>(x, nmat, N, K, mode, out);
    }
  };
  auto with_fmt = [&](auto s_tag) {
    if (fmt == ElemFormat::E4M3) {
      with_src(std::integral_constant<ElemFormat, ElemFormat::E4M3>{}, s_tag);
    } else {
      with_src(std::integral_constant<ElemFormat, ElemFormat::E5M2>{}, s_tag);
    }
  };
  if (src_dtype == at::kBFloat16) {
    with_fmt(std::integral_constant<Src, Src::BF16>{});
  } else if (src_dtype == at::kHalf) {
    with_fmt(std::integral_constant<Src, Src::F16>{});
  } else if (src_dtype == at::kFloat && round_to == at::kBFloat16) {
    with_fmt(std::integral_constant<Src, Src::MasterBF16>{});
  } else if (src_dtype == at::kFloat && round_to == at::kHalf) {
    with_fmt(std::integral_constant<Src, Src::MasterF16>{});
  } else if (src_dtype == at::kFloat) {
    with_fmt(std::integral_constant<Src, Src::F32>{});
  } else {
    return false;
  }
  return true;
}

}  // namespace zrw::cpu::ZRW_CPU_ISA::portable_path
