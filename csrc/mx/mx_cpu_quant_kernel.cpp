// The quantization strip kernel, compiled once per instruction set (see CMakeLists.txt:
// ZRW_CPU_ISA is base, avx2 or avx512) and picked at load time by mx_cpu_dispatch.cpp; the
// per-ISA builds are what let the compiler vectorize the element loops for AVX2/AVX-512 while
// the wheel still runs on any x86-64.
//
// Quantization works on strips of 32 rows of a matrix (N, K) (a stack (E, N, K) is E matrices),
// column chunk by column chunk: a chunk is converted to fp32 once into a small buffer that stays
// in L1/L2, and every requested layout (blocks along K, blocks along N, 32x32 tiles) is written
// from that one read. The element loops are plain C++ over fp32 bit patterns (mx_format.h).
//
// AVX2 (and AVX-512) builds take mx_cpu_quant_avx2.h instead: the same strips, encoded in
// 16-bit lanes from bf16 bits (fp32/fp16 staged as such first), several times faster. The base
// build takes mx_cpu_quant_portable.h: the same 16-bit encode in GCC vector extensions (SSE2 on
// x86-64, NEON on Arm). The fp32-lane strip kernel here remains for what neither takes (fp64
// inputs, blocks along rows together with tiles).
//
// An fp32 source may come with a `round_to` (bf16 or fp16): an FP32 master quantized as its
// parameter (mx_quantize_*_from_master). Each element is rounded to that dtype as it is loaded
// into the chunk buffer, so the master is read once and the rounded tensor never exists.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "../common/mx_format.h"
#include "mx_cpu_kernels.h"
#include "mx_cpu_quant_portable.h"

#ifndef ZRW_CPU_ISA
#error "compile mx_cpu_quant_kernel.cpp with -DZRW_CPU_ISA=<base|avx2|avx512>"
#endif

#if defined(__AVX2__)
#include "mx_cpu_quant_avx2.h"
#endif
#if defined(__AVX512BW__)
#include "mx_cpu_quant_avx512.h"
#endif

namespace zrw::cpu::ZRW_CPU_ISA {
namespace {

using mx::ElemFormat;
using mx::ScaleMode;
using mx::kBlock;

constexpr int64_t kChunkCols = 512;  // 32 x 512 fp32 = 64 KiB: the strip buffer fits in L2

// ---------------------------------------------------------------------------------------------
// Hot loops.

// Encode in groups of 64 through a 32-bit lane buffer, then narrow: GCC vectorizes both loops
// (it does not vectorize the encode chain when it ends in a uint8 store).
constexpr int64_t kGroup = 64;

// out[j] = encode(x[j] * inv[j]): inv carries each element's block scale, so one call covers a
// whole row chunk whatever the layout.
template <ElemFormat F>
void encode_span(const float* __restrict x, const float* __restrict inv, uint8_t* __restrict out,
                 int64_t n) {
  uint32_t lanes[kGroup];
  for (int64_t j0 = 0; j0 < n; j0 += kGroup) {
    const int64_t m = std::min(kGroup, n - j0);
    for (int64_t j = 0; j < m; ++j) lanes[j] = mx::encode_elem_lane<F>(x[j0 + j] * inv[j0 + j]);
    for (int64_t j = 0; j < m; ++j) out[j0 + j] = static_cast<uint8_t>(lanes[j]);
  }
}

// keys[j] = max(keys[j], |x[j]|) on abs keys (NaN-propagating, see mx::abs_key).
void accumulate_col_keys(const float* x, uint32_t* keys, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t k = mx::abs_key(x[j]);
    keys[j] = k > keys[j] ? k : keys[j];
  }
}

// keys[b] = max |x| over x[32b .. 32b+31]; n is a multiple of 32 (the buffer is zero padded).
void block_keys_along_row(const float* x, uint32_t* keys, int64_t nblocks) {
  for (int64_t b = 0; b < nblocks; ++b) {
    uint32_t m = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const uint32_t k = mx::abs_key(x[b * kBlock + j]);
      m = k > m ? k : m;
    }
    keys[b] = m;
  }
}

void load_bf16_span(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = mx::bits_f32(static_cast<uint32_t>(src[j]) << 16);
}

