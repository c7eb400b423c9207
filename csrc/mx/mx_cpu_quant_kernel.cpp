// The CPU quantization kernel: one algorithm, compiled once per instruction set (CMakeLists.txt:
// ZRW_CPU_ISA is base, avx2 or avx512, each with its -m flags) over the vectors of
// mx_cpu_simd.h (8, 16 or 32 16-bit lanes), and picked at load time by mx_cpu_dispatch.cpp.
// Plain C++: no torch header (threads through zrw::cpu::parallel_for).
//
// Numerics (docs/design.md §3): the whole encode runs in 16-bit integer lanes on bf16 bit
// patterns.
// * Amax: |x| is the bf16 pattern with the sign cleared; for non-negative bf16 integer order is
//   value order, NaN above Inf (mx::abs_key on 16 bits), so a block's amax is an integer max, and
//   the E8M0 byte comes from it in the same lanes (the vector form of
//   mx::scale_byte_from_amax_key; "mantissa above 1.75" is mantissa > 0x60).
// * Elements: the scale is a power of two, so x / 2^e only moves the exponent while the result
//   is a normal of the element format, and rounding x's 7-bit mantissa to M bits (nearest, ties
//   to even, carrying into the exponent) gives the element's code
//       code = base(x) - ((byte - bias) << M),  base(x) = (|x| + half-1 + lsb) >> (7 - M),
//   clamped to the largest finite code, sign ORed in. The subtraction is folded into the rounding
//   add: one constant per block (or column) k = half-1 - ((byte - bias) << 7), and
//       code = (|x| + lsb + k) >>arith (7 - M);
//   the two planes of the dual quantization share |x| + lsb and differ by k.
// * Where that identity does not hold the code comes out below 2^M: a zero or a bf16 subnormal
//   (code <= 0 in any block whose byte is above the bias), an element below the format's normal
//   range; blocks with a byte at or below the bias (amax below ~2^-112) and NaN/Inf blocks get
//   k = -0x8000, which makes every code negative. So one test, "a code below 2^M", finds each
//   32-element run the identity does not cover, and that run is redone by the exact path
//   (mx::encode_elem_lane on x * 2^-e, on 16 fp32 lanes, kElemNaN for 0xFF blocks). The bytes
//   are the reference's for every input; on randn data ~0.3% of runs per plane take it. The
//   exact path is out of line; the fast loops list the runs that need it and it runs after each
//   loop (a call inside one would clobber the loop's vector registers).
// * fp32 and fp16 inputs are taken as "jammed bf16" keys: the top 16 bits with the OR of the
//   dropped bits put into the lowest kept bit. Jamming is monotone (block amaxes keep their order,
//   exponent and above-1.75 test) and the jammed bit lies below every rounding position used
//   (M <= 3), so nearest-even rounding sees the same decision. An FP32 master quantized as its
//   bf16 parameter is rounded to bf16 as it is loaded (the keys are then the values); as its fp16
//   parameter, rounded to fp16 and jammed. The exact path reads the values themselves.
//
// Layouts and traversal:
// * Amaxes of kLanes consecutive blocks come from one reduction tree over their kLanes registers
//   (each the max of the block's registers, loaded in memory order; log2(kLanes) levels of two
//   shuffles and a max, and one permutation to lane i = block i), not a horizontal max per
//   block. Amaxes down the columns are a vertical max.
// * Blocks along rows only (mx_quantize along the contiguous axis): the rows are one stream of
//   blocks, 64 at a time (32, one tree, on AVX-512): the amaxes of the group first (independent
//   trees for the out-of-order core), then the codes from L1, two runs a test; a software
//   prefetch runs 4 KiB ahead. (The base build encodes each tree's 8 blocks after it, a run a
//   test, without the prefetch: see row_group.)
// * Blocks down the columns, 32x32 tiles, dual-axis: strips of 32 rows, in chunks of up to 2048
//   columns (128 KiB as 16-bit keys, held in L2). Pass 1 reads the chunk row by row (each row
//   segment one sequential stream, the next row prefetched), computes the row blocks' scales and
//   the columns' running amaxes, and stages fp32/fp16 inputs as keys; pass 2 encodes the chunk
//   from L2 row by row (rows 2*K bytes apart would share L1 sets), while the next chunk is
//   prefetched into L2. Both planes of the dual quantization come from that one read, the plane
//   whose blocks run down the columns written in its final layout.
// * A partial last block (K not a multiple of 32) goes through a copy padded with a real element
//   of its row (the amax is unchanged and no padding lane takes the exact path); only the real
//   bytes are copied out.
// * Large data planes (4 MiB and up, aligned) get non-temporal stores: they would only evict the
//   input. Threads take runs of row groups or of strips (one input stream each).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include "../common/mx_format.h"
#include "mx_cpu_isa.h"
#include "mx_cpu_simd.h"

#ifndef ZRW_CPU_ISA
#error "compile mx_cpu_quant_kernel.cpp with -DZRW_CPU_ISA=<base|avx2|avx512>"
#endif

