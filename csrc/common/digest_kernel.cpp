// The digest's word loop (common/digest_words.h), compiled once per instruction set with the MX
// kernels (CMakeLists.txt) and chosen with them (mx_cpu_dispatch.cpp): the lanes of
// mx_cpu_simd.h's registers (2, 4 or 8 words in the base, AVX2 and AVX-512 builds), then
// mix_word for the words left over. Plain C++ (no torch header).
#include <cstring>

#include "../mx/mx_cpu_isa.h"
#include "../mx/mx_cpu_simd.h"
#include "digest_words.h"

namespace zrw::cpu::ZRW_CPU_ISA {
namespace {

using simd::load;
constexpr int64_t kWords = 2 * simd::kLanes / 8;  // 8-byte words per register
typedef uint64_t Vec __attribute__((vector_size(8 * kWords)));
typedef uint32_t Vec32 __attribute__((vector_size(8 * kWords)));

// 32-bit lane sums: each word's halves plus the key's halves, each wrapping mod 2^32.
inline Vec add32(Vec a, Vec b) {
  return reinterpret_cast<Vec>(reinterpret_cast<Vec32>(a) + reinterpret_cast<Vec32>(b));
}

// Each word's low half times its high half, a 64-bit product: one (v)pmuludq on x86 (GCC's
// vector multiply would emulate a full 64-bit one).
inline Vec halves_product(Vec v) {
#if defined(__AVX512F__)
  const __m512i x = reinterpret_cast<__m512i>(v);
  return reinterpret_cast<Vec>(_mm512_mul_epu32(x, _mm512_srli_epi64(x, 32)));
#elif defined(__AVX2__)
  const __m256i x = reinterpret_cast<__m256i>(v);
  return reinterpret_cast<Vec>(_mm256_mul_epu32(x, _mm256_srli_epi64(x, 32)));
#elif defined(__SSE2__)
  const __m128i x = reinterpret_cast<__m128i>(v);
  return reinterpret_cast<Vec>(_mm_mul_epu32(x, _mm_srli_epi64(x, 32)));
#else
  return (v & 0xFFFFFFFFu) * (v >> 32);
#endif
}

inline uint64_t lane_sum(Vec v) {
  uint64_t s = 0;
  for (int64_t l = 0; l < kWords; ++l) s += v[l];
  return s;
}

}  // namespace

void digest_words(const unsigned char* base, int64_t begin, int64_t end, uint64_t sums[2]) {
  digest::Sums s;
  // Two registers per iteration (their multiplies overlap).
  Vec k, j;
  for (int64_t l = 0; l < kWords; ++l) {
    k[l] = static_cast<uint64_t>(begin + l) * digest::kAddKey;
    j[l] = static_cast<uint64_t>(begin + l) * digest::kXorKey;
  }
  const uint64_t step_k = kWords * digest::kAddKey, step_j = kWords * digest::kXorKey;
  Vec sum0{}, sum1{}, xsum0{}, xsum1{};
  int64_t i = begin;
  for (; i + 2 * kWords <= end; i += 2 * kWords) {
    const Vec w0 = load<Vec>(base + 8 * i), w1 = load<Vec>(base + 8 * (i + kWords));
    const Vec k1 = k + step_k, j1 = j + step_j;
    sum0 += halves_product(add32(w0, k));
    sum1 += halves_product(add32(w1, k1));
    xsum0 += halves_product(w0 ^ j);
    xsum1 += halves_product(w1 ^ j1);
    k = k1 + step_k;
    j = j1 + step_j;
  }
  s.sum = lane_sum(sum0 + sum1);
  s.xsum = lane_sum(xsum0 + xsum1);
  for (; i < end; ++i) {
    uint64_t w;
    std::memcpy(&w, base + 8 * i, 8);
    digest::mix_word(w, static_cast<uint64_t>(i), s);
  }
  sums[0] = s.sum;
  sums[1] = s.xsum;
}

}  // namespace zrw::cpu::ZRW_CPU_ISA
