// digest::of (common/digest.h). The word loop per instruction set: the same loop, vectorized by
// the compiler where the target has 64-bit lane multiplies (AVX-512DQ); AVX2 has none, and its
// emulation is no faster than the scalar loop, so AVX2 machines run the portable build.
#include "digest.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <functional>

#include "../mx/mx_cpu_kernels.h"

namespace zrw {
namespace digest {
namespace {

// The sum of the mixed words [begin, end) of the buffer starting at `base` (word i is the 8
// bytes at base + 8 * i).
__attribute__((always_inline)) inline uint64_t words_loop(const unsigned char* base, int64_t begin,
                                                          int64_t end) {
  uint64_t acc = 0;
  for (int64_t i = begin; i < end; ++i) {
    uint64_t w;
    std::memcpy(&w, base + 8 * i, 8);
    uint64_t h = (w ^ (static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ULL)) * 0xff51afd7ed558ccdULL;
    h ^= h >> 32;
    acc += h * 0xc4ceb9fe1a85ec53ULL;
  }
  return acc;
}

uint64_t words_portable(const unsigned char* base, int64_t begin, int64_t end) {
  return words_loop(base, begin, end);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512dq,avx512vl"))) uint64_t
words_avx512(const unsigned char* base, int64_t begin, int64_t end) {
  return words_loop(base, begin, end);
}
#endif

using WordsFn = uint64_t (*)(const unsigned char*, int64_t, int64_t);

WordsFn chosen() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (std::strcmp(cpu::active_isa(), "avx512") == 0) return &words_avx512;
#endif
  return &words_portable;
}

}  // namespace

uint64_t of(const unsigned char* base, int64_t nbytes) {
  static const WordsFn words = chosen();
  const int64_t n_words = nbytes / 8;
  uint64_t acc = at::parallel_reduce(
      int64_t{0}, n_words, int64_t{1} << 15, uint64_t{0},
      [&](int64_t b, int64_t e, uint64_t sum) { return sum + words(base, b, e); },
      std::plus<uint64_t>());
  unsigned char tail[8] = {0};
  if (nbytes > 8 * n_words) {
    std::memcpy(tail, base + 8 * n_words, static_cast<size_t>(nbytes - 8 * n_words));
  }
  acc += words_loop(tail, 0, 1) * (static_cast<uint64_t>(n_words) | 1);
  return acc ^ static_cast<uint64_t>(nbytes) * 0x9E3779B97F4A7C15ULL;
}

}  // namespace digest
}  // namespace zrw