namespace zrw::cpu::ZRW_CPU_ISA {
namespace {

using namespace simd;
using mx::ElemFormat;
using mx::kBlock;
using mx::ScaleMode;

constexpr int W = kLanes;      // lanes per register
constexpr int R = kBlock / W;  // registers per 32-element run
constexpr int64_t kNtMinElems = int64_t{4} << 20;

template <ElemFormat F>
struct Enc {
  using E = mx::Elem<F>;
  static constexpr int kShift = 7 - E::kMantBits;  // bf16 mantissa bits dropped
  static constexpr int kHalfMinusOne = (1 << (kShift - 1)) - 1;
  static constexpr int kMinNormalCode = 1 << E::kMantBits;
  static constexpr int kMaxCode =
      ((E::kEmax + E::kBias) << E::kMantBits) | (3 << (E::kMantBits - 2));
};

// ---- amax: the reduction tree -------------------------------------------------------------------
// fold: two registers whose leaves hold S lanes each -> one whose leaves hold S / 2, each lane the
// max of two lanes of one leaf. Shapes the ISAs do in one instruction or two: leaves wider than a
// 128-bit chunk take halves across chunks (vperm2i128, vshufi64x2); within a chunk, a's leaves'
// halves then b's (unpack, shufps); the last level (S = 2) shifts and blends. The leaves end up in
// a fixed order in the lanes, which one permutation puts back in block order (in_block_order).
constexpr int fold_src(int S, int i, bool hi) {  // lane i of the fold: lane of a|b (b from W)
  const int c = S > 8 ? 0 : i / 8, j = S > 8 ? i : i % 8, span = S > 8 ? W : 8;
  const int L = span / S, half = S / 2, t = j / half, k = j % half + (hi ? half : 0);
  return t < L ? c * 8 + t * S + k : W + c * 8 + (t - L) * S + k;
}
template <int S, int... I>
__attribute__((always_inline)) inline V fold(V a, V b, std::integer_sequence<int, I...>) {
  if constexpr (S == 2) {
    // Even lanes from a's pair maxima, odd lanes from b's: a blend written as masks (SSE2 has no
    // 16-bit blend; a shuffle there became a pextrw/pinsrw per lane).
    const V ea = vmax(a, reinterpret_cast<V>(reinterpret_cast<VU32>(a) >> 16));
    const V eb = vmax(b, reinterpret_cast<V>(reinterpret_cast<VU32>(b) << 16));
    return reinterpret_cast<V>((reinterpret_cast<VU32>(ea) & 0xFFFFu) |
                               (reinterpret_cast<VU32>(eb) & 0xFFFF0000u));
  } else {
    return vmax(__builtin_shufflevector(a, b, fold_src(S, I, false)...),
                __builtin_shufflevector(a, b, fold_src(S, I, true)...));
  }
}
// The leaf each lane holds after the tree over leaves first .. first + N - 1.
template <int N>
constexpr std::array<int, W> tree_leaves(int first) {
  std::array<int, W> out{};
  if constexpr (N == 1) {
    for (int i = 0; i < W; ++i) out[i] = first;
  } else {
    const auto a = tree_leaves<N / 2>(first), b = tree_leaves<N / 2>(first + N / 2);
    constexpr int S = 2 * W / N;
    for (int i = 0; i < W; ++i) {
      const int src = S == 2 ? (i % 2 ? W + i - 1 : i) : fold_src(S, i, false);
      out[i] = src < W ? a[src] : b[src - W];
    }
  }
  return out;
}
constexpr std::array<int, W> lane_of_leaf() {
  const auto leaves = tree_leaves<W>(0);
  std::array<int, W> lane{};
  for (int i = 0; i < W; ++i) lane[leaves[i]] = i;
  return lane;
}
constexpr std::array<int, W> kLaneOfLeaf = lane_of_leaf();
// The tree over leaves block(first) .. block(first + N - 1), depth first (few registers live at a
// time), the leaves loaded in ascending memory order: one stream the hardware prefetchers follow.
// (Loaded in the lanes' order, 0, 8, 2, 10, ... on AVX2, and in descending order, the row path
// from an FP32 master was 1.5-1.9x slower at 4096 x 4096 than with the former per-ISA code.)
// PAIRS: each pair's second block first (1, 0, 3, 2, ...), as the former AVX2 code read them.
// The row path takes it: from an FP32 master at 4096 x 4096 on AVX2, in-order leaves took
// 1.04-1.15x the former code's time and pairs 1.00-1.04x (one process, the same buffers); the
// strips' row trees were 1.03-1.04x slower with pairs, so they keep the plain order.
template <int N, bool PAIRS, typename Block>
__attribute__((always_inline)) inline V tree(Block& block, int first) {
  if constexpr (N == 1) {
    return block(first);
  } else if constexpr (N == 2 && PAIRS) {
    const V b = block(first + 1);
    const V a = block(first);
    return fold<W>(a, b, std::make_integer_sequence<int, W>{});
  } else {
    // Two statements: as a call's arguments, GCC evaluates the second first (the blocks were
    // loaded in descending order).
    const V a = tree<N / 2, PAIRS>(block, first);
    const V b = tree<N / 2, PAIRS>(block, first + N / 2);
    return fold<2 * W / N>(a, b, std::make_integer_sequence<int, W>{});
  }
}

constexpr bool even_then_odd(const std::array<int, W>& lane) {
  for (int j = 0; j < W; ++j) {
    if (lane[j] != (j < W / 2 ? 2 * j : 2 * (j - W / 2) + 1)) return false;
  }
  return true;
}
static_assert(W != 8 || even_then_odd(kLaneOfLeaf), "in_block_order's 8-lane form");
// Lane i of the whole tree -> lane kLaneOfLeaf[i]: lane j = block j.
template <int... I>
__attribute__((always_inline)) inline V in_block_order(V v, std::integer_sequence<int, I...>) {
  if constexpr (W == 8) {
    // The order is 0 4 1 5 2 6 3 7: even lanes, then odd ones. Two shifts and a saturating pack
    // (the keys are below 0x8000); SSE2 has no 16-bit shuffle across 32-bit lanes, and the
    // generic one became a pextrw/pinsrw per lane.
    const VI32 x = reinterpret_cast<VI32>(v);
    return pack_i32((x << 16) >> 16, x >> 16);
  } else {
    return __builtin_shufflevector(v, v, kLaneOfLeaf[I]...);
  }
}
// Lane j = the amax key of block(j), j < W.
template <bool PAIRS, typename Block>
__attribute__((always_inline)) inline V block_amaxes(Block& block) {
  return in_block_order(tree<W, PAIRS>(block, 0), std::make_integer_sequence<int, W>{});
}

// ---- scales -------------------------------------------------------------------------------------
// E8M0 bytes of W amax keys (mx::scale_byte_from_amax_key on bf16 keys).
template <ElemFormat F>
inline V scale_bytes(V k, ScaleMode mode) {
  const V exp = srl<7>(k);
  V e = exp - splat(127 + mx::Elem<F>::kEmax);
  // The compare is -1 where the amax mantissa exceeds 1.75: one more power of two.
  if (mode == ScaleMode::RCeil) e -= (k & splat(0x7F)) > splat(0x60);
  e = vmax(vmin(e, splat(127)), splat(-127));
  const V nan = exp == splat(0xFF);
  const V byte = (e + splat(127)) & ~(exp == splat(0));  // zero (and subnormal) amax -> 0x00
  return (byte & ~nan) | (nan & splat(0xFF));
}
// The code constants k of scale bytes (see the header comment); -0x8000 sends a block to the
// exact path.
template <ElemFormat F>
inline V code_consts(V byte) {
  constexpr int kBias = mx::Elem<F>::kBias;
  const V k = splat(Enc<F>::kHalfMinusOne) - ((byte - splat(kBias)) << 7);
  const V exact = (byte > splat(254)) | (byte <= splat(kBias));
  return (k & ~exact) | (splat(-0x8000) & exact);
}
template <ElemFormat F>
inline int16_t code_const(uint8_t byte) {
  constexpr int kBias = mx::Elem<F>::kBias;
  if (byte == mx::kScaleNaN || byte <= kBias) return -0x8000;
  return static_cast<int16_t>(Enc<F>::kHalfMinusOne - ((byte - kBias) << 7));
}
// W scale bytes (lanes 0..255) to out[0 .. n).
inline void store_scale_bytes(uint8_t* out, V bytes, int n) {
  if (n == W) return store(out, narrow(bytes));
  alignas(64) uint8_t tmp[W];
  store(tmp, narrow(bytes));
  std::memcpy(out, tmp, n);
}

// ---- sources ------------------------------------------------------------------------------------
template <Src S>
using In = std::conditional_t<S == Src::BF16 || S == Src::F16, uint16_t, float>;
template <Src S>
constexpr bool kStaged = S != Src::BF16;  // keys differ from the input: staged in pass 1

// One element as the fp32 value the quantization sees.
template <Src S>
inline float value(In<S> x) {
  if constexpr (S == Src::BF16) {
    return mx::bits_f32(static_cast<uint32_t>(x) << 16);
  } else if constexpr (S == Src::F16) {
    return f16_to_f32(x);
  } else if constexpr (S == Src::F32AsBF16) {
    return mx::bits_f32(static_cast<uint32_t>(mx::f32_to_bf16_bits_rne(x)) << 16);
  } else if constexpr (S == Src::F32AsF16) {
    return mx::round_f32_to_f16_value(x);
  } else {
    return x;
  }
}

// The high 16 bits of two registers of 32-bit lanes, in order.
template <int... I>
__attribute__((always_inline)) inline V high_halves(VU32 lo, VU32 hi,
                                                    std::integer_sequence<int, I...>) {
#if defined(__AVX2__) && !defined(__AVX512BW__)
  return reinterpret_cast<V>(_mm256_permute4x64_epi64(
      _mm256_packus_epi32(reinterpret_cast<__m256i>(lo >> 16), reinterpret_cast<__m256i>(hi >> 16)),
      0xD8));
#else
  return __builtin_shufflevector(reinterpret_cast<V>(lo), reinterpret_cast<V>(hi), (2 * I + 1)...);
#endif
}
// kLanes32 fp32 values -> keys in the high halves of their bits (the low halves are dropped):
// * bf16 rounding, to nearest even. A NaN is made +Inf first (the add could carry out of its
//   payload into the sign): an exponent-0xFF key either way, so its block and column get the
//   0xFF scale, and those runs take the exact path, which reads the element itself.
// * jammed bf16: bit 16 is ORed with the carry of (low half + 0xFFFF), set when a dropped bit is.
template <Src S>
__attribute__((always_inline)) inline VU32 key_bits(VU32 u) {
  if constexpr (S == Src::F32AsBF16) {
    u = reinterpret_cast<VU32>(nan_to_inf(reinterpret_cast<VF>(u)));
    return u + 0x7FFFu + ((u >> 16) & 1u);
  } else {
    return u | ((u & 0xFFFFu) + 0xFFFFu);
  }
}
// W fp32 values -> their keys (S: F32AsBF16, or jammed).
template <Src S>
__attribute__((always_inline)) inline V keys_from_f32(const float* f) {
  return high_halves(key_bits<S>(load<VU32>(f)), key_bits<S>(load<VU32>(f + kLanes32)),
                     std::make_integer_sequence<int, W>{});
}
// W elements -> their keys: bf16 bits, the bf16 rounding of an FP32 master, or jammed bf16.
// (Everything here is always_inline: GCC otherwise leaves the fp32 path a call per register.)
template <Src S>
__attribute__((always_inline)) inline V keys(const In<S>* p) {
  if constexpr (S == Src::BF16) {
    return load<V>(p);
  } else {
    constexpr Src kAs = S == Src::F32AsBF16 ? Src::F32AsBF16 : Src::F32;
    if constexpr (S == Src::F32 || S == Src::F32AsBF16) return keys_from_f32<kAs>(p);
    alignas(64) float staged[W];
    if constexpr (S == Src::F16) f16_to_f32(p, staged, W);
    if constexpr (S == Src::F32AsF16) round_to_f16(p, staged, W);
    return keys_from_f32<kAs>(staged);
  }
}

// ---- the exact path -----------------------------------------------------------------------------
// mx::encode_elem_lane on kLanes32 lanes (the same operations, so the same codes) of v * 2^-e, e
// from the scale bytes; kElemNaN where the byte is 0xFF.
template <ElemFormat F>
inline VB32 encode_lanes(VF v, VU32 byte) {
  using E = mx::Elem<F>;
  constexpr int kShift = 23 - E::kMantBits;
  constexpr int32_t kRebias = (127 - E::kBias) << E::kMantBits;
  constexpr int32_t kMaxCode = ((E::kEmax + E::kBias) << E::kMantBits) | (3 << (E::kMantBits - 2));
  constexpr int32_t kMinNormalBits = (127 + E::kEminNormal) << 23;
  constexpr uint32_t kMagic = (127 + E::kEminNormal - E::kMantBits + 23) << 23;
  VU32 inv = (254u - byte) << 23;  // mx::inv_scale_from_byte
  inv = byte == 254u ? VU32{} + 0x00400000u : inv;
  inv = byte == 255u ? VU32{} : inv;
  const VU32 bits = reinterpret_cast<VU32>(v * reinterpret_cast<VF>(inv));
  const VU32 sign = (bits >> 24) & 0x80u;
  const VU32 a = bits & 0x7FFFFFFFu;
  const VU32 rounded = a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u);
  VI32 normal = reinterpret_cast<VI32>(rounded >> kShift) - kRebias;
  normal = normal < kMaxCode ? normal : VI32{} + kMaxCode;
  const VU32 small =
      reinterpret_cast<VU32>(reinterpret_cast<VF>(a) + reinterpret_cast<VF>(VU32{} + kMagic)) -
      kMagic;
  VU32 code =
      (reinterpret_cast<VI32>(a) >= kMinNormalBits ? reinterpret_cast<VU32>(normal) : small) | sign;
  code = byte == 255u ? VU32{} + mx::kElemNaN : code;
  return __builtin_convertvector(code, VB32);
}

// One 32-element run of a row, from the input x: the block's codes (byte blk_byte) to blk_out and
// the columns' (bytes col_bytes) to col_out; either output may be null.
template <ElemFormat F, Src S>
__attribute__((noinline)) void exact_run(const In<S>* x, uint8_t blk_byte, const uint8_t* col_bytes,
                                         uint8_t* blk_out, uint8_t* col_out) {
  alignas(64) float v[kBlock];
  for (int j = 0; j < kBlock; ++j) v[j] = value<S>(x[j]);
  for (int h = 0; h < kBlock; h += kLanes32) {
    const VF f = load<VF>(v + h);
    if (blk_out) store(blk_out + h, encode_lanes<F>(f, VU32{} + blk_byte));
    if (col_out) {
      store(col_out + h,
            encode_lanes<F>(f, __builtin_convertvector(load<VB32>(col_bytes + h), VU32)));
    }
  }
}

// ---- the fast path ------------------------------------------------------------------------------
// |x| + the lsb that rounding to M bits keeps: the part of every code shared by the planes.
template <ElemFormat F>
__attribute__((always_inline)) inline V rounding_base(V x) {
  const V a = x & splat(0x7FFF);
  return a + (srl<Enc<F>::kShift>(a) & splat(1));
}
#if defined(__AVX512BW__)
// AVX-512, two consecutive runs (one register each; see encode_run): as in AVX2's form, the codes
// are clamped and tested as bytes, the two runs' in one register (packus), so each plane gets one
// 64-byte line; one permutation puts the bytes in order. (At 4096 x 4096 on a Xeon, one process:
// blocks along rows took 0.93-0.94x the time of a run at a time, narrowed with vpmovwb.)
template <ElemFormat F, bool BLK, bool COL>
__attribute__((always_inline)) inline bool encode_two_runs(const uint16_t* x, const V* kb,
                                                           const int16_t* kc, uint8_t* bo,
                                                           uint8_t* co, bool nt) {
  using C = Enc<F>;
  const __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + kBlock);
  const V t0 = rounding_base<F>(reinterpret_cast<V>(x0)),
          t1 = rounding_base<F>(reinterpret_cast<V>(x1));
  auto codes = [&](V k0, V k1) __attribute__((always_inline)) {
    return _mm512_packus_epi16(reinterpret_cast<__m512i>((t0 + k0) >> C::kShift),
                               reinterpret_cast<__m512i>((t1 + k1) >> C::kShift));
  };
  const __m512i max_code = _mm512_set1_epi8(static_cast<char>(C::kMaxCode));
  __m512i bc = max_code, cc = max_code;
  if constexpr (BLK) bc = codes(kb[0], kb[1]);
  if constexpr (COL) cc = codes(load<V>(kc), load<V>(kc + kBlock));
  const __m512i below = _mm512_set1_epi8(static_cast<char>(C::kMinNormalCode - 1));
  if (__builtin_expect(_mm512_cmple_epu8_mask(_mm512_min_epu8(bc, cc), below) != 0, 0)) {
    return false;
  }
  const __m512i sign = _mm512_packs_epi16(_mm512_srai_epi16(x0, 8), _mm512_srai_epi16(x1, 8));
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  auto out = [&](uint8_t* p, __m512i c) __attribute__((always_inline)) {
    // min(c, max code) | (sign & 0x80), in element order
    const __m512i v = _mm512_permutexvar_epi64(
        order, _mm512_ternarylogic_epi32(_mm512_min_epu8(c, max_code), sign,
                                         _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8));
    if (nt) return _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
    _mm512_storeu_si512(p, v);
  };
  if constexpr (BLK) out(bo, bc);
  if constexpr (COL) out(co, cc);
  return true;
}
#endif

