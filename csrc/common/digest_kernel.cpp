// The digest's word loop (common/digest_words.h), compiled once per instruction set with the MX
// kernels (CMakeLists.txt) and chosen with them (mx_cpu_dispatch.cpp): SSE2 (x86-64's base),
// AVX2 and AVX-512 run the same lanes on 2, 4 and 8 words per register; other CPUs run
// mix_word. Plain C++ (no torch header).
#include <cstring>

#include "../mx/mx_cpu_isa.h"
#include "digest_words.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace zrw::cpu::ZRW_CPU_ISA {
namespace {

#if defined(__AVX512F__)
using Vec = __m512i;
constexpr int64_t kWords = 8;
inline Vec loadu(const void* p) { return _mm512_loadu_si512(p); }
inline void storeu(void* p, Vec v) { _mm512_storeu_si512(p, v); }
inline Vec add32(Vec a, Vec b) { return _mm512_add_epi32(a, b); }
inline Vec add64(Vec a, Vec b) { return _mm512_add_epi64(a, b); }
inline Vec vxor(Vec a, Vec b) { return _mm512_xor_si512(a, b); }
inline Vec splat(uint64_t v) { return _mm512_set1_epi64(static_cast<int64_t>(v)); }
// Each 64-bit lane's low half times its high half, a 64-bit product.
inline Vec halves_product(Vec v) { return _mm512_mul_epu32(v, _mm512_srli_epi64(v, 32)); }
#elif defined(__AVX2__)
using Vec = __m256i;
constexpr int64_t kWords = 4;
inline Vec loadu(const void* p) { return _mm256_loadu_si256(static_cast<const Vec*>(p)); }
inline void storeu(void* p, Vec v) { _mm256_storeu_si256(static_cast<Vec*>(p), v); }
inline Vec add32(Vec a, Vec b) { return _mm256_add_epi32(a, b); }
inline Vec add64(Vec a, Vec b) { return _mm256_add_epi64(a, b); }
inline Vec vxor(Vec a, Vec b) { return _mm256_xor_si256(a, b); }
inline Vec splat(uint64_t v) { return _mm256_set1_epi64x(static_cast<int64_t>(v)); }
inline Vec halves_product(Vec v) { return _mm256_mul_epu32(v, _mm256_srli_epi64(v, 32)); }
#elif defined(__SSE2__)
using Vec = __m128i;
constexpr int64_t kWords = 2;
inline Vec loadu(const void* p) { return _mm_loadu_si128(static_cast<const Vec*>(p)); }
inline void storeu(void* p, Vec v) { _mm_storeu_si128(static_cast<Vec*>(p), v); }
inline Vec add32(Vec a, Vec b) { return _mm_add_epi32(a, b); }
inline Vec add64(Vec a, Vec b) { return _mm_add_epi64(a, b); }
inline Vec vxor(Vec a, Vec b) { return _mm_xor_si128(a, b); }
inline Vec splat(uint64_t v) { return _mm_set1_epi64x(static_cast<int64_t>(v)); }
inline Vec halves_product(Vec v) { return _mm_mul_epu32(v, _mm_srli_epi64(v, 32)); }
#endif

#if defined(__SSE2__)
// The lanes of v, added up.
inline uint64_t lane_sum(Vec v) {
  uint64_t lanes[kWords];
  storeu(lanes, v);
  uint64_t s = 0;
  for (int64_t l = 0; l < kWords; ++l) s += lanes[l];
  return s;
}

// Words [begin, end) of base, two registers per iteration (their multiplies overlap); returns
// the first word not taken.
int64_t vector_words(const unsigned char* base, int64_t begin, int64_t end, digest::Sums& s) {
  uint64_t ks[kWords], js[kWords];
  for (int64_t l = 0; l < kWords; ++l) {
    ks[l] = static_cast<uint64_t>(begin + l) * digest::kAddKey;
    js[l] = static_cast<uint64_t>(begin + l) * digest::kXorKey;
  }
  Vec k = loadu(ks), j = loadu(js);
  const Vec step_k = splat(kWords * digest::kAddKey), step_j = splat(kWords * digest::kXorKey);
  Vec sum0 = splat(0), sum1 = splat(0), xsum0 = splat(0), xsum1 = splat(0);
  int64_t i = begin;
  for (; i + 2 * kWords <= end; i += 2 * kWords) {
    const Vec w0 = loadu(base + 8 * i), w1 = loadu(base + 8 * (i + kWords));
    const Vec k1 = add64(k, step_k), j1 = add64(j, step_j);
    sum0 = add64(sum0, halves_product(add32(w0, k)));
    sum1 = add64(sum1, halves_product(add32(w1, k1)));
    xsum0 = add64(xsum0, halves_product(vxor(w0, j)));
    xsum1 = add64(xsum1, halves_product(vxor(w1, j1)));
    k = add64(k1, step_k);
    j = add64(j1, step_j);
  }
  s.sum += lane_sum(add64(sum0, sum1));
  s.xsum += lane_sum(add64(xsum0, xsum1));
  return i;
}
#endif

}  // namespace

void digest_words(const unsigned char* base, int64_t begin, int64_t end, uint64_t sums[2]) {
  digest::Sums s;
  int64_t i = begin;
#if defined(__SSE2__)
  i = vector_words(base, begin, end, s);
#endif
  for (; i < end; ++i) {
    uint64_t w;
    std::memcpy(&w, base + 8 * i, 8);
    digest::mix_word(w, static_cast<uint64_t>(i), s);
  }
  sums[0] = s.sum;
  sums[1] = s.xsum;
}

}  // namespace zrw::cpu::ZRW_CPU_ISA
