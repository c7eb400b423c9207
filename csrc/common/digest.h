// A 64-bit digest of a tensor's bytes: MasterWeights records it for each parameter it writes
// back and compares it before the next step, to see writes that bump no version counter
// (through `.data`) without comparing every parameter with its FP32 master (docs/design.md
// §5, "Rules of truth"). Each 8-byte word is keyed by its position and hashed by two NH lanes
// (common/digest_words.h), so reordered, shifted or rewritten bytes change the digest except
// with a vanishing probability.
//
// One function serves both callers: zrw._C.bits_digest (zrw.cache.weight_digest) and the
// write-back, which takes it right after writing each parameter (its bytes are then still in
// cache: one pass over memory instead of a copy and a second read later).
#pragma once

#include <cstdint>

namespace zrw {
namespace digest {

// The digest of the `nbytes` bytes at `base` (read, never written). Sums over the hashed 8-byte
// words, taken by at::parallel_reduce's threads, plus the zero-padded tail and the length.
// The word loop is compiled per instruction set with the MX kernels (common/digest_kernel.cpp)
// and runs the build zrw::cpu::active_isa() names (ZRW_CPU_ISA forces it). Every build gives the
// same digests.
uint64_t of(const unsigned char* base, int64_t nbytes);

}  // namespace digest
}  // namespace zrw