// NR (1 or 2) consecutive 32-element runs of one row of keys x: codes for the block constants
// kb[0 .. NR) (BLK) and the column constants kc[0 .. 32 * NR) (COL), stored to bo / co. One test
// for all of them: false, with nothing stored, if any run needs the exact path (the caller then
// takes the runs one at a time).
template <ElemFormat F, bool BLK, bool COL, int NR = 1>
__attribute__((always_inline)) inline bool encode_run(const uint16_t* x, const V* kb,
                                                      const int16_t* kc, uint8_t* bo, uint8_t* co,
                                                      bool nt) {
  using C = Enc<F>;
#if defined(__AVX512BW__)
  if constexpr (NR == 2) return encode_two_runs<F, BLK, COL>(x, kb, kc, bo, co, nt);
#endif
#if defined(__AVX2__) && !defined(__AVX512BW__)
  // AVX2 (two registers per run): the same codes, clamped and tested as bytes. packus saturates
  // a negative code to 0 (below 2^M: the exact path, as in 16 bits) and one above 255 to 255
  // (then the largest code, as in 16 bits); one byte register holds the run, so the clamp, the
  // test and the sign take one instruction each instead of one per register. The bytes are in
  // packus' order (128-bit halves interleaved) until store_packed_run puts them in order.
  __m256i xv[NR][2], bc[NR], cc[NR];
  const __m256i max_code = _mm256_set1_epi8(static_cast<char>(C::kMaxCode));
  const __m256i below = _mm256_set1_epi8(static_cast<char>(C::kMinNormalCode - 1));
  __m256i low = max_code;
#pragma GCC unroll 2
  for (int n = 0; n < NR; ++n) {
    __m256i t[2];
    for (int h = 0; h < 2; ++h) {
      xv[n][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlock * n + W * h));
      t[h] = reinterpret_cast<__m256i>(rounding_base<F>(reinterpret_cast<V>(xv[n][h])));
    }
    auto codes = [&](__m256i k0, __m256i k1) __attribute__((always_inline)) {
      return _mm256_packus_epi16(_mm256_srai_epi16(_mm256_add_epi16(t[0], k0), C::kShift),
                                 _mm256_srai_epi16(_mm256_add_epi16(t[1], k1), C::kShift));
    };
    if constexpr (BLK) {
      const __m256i k = reinterpret_cast<__m256i>(kb[n]);
      bc[n] = codes(k, k);
      low = _mm256_min_epu8(low, bc[n]);
    }
    if constexpr (COL) {
      const int16_t* k = kc + kBlock * n;
      cc[n] = codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k)),
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + W)));
      low = _mm256_min_epu8(low, cc[n]);
    }
  }
  if (__builtin_expect(
          _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(low, below), low)) != 0, 0)) {
    return false;
  }