// An fp32 master's elements rounded to the parameter dtype on the way in, as torch converts them
// (mx_format.h): the values quantizing `master.to(round_to)` would see.
void load_master_span(const float* src, float* dst, int64_t n, at::ScalarType round_to) {
  if (round_to == at::kBFloat16) {
    for (int64_t j = 0; j < n; ++j) {
      dst[j] = mx::bits_f32(static_cast<uint32_t>(mx::f32_to_bf16_bits_rne(src[j])) << 16);
    }
  } else if (round_to == at::kHalf) {
    for (int64_t j = 0; j < n; ++j) dst[j] = mx::round_f32_to_f16_value(src[j]);
  } else {
    std::memcpy(dst, src, n * sizeof(float));
  }
}

template <typename T>
inline void load_span(const T* src, float* dst, int64_t n, at::ScalarType round_to) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    load_bf16_span(reinterpret_cast<const uint16_t*>(src), dst, n);
  } else if constexpr (std::is_same_v<T, float>) {
    load_master_span(src, dst, n, round_to);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
  }
}

// ---------------------------------------------------------------------------------------------
// The strip kernel.

struct StripScratch {
  std::vector<float> buf = std::vector<float>(kBlock * kChunkCols);
  std::vector<uint32_t> keys = std::vector<uint32_t>(kChunkCols);
  std::vector<float> inv = std::vector<float>(kChunkCols);
  std::vector<uint8_t> bytes = std::vector<uint8_t>(kChunkCols);
};

// Quantizes rows [r0, r0 + nrows) (nrows <= 32, r0 a multiple of 32) of one matrix; fp32
// elements rounded to `round_to` first unless it is Undefined.
template <ElemFormat F, typename T>
void quantize_strip(const T* src, int64_t N, int64_t K, int64_t r0, ScaleMode mode,
                    at::ScalarType round_to, const QuantOutputs& out, StripScratch& s) {
  const int64_t nrows = std::min<int64_t>(kBlock, N - r0);
  const int64_t KB = mx::ceil_div(K, kBlock);
  const int64_t strip = r0 / kBlock;
  float* buf = s.buf.data();
  for (int64_t c0 = 0; c0 < K; c0 += kChunkCols) {
    const int64_t C = std::min(kChunkCols, K - c0);
    const int64_t Cpad = mx::ceil_div(C, kBlock) * kBlock;
    for (int64_t r = 0; r < nrows; ++r) {
      float* row = buf + r * kChunkCols;
      load_span(src + (r0 + r) * K + c0, row, C, round_to);
      // Missing elements of a partial block count as 0 for amax.
      for (int64_t j = C; j < Cpad; ++j) row[j] = 0.0f;
    }

    if (out.row_data) {
      const int64_t nb = Cpad / kBlock;
      for (int64_t r = 0; r < nrows; ++r) {
        const float* row = buf + r * kChunkCols;
        uint8_t* drow = out.row_data + (r0 + r) * K + c0;
        uint8_t* srow = out.row_scale + (r0 + r) * KB + c0 / kBlock;
        block_keys_along_row(row, s.keys.data(), nb);
        bool any_nan = false;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t sb = mx::scale_byte_from_amax_key<F>(s.keys[b], mode);
          srow[b] = sb;
          s.bytes[b] = sb;
          any_nan |= sb == mx::kScaleNaN;
          const float inv = mx::inv_scale_from_byte(sb);
          for (int64_t j = 0; j < kBlock; ++j) s.inv[b * kBlock + j] = inv;
        }
        // One encode call per row chunk: per-block calls of 32 elements cost more in loop
        // overhead than in encoding.
        encode_span<F>(row, s.inv.data(), drow, C);
        if (!any_nan) continue;
        for (int64_t b = 0; b < nb; ++b) {
          if (s.bytes[b] != mx::kScaleNaN) continue;
          std::memset(drow + b * kBlock, mx::kElemNaN, std::min(kBlock, C - b * kBlock));
        }
      }
    }

    if (out.col_data || out.tile_data) {
      uint32_t* keys = s.keys.data();
      std::fill(keys, keys + Cpad, 0u);
      for (int64_t r = 0; r < nrows; ++r) accumulate_col_keys(buf + r * kChunkCols, keys, Cpad);
      bool any_nan = false;
      auto emit = [&](uint8_t* data, int64_t nan_group) {
        for (int64_t r = 0; r < nrows; ++r) {
          encode_span<F>(buf + r * kChunkCols, s.inv.data(), data + (r0 + r) * K + c0, C);
        }
        if (!any_nan) return;
        for (int64_t j = 0; j < C; ++j) {
          if (s.bytes[j / nan_group] != mx::kScaleNaN) continue;
          for (int64_t r = 0; r < nrows; ++r) data[(r0 + r) * K + c0 + j] = mx::kElemNaN;
        }
      };
      if (out.col_data) {
        uint8_t* srow = out.col_scale + strip * K + c0;
        for (int64_t j = 0; j < C; ++j) {
          const uint8_t sb = mx::scale_byte_from_amax_key<F>(keys[j], mode);
          srow[j] = sb;
          s.bytes[j] = sb;
          s.inv[j] = mx::inv_scale_from_byte(sb);
          any_nan |= sb == mx::kScaleNaN;
        }
        emit(out.col_data, 1);
      }
      if (out.tile_data) {
        any_nan = false;
        uint8_t* srow = out.tile_scale + strip * KB + c0 / kBlock;
        for (int64_t b = 0; b < Cpad / kBlock; ++b) {
          uint32_t m = 0;
          for (int64_t j = 0; j < kBlock; ++j) m = std::max(m, keys[b * kBlock + j]);
          const uint8_t sb = mx::scale_byte_from_amax_key<F>(m, mode);
          srow[b] = sb;
          s.bytes[b] = sb;
          any_nan |= sb == mx::kScaleNaN;
          const float inv = mx::inv_scale_from_byte(sb);
          for (int64_t j = 0; j < kBlock; ++j) s.inv[b * kBlock + j] = inv;
        }
        emit(out.tile_data, kBlock);
      }
    }
  }
}

