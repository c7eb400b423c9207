// A 64-bit digest of a tensor's bytes: MasterWeights records it for each parameter it writes
// back and compares it before the next step, to see writes that bump no version counter
// (through `.data`) without comparing every parameter with its FP32 master (docs/design.md
// §5, "Rules of truth"). Each 8-byte word is mixed with its position (two multiplies, non-linear),
// so reordered, shifted or rewritten bytes change the digest except with probability ~2^-64.
//
// The digest is a sum over words, so it can be taken in pieces: `words` over any split of
// [0, nbytes / 8) into ranges, summed, then `finish` — what zrw._C.bits_digest does with threads,
// and what the write-back does right after writing each parameter (its bytes are then still in
// cache: one pass over memory instead of a copy and a second read later).
#pragma once

#include <cstdint>
#include <cstring>

namespace zrw {
namespace digest {

// The sum of the mixed words [begin, end) of the buffer starting at `base` (word i is the 8
// bytes at base + 8 * i). One loop; digest.cpp compiles it per instruction set (the AVX-512
// build multiplies 8 words at a time) and words() runs the one zrw::cpu::active_isa() names
// (ZRW_CPU_ISA forces it, as for the MX kernels). Every build gives the same sums.
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

uint64_t words(const unsigned char* base, int64_t begin, int64_t end);

// The digest of the `nbytes` bytes at `base`, given `acc`, the sum of words(base, ...) over all
// of [0, nbytes / 8): adds the tail (nbytes % 8 bytes, zero-padded) and the length.
inline uint64_t finish(uint64_t acc, const unsigned char* base, int64_t nbytes) {
  const int64_t n_words = nbytes / 8;
  unsigned char tail[8] = {0};
  std::memcpy(tail, base + 8 * n_words, static_cast<size_t>(nbytes - 8 * n_words));
  acc += words_loop(tail, 0, 1) * (static_cast<uint64_t>(n_words) | 1);
  return acc ^ static_cast<uint64_t>(nbytes) * 0x9E3779B97F4A7C15ULL;
}

}  // namespace digest
}  // namespace zrw