#pragma GCC unroll 2
  for (int n = 0; n < NR; ++n) {
    const __m256i sign = _mm256_and_si256(_mm256_packs_epi16(xv[n][0], xv[n][1]),
                                          _mm256_set1_epi8(static_cast<char>(0x80)));
    if constexpr (BLK) {
      store_packed_run(bo + kBlock * n, _mm256_or_si256(_mm256_min_epu8(bc[n], max_code), sign),
                       nt);
    }
    if constexpr (COL) {
      store_packed_run(co + kBlock * n, _mm256_or_si256(_mm256_min_epu8(cc[n], max_code), sign),
                       nt);
    }
  }
  return true;
#else
  V bc[NR * R], cc[NR * R], sign[NR * R];
  V low = splat(0x7FFF);
#pragma GCC unroll 8
  for (int h = 0; h < NR * R; ++h) {
    const V xv = load<V>(x + W * h);
    const VU t = reinterpret_cast<VU>(rounding_base<F>(xv));
    sign[h] = srl<8>(xv) & splat(0x80);
    if constexpr (BLK) {
      bc[h] = reinterpret_cast<V>(t + reinterpret_cast<VU>(kb[h / R])) >> C::kShift;
      low = vmin(low, bc[h]);
    }
    if constexpr (COL) {
      cc[h] = reinterpret_cast<V>(t + load<VU>(kc + W * h)) >> C::kShift;
      low = vmin(low, cc[h]);
    }
  }
  if (__builtin_expect(any(low < splat(C::kMinNormalCode)), 0)) return false;
  const V max_code = splat(C::kMaxCode);
