// A 64-bit digest of a tensor's bytes: MasterWeights records it for each parameter it writes
// back and compares it before the next step, to see writes that bump no version counter
// (through `.data`) without comparing every parameter with its FP32 master (docs/design.md
// §5, "Rules of truth"). Each 8-byte word is mixed with its position (two multiplies, non-linear),
// so reordered, shifted or rewritten bytes change the digest except with probability ~2^-64.
//
// One function serves both callers: zrw._C.bits_digest (zrw.cache.weight_digest) and the
// write-back, which takes it right after writing each parameter (its bytes are then still in
// cache: one pass over memory instead of a copy and a second read later).
#pragma once

#include <cstdint>

namespace zrw {
namespace digest {

// The digest of the `nbytes` bytes at `base` (read, never written). A sum over the mixed 8-byte
// words, taken by at::parallel_reduce's threads, plus the zero-padded tail and the length.
// digest.cpp compiles the word loop per instruction set (the AVX-512 build multiplies 8 words
// at a time) and runs the one zrw::cpu::active_isa() names (ZRW_CPU_ISA forces it, as for the
// MX kernels). Every build gives the same digests.
uint64_t of(const unsigned char* base, int64_t nbytes);

}  // namespace digest
}  // namespace zrw
