// The digest's arithmetic on one 8-byte word (common/digest.h): shared by the per-ISA word loops
// (digest_kernel.cpp) and digest.cpp's tail. Plain C++; `static`, so that each per-ISA object
// keeps its own copy (the linker must not hand one build's inline function to another).
//
// The digest sums, over the words i of the buffer (word i is the 8 bytes at base + 8 * i), two
// NH lanes (UMAC's hash, Black et al. 1999) of the word's 32-bit halves a and b, keyed by its
// position with k = i * kAddKey and j = i * kXorKey (mod 2^64):
//
//   sum  += (a + k_lo) * (b + k_hi)     (32-bit sums, a 64-bit product)
//   xsum += (a ^ j_lo) * (b ^ j_hi)
//
// Each lane's product takes both halves through a multiplication, so a change of any bit moves
// a lane by an amount that depends on the rest of the word: no fixed pattern of changes (two
// sign flips in opposite directions, say) cancels, as it can in a sum of words mixed by a fixed
// multiply. The two lanes' algebras differ (add and xor keys), and a change goes unseen only if
// both miss it. Only 32x32->64-bit multiplies: AVX2's and AVX-512's vpmuludq, SSE2's pmuludq.
#pragma once

#include <cstdint>

namespace zrw::digest {

constexpr uint64_t kAddKey = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kXorKey = 0xC2B2AE3D27D4EB4FULL;

// The two lanes' sums over a range of words.
struct Sums {
  uint64_t sum = 0, xsum = 0;
};

// Word `w` at position `i` into `s`.
static inline void mix_word(uint64_t w, uint64_t i, Sums& s) {
  const uint64_t k = i * kAddKey, j = i * kXorKey;
  const uint32_t a = static_cast<uint32_t>(w), b = static_cast<uint32_t>(w >> 32);
  const uint32_t a0 = a + static_cast<uint32_t>(k), b0 = b + static_cast<uint32_t>(k >> 32);
  const uint32_t a1 = a ^ static_cast<uint32_t>(j), b1 = b ^ static_cast<uint32_t>(j >> 32);
  s.sum += static_cast<uint64_t>(a0) * b0;
  s.xsum += static_cast<uint64_t>(a1) * b1;
}

}  // namespace zrw::digest