#pragma GCC unroll 8
  for (int h = 0; h < NR * R; ++h) {
    if constexpr (BLK) bc[h] = vmin(bc[h], max_code) | sign[h];
    if constexpr (COL) cc[h] = vmin(cc[h], max_code) | sign[h];
  }
  for (int n = 0; n < NR; ++n) {
    if constexpr (BLK) store_32_bytes(bo + kBlock * n, bc + R * n, nt);
    if constexpr (COL) store_32_bytes(co + kBlock * n, cc + R * n, nt);
  }
  return true;
#endif
}

// encode_run over NR runs; where its one test fails, each run on its own, and pend(n) for each
// run n that needs the exact path (the callers list it and encode it after their loop).
template <ElemFormat F, bool BLK, bool COL, int NR, typename Pend>
__attribute__((always_inline)) inline void encode_runs(const uint16_t* x, const V* kb,
                                                       const int16_t* kc, uint8_t* bo, uint8_t* co,
                                                       bool nt, Pend&& pend) {
  if (__builtin_expect(encode_run<F, BLK, COL, NR>(x, kb, kc, bo, co, nt), 1)) return;
  for (int n = 0; n < NR; ++n) {
    if (NR == 1 ||
        !encode_run<F, BLK, COL>(x + kBlock * n, kb + n, COL ? kc + kBlock * n : kc,
                                 BLK ? bo + kBlock * n : bo, COL ? co + kBlock * n : co, nt)) {
      pend(n);
    }
  }
}

// A last partial block of n elements, padded to 32 with copies of its first element.
template <typename T>
inline void pad_block(const T* src, int n, T* dst) {
  for (int j = 0; j < kBlock; ++j) dst[j] = src[j < n ? j : 0];
}

// ---- blocks along rows only ---------------------------------------------------------------------
// Blocks per group. AVX-512: one tree, as its former code had it (at 4096 x 4096 on a Xeon, one
// process: 0.94x the time of two trees).
constexpr int kGroup = W == 32 ? 32 : 64;
// Bytes ahead of the current block that the row stream prefetches: one bf16 group. (In elements,
// 2048, an FP32 master's stream ran 8 KiB ahead, and its row path was 1.07-1.2x slower at
// 4096 x 4096 on AVX2 than at 4 KiB, in one process against the same buffers.)
constexpr int64_t kRowPrefetchBytes = 4096;

struct RowScratch {
  alignas(64) uint16_t stage[kGroup * kBlock];  // fp32/fp16: the group's keys
  alignas(64) int16_t k[kGroup];
  alignas(64) uint8_t byte[kGroup];
  uint8_t pending[kGroup];  // blocks left to the exact path
};

