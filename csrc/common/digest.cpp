// digest::of (common/digest.h): the word loop of the chosen instruction set
// (common/digest_kernel.cpp, through zrw::cpu::digest_words) run by at::parallel_reduce's
// threads, then the zero-padded tail and the length.
#include "digest.h"

#include <ATen/Parallel.h>

#include <cstring>

#include "../mx/mx_cpu_kernels.h"
#include "digest_words.h"

namespace zrw {
namespace digest {

uint64_t of(const unsigned char* base, int64_t nbytes) {
  const int64_t n_words = nbytes / 8;
  Sums s = at::parallel_reduce(
      int64_t{0}, n_words, int64_t{1} << 15, Sums{},
      [&](int64_t b, int64_t e, Sums acc) {
        uint64_t part[2];
        cpu::digest_words(base, b, e, part);
        return Sums{acc.sum + part[0], acc.xsum + part[1]};
      },
      [](Sums x, Sums y) { return Sums{x.sum + y.sum, x.xsum + y.xsum}; });
  // The zero-padded tail is word n_words; the length tells a tail of zero bytes from none.
  if (nbytes > 8 * n_words) {
    uint64_t w = 0;
    std::memcpy(&w, base + 8 * n_words, static_cast<size_t>(nbytes - 8 * n_words));
    mix_word(w, static_cast<uint64_t>(n_words), s);
  }
  const uint64_t folded = s.sum + ((s.xsum << 32) | (s.xsum >> 32));
  return folded ^ static_cast<uint64_t>(nbytes) * kXorKey;
}

}  // namespace digest
}  // namespace zrw
