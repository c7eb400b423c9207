// Picks the CPU quantization/dequantization kernels once per process: the widest instruction
// set that both the build (ZRW_HAVE_X86_ISAS) and the CPU support, unless
// ZRW_CPU_ISA=base|avx2|avx512 asks for a specific one (tests run every variant to check they
// give the same bytes).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include "mx_cpu_kernels.h"

namespace zrw::cpu {
namespace {

struct Choice {
  const char* name;
  QuantizeMatricesFn quantize;
  DequantizeFn dequantize_row_blocks;
  DequantizeFn dequantize_per_element;
  DequantizeBf16Fn dequantize_row_blocks_bf16;
  DequantizeBf16Fn dequantize_per_element_bf16;
  void (*digest_words)(const unsigned char*, int64_t, int64_t, uint64_t*);
};

bool cpu_has(const char* isa) {
#if defined(ZRW_HAVE_X86_ISAS)
  if (std::strcmp(isa, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }
  if (std::strcmp(isa, "avx2") == 0) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
#endif
  return std::strcmp(isa, "base") == 0;
}

Choice pick() {
  const Choice choices[] = {
#if defined(ZRW_HAVE_X86_ISAS)
      {"avx512", &avx512::quantize_matrices, &avx512::dequantize_row_blocks,
       &avx512::dequantize_per_element, &avx512::dequantize_row_blocks_bf16,
       &avx512::dequantize_per_element_bf16, &avx512::digest_words},
      {"avx2", &avx2::quantize_matrices, &avx2::dequantize_row_blocks,
       &avx2::dequantize_per_element, &avx2::dequantize_row_blocks_bf16,
       &avx2::dequantize_per_element_bf16, &avx2::digest_words},
#endif
      {"base", &base::quantize_matrices, &base::dequantize_row_blocks,
       &base::dequantize_per_element, &base::dequantize_row_blocks_bf16,
       &base::dequantize_per_element_bf16, &base::digest_words},
  };
  if (const char* forced = std::getenv("ZRW_CPU_ISA"); forced && *forced) {
    for (const auto& c : choices) {
      if (std::strcmp(c.name, forced) != 0) continue;
      TORCH_CHECK(cpu_has(c.name), "ZRW_CPU_ISA=", forced,
                  " was requested but this CPU does not support it");
      return c;
    }
    TORCH_CHECK(false,
                "ZRW_CPU_ISA must be one of the kernels built into zrw "
#if defined(ZRW_HAVE_X86_ISAS)
                "(avx512, avx2, base)"
#else
                "(base)"
#endif
                ", got \"",
                forced, "\"");
  }
  for (const auto& c : choices) {
    if (cpu_has(c.name)) return c;
  }
  return choices[sizeof(choices) / sizeof(choices[0]) - 1];
}

const Choice& chosen() {
  static const Choice c = pick();
  return c;
}

Gemm pick_gemm() {
  if (const char* forced = std::getenv("ZRW_CPU_GEMM"); forced && *forced) {
    if (std::strcmp(forced, "fp32") == 0) return Gemm::FP32;
    if (std::strcmp(forced, "bf16") == 0) return Gemm::BF16;
    TORCH_CHECK(std::strcmp(forced, "auto") == 0,
                "ZRW_CPU_GEMM must be \"fp32\", \"bf16\" or \"auto\", got \"", forced, "\"");
  }
  return cpu_has_native_bf16() ? Gemm::BF16 : Gemm::FP32;
}

}  // namespace

bool cpu_has_native_bf16() {
#if defined(__x86_64__) || defined(_M_X64)
  return __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
#elif defined(__aarch64__) && defined(__linux__) && defined(HWCAP2_BF16)
  return (getauxval(AT_HWCAP2) & HWCAP2_BF16) != 0;
#else
  return false;
#endif
}

Gemm gemm_path() {
  static const Gemm g = pick_gemm();
  return g;
}

const char* gemm_path_name() { return gemm_path() == Gemm::BF16 ? "bf16" : "fp32"; }

const char* active_isa() { return chosen().name; }

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f) {
  at::parallel_for(begin, end, grain, f);
}

void quantize_matrices(const void* src, at::ScalarType src_dtype, at::ScalarType round_to,
                       int64_t nmat, int64_t N, int64_t K, mx::ElemFormat fmt, mx::ScaleMode mode,
                       const QuantOutputs& out) {
  TORCH_CHECK(round_to == at::ScalarType::Undefined ||
                  (src_dtype == at::kFloat && (round_to == at::kBFloat16 || round_to == at::kHalf)),
              "zrw internal: quantize_matrices rounds fp32 sources to bf16 or fp16 only, got ",
              src_dtype, " -> ", round_to);
  TORCH_CHECK(src_dtype == at::kBFloat16 || src_dtype == at::kHalf || src_dtype == at::kFloat,
              "zrw internal: quantize_matrices takes bf16, fp16 or fp32 sources, got ", src_dtype);
  TORCH_CHECK(!(out.row_data && out.tile_data),
              "zrw internal: quantize_matrices writes blocks along rows or 32x32 tiles in one "
              "call, not both");
  Src kind = Src::F32;
  if (src_dtype == at::kBFloat16) {
    kind = Src::BF16;
  } else if (src_dtype == at::kHalf) {
    kind = Src::F16;
  } else if (round_to == at::kBFloat16) {
    kind = Src::F32AsBF16;
  } else if (round_to == at::kHalf) {
    kind = Src::F32AsF16;
  }
  QuantizeMatricesFn quantize = chosen().quantize;
#if defined(ZRW_HAVE_X86_ISAS)
  // fp32 and fp16 sources take the AVX2 kernels on an AVX-512 CPU (as the former per-ISA code
  // did): in cache they are as fast (an FP32 master's dual-axis 3.3x an fp32 copy against 3.6x),
  // and from DRAM the 512-bit build's fp32 row-block trees were 1.2-1.7x slower (4096x4096, one
  // thread, measured when the CPU kernels were unified). The AVX-512 build compiles bf16 only.
  if (kind != Src::BF16 && quantize == &avx512::quantize_matrices) {
    quantize = &avx2::quantize_matrices;
  }
#endif
  quantize(src, kind, nmat, N, K, fmt, mode, out);
}

void dequantize_row_blocks(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                           int64_t n, float* out) {
  chosen().dequantize_row_blocks(fmt, data, scales, n, out);
}

void dequantize_per_element(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                            int64_t n, float* out) {
  chosen().dequantize_per_element(fmt, data, scales, n, out);
}

void dequantize_row_blocks_bf16(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                                int64_t n, uint16_t* out) {
  chosen().dequantize_row_blocks_bf16(fmt, data, scales, n, out);
}

void dequantize_per_element_bf16(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                                 int64_t n, uint16_t* out) {
  chosen().dequantize_per_element_bf16(fmt, data, scales, n, out);
}

void digest_words(const unsigned char* base, int64_t begin, int64_t end, uint64_t sums[2]) {
  chosen().digest_words(base, begin, end, sums);
}

}  // namespace zrw::cpu