// `nblk` (<= kGroup) consecutive whole blocks at src (one row's, or a flat run of rows' whose
// length is a multiple of 32). FULL: kGroup blocks (compile-time shapes).
template <ElemFormat F, Src S, bool FULL>
void row_group(const In<S>* src, int nblk, ScaleMode mode, uint8_t* data, uint8_t* scale, bool nt,
               RowScratch& s) {
  if constexpr (FULL) nblk = kGroup;
  const uint16_t* xs;
  if constexpr (kStaged<S>) {
    xs = s.stage;
  } else {
    xs = src;
  }
  // The blocks that need the exact path are listed here and encoded after the loop: exact_run
  // is out of line (it is large), and a call inside the loop clobbers every vector register, so
  // GCC rebuilt the loop's constants on every block (the strips' pass 2 took 1.05-1.12x the
  // former per-ISA code's time at 4096 x 4096 on AVX2; with the list, 0.91-0.98x).
  int npending = 0;
  // NR blocks from blk, one test (two runs a test on AVX2 and AVX-512: see encode_two_runs).
  auto encode = [&](int blk, auto nr) __attribute__((always_inline)) {
    constexpr int NR = decltype(nr)::value;
    V kb[NR];
    for (int n = 0; n < NR; ++n) kb[n] = splat(s.k[blk + n]);
    encode_runs<F, true, false, NR>(xs + kBlock * blk, kb, nullptr, data + kBlock * blk, nullptr,
                                    nt, [&](int n) __attribute__((always_inline)) {
                                      s.pending[npending++] = static_cast<uint8_t>(blk + n);
                                    });
  };
  constexpr std::integral_constant<int, 1> kOne;
  constexpr std::integral_constant<int, 2> kTwo;
  // AVX2 and AVX-512 encode a group's blocks after all its trees: independent work for the
  // latency of each tree and its scales (with one tree per 512 elements, the former AVX2 code
  // measured 1.6x the time). The base build (8 lanes, 8 blocks a tree) encodes each tree's
  // blocks right after it, without software prefetch, as its former code did: at 4096 x 4096 its
  // bf16 row path took 1.05-1.3x the former code's time with the AVX2 scheme, 1.04-1.07x this
  // way, and 1.02-1.04x with the balanced leaf below.
  constexpr bool kPerTree = W == 8;
#pragma GCC unroll 1
  for (int t0 = 0; t0 < nblk; t0 += W) {
    auto leaf = [&](int i) __attribute__((always_inline)) {
      const int blk = t0 + i;
      if (!FULL && blk >= nblk) return splat(0);
      const In<S>* p = src + kBlock * blk;
      if constexpr (FULL && !kPerTree) {
        for (int q = 0; q < kBlock; q += 64 / static_cast<int>(sizeof(In<S>))) {
          prefetch(p + q + kRowPrefetchBytes / static_cast<int64_t>(sizeof(In<S>)));
        }
      }
      V a[R];
#pragma GCC unroll 4
      for (int h = 0; h < R; ++h) {
        const V x = keys<S>(p + W * h);
        if constexpr (kStaged<S>) store(s.stage + kBlock * blk + W * h, x);
        a[h] = x & splat(0x7FFF);
      }
      // The registers' max as a balanced tree (the base build's 4: its row path 2-4% faster than
      // a chain, as its former code had it).
      for (int n = R / 2; n > 0; n /= 2) {
        for (int h = 0; h < n; ++h) a[h] = vmax(a[h], a[h + n]);
      }
      return a[0];
    };
    const V bytes = scale_bytes<F>(block_amaxes</*PAIRS=*/true>(leaf), mode);
    store_scale_bytes(scale + t0, bytes, std::min(W, nblk - t0));
    store(s.byte + t0, narrow(bytes));
    store(s.k + t0, code_consts<F>(bytes));
    if constexpr (kPerTree) {
      for (int blk = t0; blk < std::min(t0 + W, nblk); ++blk) encode(blk, kOne);
    }
  }
  if constexpr (!kPerTree) {
    if constexpr (FULL) {
#pragma GCC unroll 2
      for (int blk = 0; blk < kGroup; blk += 2) encode(blk, kTwo);
    } else {
      int blk = 0;
      for (; blk + 2 <= nblk; blk += 2) encode(blk, kTwo);
      if (blk < nblk) encode(blk, kOne);
    }
  }
  for (int i = 0; i < npending; ++i) {
    const int blk = s.pending[i];
    exact_run<F, S>(src + kBlock * blk, s.byte[blk], nullptr, data + kBlock * blk, nullptr);
  }
}

template <ElemFormat F, Src S>
void quantize_rows(const In<S>* src, int64_t rows, int64_t K, ScaleMode mode, uint8_t* data,
                   uint8_t* scale) {
  const int64_t KB = mx::ceil_div(K, kBlock);
  const bool nt = rows * K >= kNtMinElems && reinterpret_cast<uintptr_t>(data) % 64 == 0;
  if (K % kBlock == 0) {
    // Whole blocks: the rows are one flat run of blocks, in groups.
    const int64_t nblocks = rows * KB, ngroups = mx::ceil_div(nblocks, kGroup);
    parallel_for(0, ngroups, 16, [&](int64_t g0, int64_t g1) {
      RowScratch s;
      for (int64_t g = g0; g < g1; ++g) {
        const int n = static_cast<int>(std::min<int64_t>(kGroup, nblocks - kGroup * g));
        const In<S>* x = src + kBlock * kGroup * g;
        uint8_t* d = data + kBlock * kGroup * g;
        if (n == kGroup) {
          row_group<F, S, true>(x, n, mode, d, scale + kGroup * g, nt, s);
        } else {
          row_group<F, S, false>(x, n, mode, d, scale + kGroup * g, nt, s);
        }
      }
      if (nt) store_fence();
    });
    return;
  }
  // A partial last block in every row: whole blocks row by row, then the padded last block.
  const int64_t kfull = K / kBlock * kBlock;
  const int last = static_cast<int>(K - kfull);
  parallel_for(0, rows, std::max<int64_t>(1, 65536 / K), [&](int64_t r0, int64_t r1) {
    RowScratch s;
    alignas(64) In<S> pad[kBlock];
    alignas(64) uint8_t out[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      const In<S>* x = src + r * K;
      for (int64_t b0 = 0; b0 < kfull / kBlock; b0 += kGroup) {
        const int n = static_cast<int>(std::min<int64_t>(kGroup, kfull / kBlock - b0));
        row_group<F, S, false>(x + kBlock * b0, n, mode, data + r * K + kBlock * b0,
                               scale + r * KB + b0, false, s);
      }
      pad_block(x + kfull, last, pad);
      row_group<F, S, false>(pad, 1, mode, out, scale + r * KB + KB - 1, false, s);
      std::memcpy(data + r * K + kfull, out, last);
    }
  });
}

// ---- strips: blocks down the columns, 32x32 tiles, dual-axis ------------------------------------
// Which layout one pass writes besides blocks down the columns.
enum class BlockKind { None, Row, Tile };

constexpr int kChunkCols = 2048;
constexpr int kChunkBlocks = kChunkCols / kBlock;

struct StripScratch {
  alignas(64) uint16_t stage[kBlock * kChunkCols];  // fp32/fp16: the chunk's keys
  alignas(64) uint16_t col_key[kChunkCols];
  alignas(64) int16_t col_k[kChunkCols];
  alignas(64) uint8_t col_byte[kChunkCols];
  alignas(64) int16_t row_k[kBlock][kChunkBlocks];
  alignas(64) uint8_t row_byte[kBlock][kChunkBlocks];
  alignas(64) int16_t tile_k[kChunkBlocks];
  alignas(64) uint8_t tile_byte[kChunkBlocks];
  // The runs left to the exact path: row * kChunkBlocks + block.
  uint16_t pending[kBlock * kChunkBlocks];
};