#if defined(__AVX2__)
// The AVX2 path (mx_cpu_quant_avx2.h) for blocks along rows or 32x32 tiles (or neither), with
// or without blocks down the columns, over `nmat` dense (N, K) matrices. T: uint16_t (bf16
// bits), float or at::Half; R: how fp32 elements are rounded first (an FP32 master quantized as
// its bf16/fp16 parameter).
template <avx2_path::Round R, typename T>
void quantize_avx2(const T* src, int64_t nmat, int64_t N, int64_t K, ElemFormat fmt,
                   ScaleMode mode, const QuantOutputs& out) {
  using avx2_path::BlockKind;
  auto with_fmt = [&](auto f_tag) {
    constexpr ElemFormat F = decltype(f_tag)::value;
    if (out.row_data && !out.col_data) {
      avx2_path::quantize_rows<F, R>(src, nmat * N, K, mode, out.row_data, out.row_scale);
    } else if (out.row_data) {
      avx2_path::quantize_strips<F, BlockKind::Row, true, R>(
          src, nmat, N, K, mode, out.row_data, out.row_scale, out.col_data, out.col_scale);
    } else if (out.tile_data && out.col_data) {
      avx2_path::quantize_strips<F, BlockKind::Tile, true, R>(
          src, nmat, N, K, mode, out.tile_data, out.tile_scale, out.col_data, out.col_scale);
    } else if (out.tile_data) {
      avx2_path::quantize_strips<F, BlockKind::Tile, false, R>(
          src, nmat, N, K, mode, out.tile_data, out.tile_scale, nullptr, nullptr);
    } else if (out.col_data) {
      avx2_path::quantize_strips<F, BlockKind::None, true, R>(
          src, nmat, N, K, mode, nullptr, nullptr, out.col_data, out.col_scale);
    }
  };
  if (fmt == ElemFormat::E4M3) {
    with_fmt(std::integral_constant<ElemFormat, ElemFormat::E4M3>{});
  } else {
    with_fmt(std::integral_constant<ElemFormat, ElemFormat::E5M2>{});
  }
}
#endif

}  // namespace

