// digest::words per instruction set (common/digest.h): the same loop, vectorized by the
// compiler where the target has 64-bit lane multiplies (AVX-512DQ); AVX2 has none, and its
// emulation is no faster than the scalar loop, so AVX2 machines run the portable build.
#include "digest.h"

#include <cstring>

#include "../mx/mx_cpu_kernels.h"

namespace zrw {
namespace digest {
namespace {

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

uint64_t words(const unsigned char* base, int64_t begin, int64_t end) {
  static const WordsFn fn = chosen();
  return fn(base, begin, end);
}

}  // namespace digest
}  // namespace zrw