// One chunk of one strip: rows [0, nrows) (row stride ld) of nbw whole blocks of columns, of
// which the first `wvalid` columns are real (column scales written for those only). Row scales
// at blk_scale + r * ld_scale, tile and column scales at blk_scale / col_scale; data planes with
// row stride ld_out. pf: the distance to the next row, prefetched in pass 1 (0: none); next: the
// chunk this thread takes next, prefetched into L2 in pass 2 (null: none).
template <ElemFormat F, BlockKind BK, bool COL, Src S>
void strip_chunk(const In<S>* src, int64_t ld, int nrows, int nbw, int wvalid, ScaleMode mode,
                 uint8_t* blk_data, uint8_t* blk_scale, int64_t ld_scale, uint8_t* col_data,
                 uint8_t* col_scale, int64_t ld_out, bool nt, int64_t pf, const In<S>* next,
                 StripScratch& s) {
  constexpr bool kRow = BK == BlockKind::Row;
  constexpr bool kColKeys = COL || BK == BlockKind::Tile;
  if constexpr (kColKeys) std::memset(s.col_key, 0, sizeof(uint16_t) * kBlock * nbw);

  // Pass 1.
  for (int r = 0; r < nrows; ++r) {
    for (int b0 = 0; b0 < nbw; b0 += W) {
      auto leaf = [&](int i) __attribute__((always_inline)) {
        const int blk = b0 + i;
        if (blk >= nbw) return splat(0);
        const In<S>* p = src + r * ld + kBlock * blk;
        if (pf) {
          for (int q = 0; q < kBlock; q += 64 / static_cast<int>(sizeof(In<S>))) {
            prefetch(p + q + pf);
          }
        }
        V m = splat(0);
#pragma GCC unroll 4
        for (int h = 0; h < R; ++h) {
          const V x = keys<S>(p + W * h);
          if constexpr (kStaged<S>) store(s.stage + r * kChunkCols + kBlock * blk + W * h, x);
          const V a = x & splat(0x7FFF);
          m = vmax(m, a);
          if constexpr (kColKeys) {
            uint16_t* ck = s.col_key + kBlock * blk + W * h;
            store(ck, vmax(load<V>(ck), a));
          }
        }
        return m;
      };
      if constexpr (kRow) {
        const V bytes = scale_bytes<F>(block_amaxes</*PAIRS=*/false>(leaf), mode);
        store_scale_bytes(blk_scale + r * ld_scale + b0, bytes, std::min(W, nbw - b0));
        store(&s.row_byte[r][b0], narrow(bytes));
        store(&s.row_k[r][b0], code_consts<F>(bytes));
      } else {
        for (int i = 0; i < std::min(W, nbw - b0); ++i) leaf(i);
      }
    }
  }

  // Column and tile scales.
  if constexpr (COL) {
    for (int j = 0; j < kBlock * nbw; j += W) {
      const V bytes = scale_bytes<F>(load<V>(s.col_key + j), mode);
      store(s.col_k + j, code_consts<F>(bytes));
      store(s.col_byte + j, narrow(bytes));
    }
    std::memcpy(col_scale, s.col_byte, wvalid);
  }
  if constexpr (BK == BlockKind::Tile) {
    for (int b = 0; b < nbw; ++b) {
      const uint16_t* ck = s.col_key + kBlock * b;
      V m = load<V>(ck);
      for (int h = 1; h < R; ++h) m = vmax(m, load<V>(ck + W * h));
      uint32_t key = 0;
      for (int l = 0; l < W; ++l) key = std::max<uint32_t>(key, static_cast<uint16_t>(m[l]));
      const uint8_t byte = mx::scale_byte_from_amax_key<F>(key << 16, mode);
      s.tile_byte[b] = byte;
      s.tile_k[b] = code_const<F>(byte);
    }
    std::memcpy(blk_scale, s.tile_byte, nbw);
  }

  // Pass 2: row by row, both planes from one load.
  const uint16_t* xs;
  int64_t ldx;
  if constexpr (kStaged<S>) {
    xs = s.stage;
    ldx = kChunkCols;
  } else {
    xs = src;
    ldx = ld;
  }
  // The runs that need the exact path are listed and encoded after the loop (see row_group).
  int npending = 0;
  // NR runs of row r from column block b: one test for all. Two on AVX2 and AVX-512 (at 4096 x
  // 4096 on a Xeon with AVX-512, one process: AVX2's dim 0 0.95-0.97x the time of one run per
  // test, the other strips 0.97-1.0x); one on the base build (its 16 registers hold one run's
  // work: two took 1.1-1.2x the time).
  auto runs = [&](int r, int b, auto nr) __attribute__((always_inline)) {
    constexpr int NR = decltype(nr)::value;
    if (next) {
      // The next chunk streams into L2 while this one is encoded (without it, dual-axis on a
      // Zen 3 EPYC: 1.5x a copy instead of 1.1-1.2x).
      for (int q = 0; q < kBlock * NR; q += 64 / static_cast<int>(sizeof(In<S>))) {
        prefetch_l2(next + r * ld + kBlock * b + q);
      }
    }
    V kb[NR];
    for (int n = 0; n < NR; ++n) {
      kb[n] = splat(0);
      if constexpr (kRow) kb[n] = splat(s.row_k[r][b + n]);
      if constexpr (BK == BlockKind::Tile) kb[n] = splat(s.tile_k[b + n]);
    }
    constexpr bool kBlk = BK != BlockKind::None;
    uint8_t* bo = kBlk ? blk_data + r * ld_out + kBlock * b : nullptr;
    uint8_t* co = COL ? col_data + r * ld_out + kBlock * b : nullptr;
    encode_runs<F, kBlk, COL, NR>(xs + r * ldx + kBlock * b, kb, s.col_k + kBlock * b, bo, co, nt,
                                  [&](int n) __attribute__((always_inline)) {
                                    s.pending[npending++] =
                                        static_cast<uint16_t>(r * kChunkBlocks + b + n);
                                  });
  };
  for (int r = 0; r < nrows; ++r) {
    int b = 0;
    if constexpr (W != 8) {
      for (; b + 2 <= nbw; b += 2) runs(r, b, std::integral_constant<int, 2>{});
    }
    for (; b < nbw; ++b) runs(r, b, std::integral_constant<int, 1>{});
  }
  for (int i = 0; i < npending; ++i) {
    const int r = s.pending[i] / kChunkBlocks, b = s.pending[i] % kChunkBlocks;
    const uint8_t byte = kRow ? s.row_byte[r][b] : BK == BlockKind::Tile ? s.tile_byte[b] : 0;
    const int64_t j = r * ld_out + kBlock * b;
    exact_run<F, S>(src + r * ld + kBlock * b, byte, s.col_byte + kBlock * b,
                    BK != BlockKind::None ? blk_data + j : nullptr, COL ? col_data + j : nullptr);
  }
}