void quantize_matrices(const void* src, at::ScalarType src_dtype, at::ScalarType round_to,
                       int64_t nmat, int64_t N, int64_t K, ElemFormat fmt, ScaleMode mode,
                       const QuantOutputs& out) {
  const int64_t strips = mx::ceil_div(N, kBlock);
  const int64_t total = nmat * strips;
  if (total == 0 || K == 0) return;
  const int64_t KB = mx::ceil_div(K, kBlock), NB = strips;
  // Matrix m's outputs: every layout is a dense stack, so its offset is m times a matrix's size.
  auto outs_of = [&](int64_t m) {
    auto at_ = [](uint8_t* p, int64_t off) { return p ? p + off : nullptr; };
    QuantOutputs o;
    o.row_data = at_(out.row_data, m * N * K);
    o.row_scale = at_(out.row_scale, m * N * KB);
    o.col_data = at_(out.col_data, m * N * K);
    o.col_scale = at_(out.col_scale, m * NB * K);
    o.tile_data = at_(out.tile_data, m * N * K);
    o.tile_scale = at_(out.tile_scale, m * NB * KB);
    return o;
  };
#if defined(__AVX512BW__)
  if (!(out.row_data && out.tile_data) &&
      (src_dtype == at::kBFloat16 || (src_dtype == at::kFloat && round_to == at::kBFloat16))) {
    // bf16 weights and FP32 masters quantized as bf16 parameters: the AVX-512 path.
    auto with_src = [&](auto f_tag, const auto* s) {
      constexpr ElemFormat F = decltype(f_tag)::value;
      using avx2_path::BlockKind;
      if (out.row_data && !out.col_data) {
        avx512_path::quantize_rows<F>(s, nmat * N, K, mode, out.row_data, out.row_scale);
      } else if (out.row_data) {
        avx512_path::quantize_strips<F, BlockKind::Row, true>(s, nmat, N, K, mode, out.row_data,
                                                              out.row_scale, out.col_data,
                                                              out.col_scale);
      } else if (out.tile_data) {
        avx512_path::quantize_strips<F, BlockKind::Tile, false>(
            s, nmat, N, K, mode, out.tile_data, out.tile_scale, nullptr, nullptr);
      } else if (out.col_data) {
        avx512_path::quantize_strips<F, BlockKind::None, true>(s, nmat, N, K, mode, nullptr,
                                                               nullptr, out.col_data,
                                                               out.col_scale);
      }
    };
    auto with_fmt = [&](const auto* s) {
      if (fmt == ElemFormat::E4M3) {
        with_src(std::integral_constant<ElemFormat, ElemFormat::E4M3>{}, s);
      } else {
        with_src(std::integral_constant<ElemFormat, ElemFormat::E5M2>{}, s);
      }
    };
    if (src_dtype == at::kBFloat16) {
      with_fmt(static_cast<const uint16_t*>(src));
    } else {
      with_fmt(static_cast<const float*>(src));
    }
    return;
  }
#endif
#if defined(__AVX2__)
  if (!(out.row_data && out.tile_data)) {  // every combination the ops request
    using avx2_path::Round;
    if (src_dtype == at::kBFloat16) {
      quantize_avx2<Round::None>(static_cast<const uint16_t*>(src), nmat, N, K, fmt, mode, out);
      return;
    }
    if (src_dtype == at::kFloat) {
      const float* f = static_cast<const float*>(src);
      if (round_to == at::kBFloat16) {
        quantize_avx2<Round::BF16>(f, nmat, N, K, fmt, mode, out);
      } else if (round_to == at::kHalf) {
        quantize_avx2<Round::F16>(f, nmat, N, K, fmt, mode, out);
      } else {
        quantize_avx2<Round::None>(f, nmat, N, K, fmt, mode, out);
      }
      return;
    }
    if (src_dtype == at::kHalf) {
      quantize_avx2<Round::None>(static_cast<const at::Half*>(src), nmat, N, K, fmt, mode, out);
      return;
    }
  }
#endif
#if !defined(__AVX2__)
  // The portable 16-bit path (mx_cpu_quant_portable.h): bf16, fp16 and fp32 inputs.
  if (portable_path::quantize_matrices(src, src_dtype, round_to, nmat, N, K, fmt, mode, out)) {
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src_dtype, "zrw_mx_quantize", [&] {
    const scalar_t* base = static_cast<const scalar_t*>(src);
    // One strip is ~32*K elements of work; small matrices run on one thread.
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kBlock * K));
    at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
      StripScratch scratch;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / strips;
        const int64_t r0 = (i % strips) * kBlock;
        const scalar_t* mat = base + m * N * K;
        if (fmt == ElemFormat::E4M3) {
          quantize_strip<ElemFormat::E4M3>(mat, N, K, r0, mode, round_to, outs_of(m), scratch);
        } else {
          quantize_strip<ElemFormat::E5M2>(mat, N, K, r0, mode, round_to, outs_of(m), scratch);
        }
      }
    });
  });
}

}  // namespace zrw::cpu::ZRW_CPU_ISA