// Strips of 32 rows over `nmat` matrices (N, K) stacked densely (every plane too).
template <ElemFormat F, BlockKind BK, bool COL, Src S>
void quantize_strips(const In<S>* src, int64_t nmat, int64_t N, int64_t K, ScaleMode mode,
                     uint8_t* blk_data, uint8_t* blk_scale, uint8_t* col_data, uint8_t* col_scale) {
  const int64_t KB = mx::ceil_div(K, kBlock), NB = mx::ceil_div(N, kBlock);
  const int64_t kfull = K / kBlock * kBlock;
  const int tail = static_cast<int>(K - kfull);
  auto aligned = [](const uint8_t* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; };
  const bool nt =
      K % 64 == 0 && aligned(blk_data) && aligned(col_data) && nmat * N * K >= kNtMinElems;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kBlock * K));
  parallel_for(0, nmat * NB, grain, [&](int64_t i0, int64_t i1) {
    // Default-initialized (make_unique would zero its 140 KiB on every call; every byte read is
    // written first).
    std::unique_ptr<StripScratch> s(new StripScratch);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / NB, strip = i % NB, r0 = strip * kBlock;
      const int nrows = static_cast<int>(std::min<int64_t>(kBlock, N - r0));
      const int64_t off = m * N * K + r0 * K;
      uint8_t* bs = nullptr;
      int64_t ld_scale = 0;
      if constexpr (BK == BlockKind::Row) {
        bs = blk_scale + m * N * KB + r0 * KB;
        ld_scale = KB;
      }
      if constexpr (BK == BlockKind::Tile) bs = blk_scale + m * NB * KB + strip * KB;
      uint8_t* bd = BK != BlockKind::None ? blk_data + off : nullptr;
      uint8_t* cd = COL ? col_data + off : nullptr;
      uint8_t* cs = COL ? col_scale + m * NB * K + strip * K : nullptr;
      for (int64_t c0 = 0; c0 < kfull; c0 += kChunkCols) {
        const int w = static_cast<int>(std::min<int64_t>(kChunkCols, kfull - c0));
        // The chunk this thread takes next (the next strip starts right after this one).
        const In<S>* next =
            c0 + w < kfull ? src + off + c0 + w : (i + 1 < i1 ? src + off + nrows * K : nullptr);
        strip_chunk<F, BK, COL, S>(src + off + c0, K, nrows, w / kBlock, w, mode,
                                   bd ? bd + c0 : nullptr, bs ? bs + c0 / kBlock : nullptr,
                                   ld_scale, cd ? cd + c0 : nullptr, cs ? cs + c0 : nullptr, K, nt,
                                   K, next, *s);
      }
      if (tail == 0) continue;
      // The last partial block: a padded copy (32 x 32), its outputs copied out.
      alignas(64) In<S> pad[kBlock * kBlock];
      alignas(64) uint8_t bo[kBlock * kBlock], co[kBlock * kBlock];
      for (int r = 0; r < nrows; ++r) pad_block(src + off + r * K + kfull, tail, pad + kBlock * r);
      strip_chunk<F, BK, COL, S>(pad, kBlock, nrows, 1, tail, mode, bo,
                                 bs ? bs + kfull / kBlock : nullptr, ld_scale, co,
                                 cs ? cs + kfull : nullptr, kBlock, false, 0, nullptr, *s);
      for (int r = 0; r < nrows; ++r) {
        if (bd) std::memcpy(bd + r * K + kfull, bo + kBlock * r, tail);
        if (cd) std::memcpy(cd + r * K + kfull, co + kBlock * r, tail);
      }
    }
    if (nt) store_fence();
  });
}

template <ElemFormat F, Src S>
void quantize(const void* src, int64_t nmat, int64_t N, int64_t K, ScaleMode mode,
              const QuantOutputs& o) {
  const In<S>* x = static_cast<const In<S>*>(src);
  if (o.row_data && !o.col_data) {
    quantize_rows<F, S>(x, nmat * N, K, mode, o.row_data, o.row_scale);
  } else if (o.row_data) {
    quantize_strips<F, BlockKind::Row, true, S>(x, nmat, N, K, mode, o.row_data, o.row_scale,
                                                o.col_data, o.col_scale);
  } else if (o.tile_data && o.col_data) {
    quantize_strips<F, BlockKind::Tile, true, S>(x, nmat, N, K, mode, o.tile_data, o.tile_scale,
                                                 o.col_data, o.col_scale);
  } else if (o.tile_data) {
    quantize_strips<F, BlockKind::Tile, false, S>(x, nmat, N, K, mode, o.tile_data, o.tile_scale,
                                                  nullptr, nullptr);
  } else if (o.col_data) {
    quantize_strips<F, BlockKind::None, true, S>(x, nmat, N, K, mode, nullptr, nullptr, o.col_data,
                                                 o.col_scale);
  }
}

// The AVX-512 build takes bf16 sources only: the dispatcher gives fp32 and fp16 sources to the
// AVX2 build (mx_cpu_dispatch.cpp says why).
constexpr bool kWideSources = W != 32;

template <ElemFormat F>
void quantize_fmt(const void* src, Src kind, int64_t nmat, int64_t N, int64_t K, ScaleMode mode,
                  const QuantOutputs& o) {
  if constexpr (!kWideSources) {
    if (kind != Src::BF16) __builtin_trap();  // the dispatcher never sends one here
    quantize<F, Src::BF16>(src, nmat, N, K, mode, o);
  } else {
    switch (kind) {
      case Src::BF16:
        return quantize<F, Src::BF16>(src, nmat, N, K, mode, o);
      case Src::F16:
        return quantize<F, Src::F16>(src, nmat, N, K, mode, o);
      case Src::F32:
        return quantize<F, Src::F32>(src, nmat, N, K, mode, o);
      case Src::F32AsBF16:
        return quantize<F, Src::F32AsBF16>(src, nmat, N, K, mode, o);
      case Src::F32AsF16:
        return quantize<F, Src::F32AsF16>(src, nmat, N, K, mode, o);
    }
  }
}

}  // namespace

// Every layout combination but blocks along rows together with tiles (the dispatcher refuses
// that one; no op asks for it).
void quantize_matrices(const void* src, Src src_kind, int64_t nmat, int64_t N, int64_t K,
                       ElemFormat fmt, ScaleMode mode, const QuantOutputs& out) {
  if (nmat == 0 || N == 0 || K == 0) return;
  if (fmt == ElemFormat::E4M3) {
    quantize_fmt<ElemFormat::E4M3>(src, src_kind, nmat, N, K, mode, out);
  } else {
    quantize_fmt<ElemFormat::E5M2>(src, src_kind, nmat, N, K, mode, out);
  }
}

}  // namespace zrw::cpu::ZRW_CPU_ISA
